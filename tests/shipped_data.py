"""Test datasets built from data an installed package ships (nothing is downloaded)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

DIGIT_NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def png(pixels: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def write_digit_images(path: Path, copies: int = 1) -> Path:
    """scikit-learn's 8x8 digits as PNG files in a binary column `image`, the label `digit`, and
    a text column `note` of hints (the digit's name in a third of the rows), `copies` times over
    (copies repeat rows: the splits then share images); 500-row row groups, so packing fans out over several parts."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    gray = (digits.images * (255 / 16)).astype(np.uint8)
    rng = np.random.default_rng(0)
    notes = [f"looks like {DIGIT_NAMES[d]}" if rng.random() < 0.33 else "hard to read" for d in digits.target]
    pq.write_table(pa.table({"image": pa.array([png(g) for g in gray] * copies, pa.binary()),
                             "note": pa.array(notes * copies), "digit": pa.array(np.tile(digits.target, copies))}),
                   path, row_group_size=500)
    return path
