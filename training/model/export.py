"""The portable export of a model package: `export/model.pt2` (torch.export) and
`export/preprocess.json`, loadable by anything with torch and without this project:

    program = torch.export.load("export/model.pt2").module()
    scores = program(num, cat)          # or (num, cat, vec) when the model has vector columns

Why torch.export and not ONNX: it needs nothing but torch to write and to load (no onnx or
onnxscript in the training image), keeps the exact kernels the package was evaluated with,
and AOTInductor compiles the same file for C++ serving.

The graph holds the preprocessing that is arithmetic: standardising the numerics (a null, NaN,
becomes the train mean) and looking the categories' hashes up in the vocabulary (an unseen one
is index 0), and the task's output transform (sigmoid, softmax, or the label's units). What a
graph cannot do, hashing a category's string, is written down in preprocess.json.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch import nn

from training.data.batch import Batch
from training.data.ingest.ragged import Ragged
from training.data.prepare.features import FeatureStats
from training.data.prepare.text import TextEncoder
from training.model.network import forward_fn
from training.model.target_transform import LabelTransform
from training.storage.files import write_atomic, write_json_atomic

__all__ = ["EXPORT_DIR", "ExportScorer", "export_portable", "exported_files"]

log = logging.getLogger(__name__)
EXPORT_DIR = "export"
EXPORT_VERSION = 1

CATEGORY_HASH = ("cat[:, j] is the category's 63-bit hash: the value cast to a string (Arrow's cast, e.g. 3 -> '3'), "
                 "h = int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), 'little') >> 1, then "
                 "h or 1; a null is 0")


TOKENIZER_FILE = "tokenizer.json"
TEXT_HOW = ("token ids: tokenizer.encode(text, add_special_tokens=False).ids truncated to max_tokens - 1, after "
            "the id of [CLS] (tokenizer.token_to_id('[CLS]')), padded with 0 (a null text: [CLS] alone); dtype uint16 "
            "when the vocabulary has at most 65,536 tokens, else int32")
IMAGE_HOW = ("the image decoded with Pillow, converted to RGB, resized to {size}x{size} (bilinear) when it is "
             "not that size, channels first")


class ExportScorer(nn.Module):
    """The package's model with its arithmetic preprocessing and output transform in front
    and behind: raw numerics and category hashes in, what `retrain predict` writes out."""

    mean: torch.Tensor
    inv_std: torch.Tensor

    def __init__(self, model: nn.Module, stats: FeatureStats) -> None:
        super().__init__()
        self.model, self.task = model, stats.task
        self.register_buffer("mean", torch.tensor(stats.mean, dtype=torch.float32).reshape(1, -1))
        self.register_buffer("inv_std", (1.0 / torch.tensor(stats.std, dtype=torch.float64)).float().reshape(1, -1))
        for j, hashes in enumerate(stats.vocab):
            order = sorted(range(len(hashes)), key=hashes.__getitem__)
            # Index p + 1 for vocabulary position p; an empty vocabulary gets one impossible hash.
            self.register_buffer(f"hashes{j}", torch.tensor([hashes[p] for p in order] or [-1], dtype=torch.int64))
            self.register_buffer(f"index{j}", torch.tensor([p + 1 for p in order] or [0], dtype=torch.int64))
        self.n_cat = len(stats.vocab)
        self.names = input_names(stats)
        self.label = LabelTransform(stats)
        self.forward_model = forward_fn(model)

    def _lookup(self, cat: torch.Tensor) -> torch.Tensor:
        columns = []
        for j in range(self.n_cat):
            hashes, index = getattr(self, f"hashes{j}"), getattr(self, f"index{j}")
            pos = torch.searchsorted(hashes, cat[:, j].contiguous()).clamp(max=hashes.numel() - 1)
            found = hashes[pos] == cat[:, j]
            columns.append(torch.where(found, index[pos], torch.zeros_like(pos)))
        return torch.stack(columns, dim=1) if columns else cat

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        """`inputs` in the order of `input_names(stats)`."""
        raw = Batch.of(dict(zip(self.names, inputs, strict=True)))
        batch = raw.replace(num=torch.nan_to_num((raw.num - self.mean) * self.inv_std, nan=0.0), cat=self._lookup(raw.cat))
        out = self.forward_model(batch).float()
        if self.task == "binary":
            return torch.sigmoid(out)
        if self.task == "multiclass":
            return torch.softmax(out, dim=-1)
        return self.label(out)


def input_names(stats: FeatureStats) -> list[str]:
    return ["num", "cat", *(["vec"] if stats.vector else []), *(["tok", "ntok"] if stats.text else []),
            *(["pix"] if stats.image else [])]


def _examples(stats: FeatureStats) -> tuple[torch.Tensor, ...]:
    """Two rows of each input, with the dtypes preprocessing gives them."""
    out = [torch.zeros(2, len(stats.numeric)), torch.zeros(2, len(stats.vocab), dtype=torch.int64)]
    if stats.vector:
        out.append(torch.zeros(2, sum(stats.vector_dims)))
    if stats.text:
        ids, lengths = TextEncoder(stats.tokenizer, stats.max_tokens).encode(Ragged.from_arrow(pa.array(["a"] * 2)))
        out.append(torch.from_numpy(np.repeat(ids[:, None], len(stats.text), 1)))
        out.append(torch.from_numpy(np.repeat(lengths[:, None], len(stats.text), 1)))
    if stats.image:
        out.append(torch.zeros(2, len(stats.image), 3, stats.image_size, stats.image_size, dtype=torch.uint8))
    return tuple(out)


def _preprocess_doc(stats: FeatureStats, program_sha256: str) -> dict[str, Any]:
    inputs = input_names(stats)
    return {
        "version": EXPORT_VERSION,
        "program": "model.pt2",
        "program_sha256": program_sha256,
        "load": "torch.export.load('model.pt2').module()",
        "inputs": {
            "num": {"columns": stats.numeric, "dtype": "float32", "shape": ["rows", len(stats.numeric)],
                    "how": "the raw values; a null as NaN (standardised in the graph)"},
            "cat": {"columns": stats.categorical, "dtype": "int64", "shape": ["rows", len(stats.categorical)],
                    "how": CATEGORY_HASH},
            **({"vec": {"columns": stats.vector, "dims": stats.vector_dims, "dtype": "float32",
                        "how": "the vectors' values side by side, in column order"}} if stats.vector else {}),
            **({"tok": {"columns": stats.text, "shape": ["rows", len(stats.text), stats.max_tokens],
                        "how": TEXT_HOW + f" (the tokenizer: {TOKENIZER_FILE}, tokenizers.Tokenizer.from_file)"},
                "ntok": {"columns": stats.text, "shape": ["rows", len(stats.text)],
                         "how": "tokens kept per text, [CLS] included"}} if stats.text else {}),
            **({"pix": {"columns": stats.image, "dtype": "uint8",
                        "shape": ["rows", len(stats.image), 3, stats.image_size, stats.image_size],
                        "how": IMAGE_HOW.format(size=stats.image_size)}} if stats.image else {}),
        },
        "argument_order": inputs,
        "output": {"binary": "probability of label 1, shape [rows]",
                   "multiclass": "class probabilities, shape [rows, classes], in the order of `classes`",
                   "regression": "the predicted value in the label's units, shape [rows]"}[stats.task],
        "task": stats.task,
        "label": stats.label,
        "classes": stats.classes,
    }


def export_portable(package_dir: Path, model: nn.Module, stats: FeatureStats) -> None:
    """Write `<package>/export/` (with the tokenizer for text columns); torch.export's errors
    (a custom model it cannot trace) are the caller's to report."""
    out = package_dir / EXPORT_DIR
    if (out / "preprocess.json").exists():
        return  # written before (a retried promotion)
    scorer = ExportScorer(model, stats).eval()
    rows = torch.export.Dim("rows", min=1)
    example = _examples(stats)
    with torch.no_grad():
        # One dynamic dimension, the rows, for every input (forward takes them as *inputs).
        program = torch.export.export(scorer, example, dynamic_shapes=(tuple({0: rows} for _ in example),))
    out.mkdir(parents=True, exist_ok=True)
    if stats.text:
        write_atomic(out / TOKENIZER_FILE, stats.tokenizer.encode())
    tmp = out / f".tmp-{os.getpid()}.model.pt2"  # torch.export.save wants the .pt2 suffix
    torch.export.save(program, tmp)
    digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
    os.replace(tmp, out / "model.pt2")
    write_json_atomic(out / "preprocess.json", _preprocess_doc(stats, digest))  # last: marks the export complete
    log.info("portable export written: %s", out / "model.pt2")


def exported_files(package_dir: Path) -> list[str]:
    """The export's files relative to the package, when there is a complete export."""
    if not (package_dir / EXPORT_DIR / "preprocess.json").exists():
        return []
    tokenizer = [f"{EXPORT_DIR}/{TOKENIZER_FILE}"] if (package_dir / EXPORT_DIR / TOKENIZER_FILE).exists() else []
    return [f"{EXPORT_DIR}/model.pt2", *tokenizer, f"{EXPORT_DIR}/preprocess.json"]
