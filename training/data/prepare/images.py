"""Image columns: encoded PNG/JPEG -> RGB uint8 pixels at one size, decoded once by preprocessing.

Pillow decodes; uint8 keeps the stored pixels 4x smaller than float32, and the model normalises
them per channel (train mean and std) on the fly.
"""

from __future__ import annotations

import io

import numpy as np

from training.data.ingest.ragged import Ragged

__all__ = ["AUTO_SIZE_CAP", "UndecodableImage", "decode_images", "largest_side"]

# preprocess.image_size when it is not set: the images' own size, at most this. Resizing small
# images up adds no information and costs accuracy: 8x8 digits scaled up to 32 px trained to a
# clearly lower test accuracy than the same model on the 8 px originals.
AUTO_SIZE_CAP = 32


class UndecodableImage(ValueError):
    def __init__(self, index: int, reason: str) -> None:
        super().__init__(reason)
        self.index = index


def decode_images(images: Ragged, size: int) -> np.ndarray:
    """(rows, 3, size, size) uint8; the first image Pillow cannot decode raises
    UndecodableImage with its index."""
    from PIL import Image, UnidentifiedImageError

    out = np.empty((len(images), 3, size, size), dtype=np.uint8)
    for i in range(len(images)):
        try:
            with Image.open(io.BytesIO(images.value(i))) as img:
                img.draft("RGB", (size, size))  # JPEG: decode at a reduced scale when it is enough
                rgb = img.convert("RGB")
                if rgb.size != (size, size):
                    rgb = rgb.resize((size, size), Image.Resampling.BILINEAR)
                out[i] = np.asarray(rgb).transpose(2, 0, 1)
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as err:
            raise UndecodableImage(i, str(err) or type(err).__name__) from None
    return out


def largest_side(images: Ragged, limit: int = 256) -> int:
    """The largest width or height among the first `limit` images (read from their headers;
    one Pillow cannot open is skipped here and reported by decode_images); 0 when none opens."""
    from PIL import Image, UnidentifiedImageError

    side = 0
    for i in range(min(len(images), limit)):
        try:
            with Image.open(io.BytesIO(images.value(i))) as img:
                side = max(side, *img.size)
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError):
            continue
    return side
