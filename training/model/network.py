"""The built-in model (an MLP over standardised numerics, categorical embeddings, vector
columns, and the encoders of text and image columns, with a head per task), user model
factories and their calling conventions, and the content hash of a model's weights."""

from __future__ import annotations

import hashlib
import importlib
import inspect
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from training.config import ModelConfig
from training.data.batch import Batch, Groups, present
from training.data.prepare.features import FeatureStats
from training.data.prepare.text import TextEncoder as Tokens
from training.errors import ConfigError
from training.model.encoders import ImageEncoder, TextEncoder, text_length

__all__ = ["to_device", "ColumnsNet", "Forward", "ModelSchema", "TabularMLP", "factory_model", "forward_fn",
           "load_factory", "weights_sha256"]


Forward = Callable[[Batch], torch.Tensor]
_LEGACY = "_retrain_legacy_forward"  # set on models whose forward is (x_num, x_cat)


@dataclass(frozen=True)
class ModelSchema:
    """What a model factory is told about the data: the columns by kind, their sizes, and the
    task's outputs. A model is called on a `Batch` (`training.data.batch`), whose groups are
    attributes, also readable by name: `num` (standardised numerics, float32), `cat`
    (vocabulary indices, int64; index 0 is unknown), `vec` (the vector columns side by side,
    float32), `tok` (token ids, uint16 or int32, (rows, texts, max_tokens); 0 is padding, each
    text starts with [CLS]), `ntok` (tokens per text, (rows, texts)), `pix` (uint8 RGB pixels,
    (rows, images, 3, image_size, image_size)) and `label`."""

    task: str
    n_outputs: int
    numeric: list[str]
    categorical: list[str]
    cardinalities: list[int]
    vector: list[str] = field(default_factory=list)
    vector_dims: list[int] = field(default_factory=list)
    classes: list[Any] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    vocab_size: int = 0
    max_tokens: int = 0
    image: list[str] = field(default_factory=list)
    image_size: int = 0
    image_mean: list[float] = field(default_factory=list)  # per RGB channel, 0-255 scale (train split)
    image_std: list[float] = field(default_factory=list)
    numeric_bins: list[list[float]] = field(default_factory=list)  # per numeric column, in standardised units

    @classmethod
    def of(cls, stats: FeatureStats) -> ModelSchema:
        n_outputs = len(stats.classes) if stats.task == "multiclass" else 1
        vocab_size = Tokens(stats.tokenizer, stats.max_tokens).vocab_size if stats.text else 0
        return cls(stats.task, n_outputs, list(stats.numeric), list(stats.categorical), stats.cardinalities,
                   list(stats.vector), list(stats.vector_dims), list(stats.classes), list(stats.text), vocab_size,
                   stats.max_tokens, list(stats.image), stats.image_size, list(stats.image_mean),
                   list(stats.image_std), [list(b) for b in stats.numeric_bins])


class ColumnsNet(nn.Module):
    """The built-in model: embeddings for categorical columns, numerics and vectors as they
    are, an MLP over all of them, and a head of the task's width. Over numeric and categorical
    columns alone its parameters are those of the earlier TabularMLP, so packages and
    checkpoints written before it load into it."""

    def __init__(self, schema: ModelSchema, hidden: list[int], embedding_dim: int = 16, dropout: float = 0.0,
                 gradient_checkpointing: bool = False, config: ModelConfig | None = None) -> None:
        super().__init__()
        config = config or ModelConfig()
        self.embeddings = nn.ModuleList(nn.Embedding(c, embedding_dim) for c in schema.cardinalities)
        # Where each column's rows start in the tables stacked as one: every categorical column
        # is looked up in one kernel (`_embed`). Not persistent: derived from the tables, so the
        # state dict (and every package and checkpoint before it) keeps one table per column.
        starts = [0, *itertools.accumulate(schema.cardinalities)][:-1]
        self.register_buffer("_embedding_starts", torch.tensor(starts, dtype=torch.long), persistent=False)
        self.numeric_embedding: nn.Module | None = None
        numeric_width = len(schema.numeric)
        if config.numeric_embedding == "periodic" and schema.numeric:
            from training.model.piecewise import PeriodicEmbeddings

            # lite=False: a linear layer of its own per column (the paper's PLR), not one shared.
            self.numeric_embedding = PeriodicEmbeddings(len(schema.numeric), config.numeric_embedding_dim,
                                                        frequency_init_scale=config.numeric_frequency_scale,
                                                        lite=False)
            numeric_width = len(schema.numeric) * config.numeric_embedding_dim
        elif config.numeric_embedding == "piecewise" and schema.numeric:
            self.numeric_embedding = _piecewise(schema, config.numeric_embedding_dim)
            numeric_width = len(schema.numeric) * config.numeric_embedding_dim
        width = numeric_width + embedding_dim * len(schema.cardinalities) + sum(schema.vector_dims)
        self.text_encoder: TextEncoder | None = None
        self.image_encoder: ImageEncoder | None = None
        if schema.text:
            self.text_encoder = TextEncoder(schema.vocab_size, schema.max_tokens, config.text_dim, config.text_layers,
                                            config.text_heads, config.attention, gradient_checkpointing)
            width += config.text_dim * len(schema.text)
        if schema.image:
            self.image_encoder = ImageEncoder(config.image_channels, schema.image_mean, schema.image_std)
            width += self.image_encoder.width * len(schema.image)
        blocks = []
        for h in hidden:
            blocks.append(nn.Sequential(nn.Linear(width, h), nn.ReLU(), nn.Dropout(dropout)))
            width = h
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(width, schema.n_outputs)
        self.gradient_checkpointing = gradient_checkpointing
        self.uses_vectors = bool(schema.vector)

    def _embed(self, x_cat: torch.Tensor) -> torch.Tensor:
        """Every categorical column's embedding, side by side: one lookup in the column tables
        stacked as one, at each column's offset, instead of a lookup (and a backward) per
        column; the same rows, in the same order, as looking each column up in its own table."""
        tables = [cast(torch.Tensor, emb.weight) for emb in self.embeddings]
        table = tables[0] if len(tables) == 1 else torch.cat(tables)
        starts = cast(torch.Tensor, self._embedding_starts)
        return F.embedding(x_cat + starts, table).flatten(1)

    def forward(self, batch: Batch | Mapping[str, torch.Tensor]) -> torch.Tensor:
        if not isinstance(batch, Groups):
            batch = Batch.of(batch)  # a plain mapping of the groups, as a caller outside training may pass
        x_cat = batch.cat
        num = batch.num
        if self.numeric_embedding is not None:
            num = self.numeric_embedding(num).flatten(1)
        parts = [num, self._embed(x_cat)] if len(self.embeddings) else [num]
        if self.uses_vectors:
            parts.append(present(batch.vec, "vec"))
        if self.text_encoder is not None:
            parts.append(self.text_encoder(present(batch.tok, "tok"), present(batch.ntok, "ntok")))
        if self.image_encoder is not None:
            parts.append(self.image_encoder(present(batch.pix, "pix")))
        x = torch.cat(parts, dim=1)
        for i, block in enumerate(self.blocks):
            # Recompute every other block in backward: about half the activation memory for
            # about a third more compute on those blocks.
            if self.gradient_checkpointing and self.training and i % 2 == 0:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        out = self.head(x)
        return out.squeeze(-1) if out.shape[-1] == 1 else out


def _piecewise(schema: ModelSchema, width: int) -> nn.Module:
    """Piecewise-linear encodings over the train split's quantile bins, then a linear layer per
    column (the paper's PLE; version B, its recommended initialisation)."""
    import warnings

    from training.model.piecewise import PiecewiseLinear

    if len(schema.numeric_bins) != len(schema.numeric):
        raise ConfigError("model.numeric_embedding: piecewise needs the numeric bins that preprocessing fits; these "
                          "feature statistics have none (refit them: run the same command again)")
    bins = [torch.tensor(edges, dtype=torch.float32, device="cpu") for edges in schema.numeric_bins]
    # Built on the CPU even inside a meta-device context (the memory estimate builds models
    # there): rtdl reads the edges back as numbers while it builds the encoding.
    with warnings.catch_warnings(), torch.device("cpu"):
        # A binary or constant column has one bin, which rtdl warns about; it is a scaled copy of
        # the column, as intended.
        warnings.filterwarnings("ignore", message=".*has just two bin edges.*")
        return PiecewiseLinear(bins, width)


class TabularMLP(ColumnsNet):
    """The binary MLP over numerics and categoricals, called as model(x_num, x_cat)."""

    def __init__(self, n_numeric: int, cardinalities: list[int], hidden: list[int], embedding_dim: int = 16,
                 dropout: float = 0.0, gradient_checkpointing: bool = False) -> None:
        schema = ModelSchema("binary", 1, [f"n{i}" for i in range(n_numeric)],
                             [f"c{i}" for i in range(len(cardinalities))], list(cardinalities))
        super().__init__(schema, hidden, embedding_dim, dropout, gradient_checkpointing,
                         ModelConfig(numeric_embedding="none"))  # its numerics enter as they are
        setattr(self, _LEGACY, True)

    def forward(self, x_num: torch.Tensor, x_cat: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(Batch(num=x_num, cat=x_cat))


def load_factory(spec: str) -> object:
    """What `model.factory` names ("package.module:attribute"), imported."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"model.factory: cannot import module '{module_name}' ({err})") from None
    if not hasattr(module, attr):
        raise ConfigError(f"model.factory: '{module_name}' has no attribute '{attr}'")
    return getattr(module, attr)


def _is_legacy_factory(fn: Callable[..., nn.Module]) -> bool:
    """fn(n_numeric, cardinalities, config), the form before fn(schema, config)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) == 3


def factory_model(fn: Callable[..., nn.Module], config: ModelConfig, schema: ModelSchema) -> nn.Module:
    """The model a user factory builds, called as fn(schema, config), its model as model(batch);
    a factory of the older form fn(n_numeric, cardinalities, config) still works, its model
    called as model(x_num, x_cat)."""
    legacy = _is_legacy_factory(fn)
    if legacy and (schema.vector or schema.text or schema.image):
        raise ConfigError(f"model.factory: '{config.factory}' has the old form fn(n_numeric, cardinalities, config), "
                          "which cannot see data.vector, data.text or data.image columns; write it as fn(schema, config)")
    try:
        model = fn(len(schema.numeric), schema.cardinalities, config) if legacy else fn(schema, config)
    except Exception as err:  # the user's code: whatever it raises is theirs to fix
        first = str(err).splitlines()[0][:300] if str(err) else ""
        raise ConfigError(f"model.factory '{config.factory}' raised {type(err).__name__}: {first}; fix the "
                          "factory (its traceback is in the training log)") from err
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.factory: '{config.factory}' returned {type(model).__name__}, expected a torch.nn.Module")
    if legacy:
        setattr(model, _LEGACY, True)
    return model


def to_device(batch: Batch, device: torch.device, non_blocking: bool = False, cut_text: bool = True) -> Batch:
    """The batch on `device`, its token ids first cut on the host to the batch's longest text
    (`text_length`), where the lengths already are: the text encoder then learns the length
    without a device-to-host sync, and fewer bytes cross to the device. `cut_text=False` for a
    compiled model, which keeps one shape."""
    if cut_text and batch.tok is not None and batch.tok.device.type == "cpu":
        batch = batch.replace(tok=batch.tok[..., :text_length(present(batch.ntok, "ntok"))])
    return batch.map(lambda v: v.to(device, non_blocking=non_blocking))


def forward_fn(module: nn.Module, like: nn.Module | None = None) -> Forward:
    """`module` called on a batch, in the calling convention of the model it wraps (`like`:
    DDP and torch.compile wrappers do not carry the model's attributes)."""
    if getattr(like if like is not None else module, _LEGACY, False):
        return lambda batch: module(batch.num, batch.cat)
    return module


def weights_sha256(state_dict: Mapping[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and raw bytes: equal weights give equal hashes,
    whatever container or file format they were saved in."""
    h = hashlib.sha256()
    for name in sorted(state_dict):
        t = state_dict[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
