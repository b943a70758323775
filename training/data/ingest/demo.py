"""The built-in demo: a synthetic shop dataset drawn from a known model.

Because the click probability is known, the demo can report the Bayes-optimal AUC: the best
any model could reach on these rows, which tells a user how far from the ceiling training got.

Besides the binary label `clicked`, it holds a label per other task and a vector column, drawn
from their own random stream after the click columns (which stay what they were):
- `segment`: the shopper segment, 4 string classes (multiclass);
- `basket_value`: the basket's value in dollars (regression);
- `embedding`: an 8-float user embedding (data.vector), which carries part of the segment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel

from training.config import DEMO_CATEGORICAL, DEMO_NUMERIC
from training.metrics import roc_auc

__all__ = ["ensure_demo_dataset", "ensure_reviews_demo", "ensure_shapes_demo", "DEMOS", "DEMO_ROWS", "DEMO_SEED"]

DEMO_ROWS = 200_000
DEMO_SEED = 20261121
_CATEGORIES = 40
_CARDINALITY = {"category": _CATEGORIES, "device": 3, "region": 60, "brand": 300}  # DEMO_CATEGORICAL's order


@dataclass(frozen=True)
class _Shop:
    """The demo's numeric columns (DEMO_NUMERIC, in its order) and its category codes."""

    price: np.ndarray
    discount: np.ndarray
    rating: np.ndarray
    reviews_log: np.ndarray
    position: np.ndarray
    dwell_prev: np.ndarray
    category: np.ndarray
    device: np.ndarray
    region: np.ndarray
    brand: np.ndarray

    def numeric(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in DEMO_NUMERIC}


def _draw(rng: np.random.Generator, rows: int) -> tuple[_Shop, np.ndarray, dict[str, np.ndarray]]:
    """The columns, the unrounded price the click depends on, then each category's effect on the
    click, in one fixed order of draws (the same seed gives the same bytes)."""
    price = rng.lognormal(3.0, 0.8, rows)
    numeric = [price.round(2), rng.beta(1.5, 6.0, rows).round(3), np.clip(rng.normal(4.0, 0.6, rows), 1, 5).round(1),
               rng.gamma(2.0, 1.5, rows), rng.integers(1, 41, rows).astype(np.int64), rng.exponential(30.0, rows)]
    codes = [rng.zipf(1.6, rows) % card for card in _CARDINALITY.values()]
    effects = {name: rng.normal(0, 0.6, card) for name, card in _CARDINALITY.items()}
    return _Shop(*numeric, *codes), price, effects


def ensure_demo_dataset(root: Path, rows: int = DEMO_ROWS, seed: int = DEMO_SEED) -> tuple[Path, float]:
    """Write the demo Parquet under `root/demo/` once; return its path and Bayes-optimal AUC."""
    demo_dir = root / "demo"
    path = demo_dir / f"shop-{rows}-{seed}.parquet"
    meta_path = path.with_suffix(".json")
    if path.exists() and meta_path.exists():
        return path, DemoMeta.model_validate_json(meta_path.read_text()).bayes_auc

    rng = np.random.default_rng(seed)
    shop, price, effects = _draw(rng, rows)
    logit = (
        -1.6
        - 0.35 * (np.log(price) - 3.0)
        + 2.2 * shop.discount
        + 0.5 * (shop.rating - 4.0)
        + 0.15 * shop.reviews_log
        - 0.9 * np.log(shop.position)
        + 0.01 * np.minimum(shop.dwell_prev, 120)
        + 1.5 * shop.discount * (shop.rating > 4.3)  # an interaction a linear model misses
    )
    for name in DEMO_CATEGORICAL:
        logit += effects[name][getattr(shop, name)]
    prob = 1.0 / (1.0 + np.exp(-logit))
    label = (rng.random(rows) < prob).astype(np.int8)
    table = pa.table({
        **shop.numeric(),
        "category": pa.array([f"cat-{c:02d}" for c in shop.category]),
        "device": pa.array(np.array(["mobile", "desktop", "tablet"])[shop.device]),
        "region": pa.array(shop.region.astype(np.int64)),
        "brand": pa.array([f"b{c}" for c in shop.brand]),
        "clicked": pa.array(label),
        **_other_tasks(np.random.default_rng([seed, 1]), shop),
    })
    demo_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(table, tmp, row_group_size=50_000)
    os.replace(tmp, path)
    meta = DemoMeta(rows=rows, seed=seed, bayes_auc=roc_auc(label, prob))
    meta_tmp = meta_path.with_name(f".{meta_path.name}.tmp-{os.getpid()}")
    meta_tmp.write_text(meta.model_dump_json())
    os.replace(meta_tmp, meta_path)
    return path, meta.bayes_auc


class DemoMeta(BaseModel):
    """Beside the demo file: how it was generated, and the best AUC any model can reach on it."""

    rows: int
    seed: int
    bayes_auc: float


SEGMENTS = np.array(["bargain", "mainstream", "niche", "premium"])


def _other_tasks(rng: np.random.Generator, shop: _Shop) -> dict[str, pa.Array]:
    """The multiclass label, the regression label and the vector column (see the docstring)."""
    rows = len(shop.price)
    embedding = rng.normal(0.0, 1.0, (rows, 8)).astype(np.float32)
    log_price = np.log(shop.price) - 3.0
    segment_logits = np.stack([
        -1.5 * log_price + 3.0 * shop.discount,  # bargain
        np.zeros(rows),  # mainstream
        0.02 * (shop.brand % 50) - 0.5 + 0.8 * embedding[:, 0],  # niche
        1.5 * log_price + 0.8 * (shop.rating - 4.0) + 0.8 * embedding[:, 1],  # premium
    ], axis=1)
    segment = (segment_logits + rng.gumbel(0.0, 0.5, segment_logits.shape)).argmax(axis=1)
    category_effect = rng.normal(0.0, 8.0, _CATEGORIES)
    basket = (30.0 + 0.6 * shop.price * (1.0 - shop.discount) + 4.0 * np.log1p(shop.dwell_prev)
              + category_effect[shop.category] + 3.0 * embedding[:, 2] + rng.normal(0.0, 5.0, rows))
    return {
        "segment": pa.array(SEGMENTS[segment]),
        "basket_value": pa.array(basket.round(2)),
        "embedding": pa.FixedSizeListArray.from_arrays(pa.array(embedding.ravel()), 8),
    }


def _write_table(table: pa.Table, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(table, tmp, row_group_size=10_000)
    os.replace(tmp, path)


_TOPICS = {
    "shipping": ["delivery", "parcel", "courier", "arrived", "shipping", "box", "late", "tracking"],
    "quality": ["material", "stitching", "build", "broke", "sturdy", "fabric", "quality", "finish"],
    "price": ["price", "cheap", "expensive", "value", "discount", "cost", "money", "deal"],
    "service": ["support", "refund", "agent", "reply", "service", "helpful", "rude", "email"],
}
_GOOD = ["good", "great", "excellent", "happy", "love", "perfect", "fine", "recommend"]
_BAD = ["bad", "poor", "awful", "unhappy", "hate", "terrible", "disappointing", "worst"]
_FILLER = ["the", "a", "it", "was", "and", "this", "my", "order", "item", "really", "very", "so", "i", "with"]


def ensure_reviews_demo(root: Path, rows: int = 40_000, seed: int = DEMO_SEED) -> Path:
    """`demo:reviews`: short product reviews (`review`, text) with a `topic` (4 string classes:
    the topic words in the text) and a `positive` label (0/1: the sentiment words, which a
    preceding "not" flips, so word counts alone cannot read every review)."""
    path = root / "demo" / f"reviews-{rows}-{seed}.parquet"
    if path.exists():
        return path
    rng = np.random.default_rng([seed, 2])
    topics = list(_TOPICS)
    topic = rng.integers(0, len(topics), rows)
    positive = rng.random(rows) < 0.5
    reviews = []
    for i in range(rows):
        words = list(rng.choice(_FILLER, rng.integers(3, 12)))
        # A few words of the topic, a few of another topic (noise), and the sentiment.
        words += list(rng.choice(_TOPICS[topics[topic[i]]], rng.integers(1, 4)))
        words += list(rng.choice(_TOPICS[topics[rng.integers(0, len(topics))]], rng.integers(0, 2)))
        negated = rng.random() < 0.3
        said = positive[i] != negated  # "not good" is negative
        sentiment = str(rng.choice(_GOOD if said else _BAD))
        words.append(f"not {sentiment}" if negated else sentiment)
        rng.shuffle(words)
        reviews.append(" ".join(words))
    flip = rng.random(rows) < 0.05  # label noise: no model reaches 100 %
    _write_table(pa.table({
        "review": pa.array(reviews),
        "topic": pa.array(np.array(topics)[topic]),
        "positive": pa.array((positive ^ flip).astype(np.int8)),
    }), path)
    return path


SHAPES = np.array(["circle", "cross", "square", "triangle"])


def ensure_shapes_demo(root: Path, rows: int = 8_000, seed: int = DEMO_SEED, size: int = 24) -> Path:
    """`demo:shapes`: small images (`image`, PNG or JPEG bytes) of a coloured shape at a random
    place and size on a noisy background, labelled `shape` (4 string classes)."""
    import io

    from PIL import Image

    path = root / "demo" / f"shapes-{rows}-{seed}-{size}.parquet"
    if path.exists():
        return path
    rng = np.random.default_rng([seed, 3])
    label = rng.integers(0, len(SHAPES), rows)
    yy, xx = np.mgrid[0:size, 0:size]
    images = []
    for i in range(rows):
        r = rng.uniform(size * 0.18, size * 0.35)
        cy, cx = rng.uniform(r, size - r, 2)
        dy, dx = np.abs(yy - cy), np.abs(xx - cx)
        mask = [dy**2 + dx**2 <= r**2,  # circle
                ((dy <= r * 0.3) & (dx <= r)) | ((dx <= r * 0.3) & (dy <= r)),  # cross
                (dy <= r * 0.8) & (dx <= r * 0.8),  # square
                (yy - cy + r >= 0) & (yy - cy <= r) & (dx <= (yy - cy + r) / 2)][label[i]]  # triangle
        pixels = rng.normal(110, 30, (size, size, 3))
        pixels[mask] = rng.uniform(60, 255, 3)
        img = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
        buf = io.BytesIO()
        img.save(buf, format="PNG" if i % 2 else "JPEG", quality=90)
        images.append(buf.getvalue())
    _write_table(pa.table({"image": pa.array(images, pa.binary()), "shape": pa.array(SHAPES[label])}), path)
    return path


DEMOS = {"demo:reviews": ensure_reviews_demo, "demo:shapes": ensure_shapes_demo}
