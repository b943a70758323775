"""The feature transform's categorical lookup: vocabulary position + 1, unknown values 0, an
empty vocabulary all 0; and no pandas import on the way (pyarrow's pa.array() would cost every
training process 0.2 s in its first epoch)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from training.data.prepare.features import FeatureStats

_CHECK = """
import sys
import numpy as np
from training.data.prepare.features import FeatureStats
stats = FeatureStats(numeric=["x"], categorical=["c"], mean=[0.0], std=[1.0], vocab=[[5, 3, 9]])
stats.transformer()(np.zeros((3, 1)), np.array([[3], [7], [9]]))
print("pandas" in sys.modules)
"""


def test_categories_map_to_vocabulary_position_plus_one_and_unknowns_to_zero() -> None:
    stats = FeatureStats(numeric=["x"], categorical=["a", "b", "c"], mean=[1.0], std=[2.0],
                         vocab=[[5, 3, 9], [], [11]])
    cat = np.array([[3, 1, 11], [7, 2, 11], [9, 3, 12], [5, 4, 11]], dtype=np.int64)
    num = np.array([[1.0], [3.0], [np.nan], [-1.0]])
    x, idx = stats.transformer()(num, cat)
    assert idx.tolist() == [[2, 0, 1], [0, 0, 1], [3, 0, 0], [1, 0, 1]]
    assert x.dtype == np.float32 and x[:, 0].tolist() == [0.0, 1.0, 0.0, -1.0]  # NaN -> 0
    # A column view with an offset (rows 1..3 of a wider array) gives the same lookups.
    _, tail = stats.transformer()(num[1:], cat[1:])
    assert tail.tolist() == idx[1:].tolist()


def test_the_lookup_does_not_import_pandas() -> None:
    out = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
