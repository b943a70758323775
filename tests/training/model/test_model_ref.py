"""The champion pointer (models/champion), read from the storage root: untrusted input."""

from __future__ import annotations

from pathlib import Path

import pytest

from training.errors import StorageError
from training.model.model_ref import read_pointer

SHA = "b" * 64


@pytest.mark.parametrize(("damage", "says"), [
    ("not-utf8", "not valid JSON (a byte that is not UTF-8"), ("truncated", "not valid JSON"),
    ("a-folder", "is a folder where a JSON file belongs"), ("not-a-pointer", "is not a champion pointer"),
    ("a-path-for-a-sha", "names no valid sha256")])
def test_a_damaged_pointer_is_one_storage_error_naming_it(tmp_path: Path, damage: str, says: str) -> None:
    """The train stage turns it into "the champion is unusable (...)": a fresh start and a
    promotion (tests/e2e/test_bad_input.py runs that end to end)."""
    pointer = tmp_path / "champion"
    if damage == "a-folder":
        pointer.mkdir()
    else:
        pointer.write_bytes({"not-utf8": b'{"sha256": "\xff\xfe"}', "truncated": b'{"sha256": "' + SHA[:9].encode(),
                             "not-a-pointer": b'["' + SHA.encode() + b'"]',
                             "a-path-for-a-sha": b'{"sha256": "../../etc"}'}[damage])
    with pytest.raises(StorageError, match="champion") as caught:
        read_pointer(pointer)
    assert says in str(caught.value)


def test_no_pointer_is_no_champion_and_a_good_one_reads(tmp_path: Path) -> None:
    assert read_pointer(tmp_path / "champion") is None
    (tmp_path / "champion").write_text(f'{{"sha256": "{SHA}", "run_key": "r"}}')
    pointer = read_pointer(tmp_path / "champion")
    assert pointer is not None and pointer.sha256 == SHA and pointer.run_key == "r"
