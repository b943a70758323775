"""What the training child reads is what its parent decided. The job reaches it sealed (its
sha256 on the child's command line), and every file of the storage root the job names is read
against the digest the parent pinned: whoever else writes the root can choose neither the
config, nor the code, nor a path, nor the data."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest

from tests.training.helpers import make_job
from training.config import RetrainConfig
from training.errors import StorageError
from training.protocol.job import JOB_FIELD_TRUST, TrainJob
from training.protocol.sealed import Sealed, seal


def test_every_field_of_a_job_says_why_the_child_may_trust_it() -> None:
    """A new field is neither keyed nor checked until it says which: this fails first."""
    names = [f.name for f in fields(TrainJob)]
    assert sorted(JOB_FIELD_TRUST) == sorted(names)
    for name, why in JOB_FIELD_TRUST.items():
        if why.startswith("digest: "):
            digest = why.removeprefix("digest: ").split()[0].rstrip(";")
            assert digest in names, f"{name} is checked by {digest}, which is not a field of the job"


def test_a_bare_path_or_a_changed_file_is_refused(tmp_path: Path) -> None:
    sealed = seal(tmp_path / "job.json", b'{"a": 1}')
    assert Sealed.parse(sealed.arg()) == sealed and sealed.read("the job") == b'{"a": 1}'
    with pytest.raises(StorageError, match="is not a sealed input"):
        Sealed.parse(str(tmp_path / "job.json"))
    (tmp_path / "job.json").write_bytes(b'{"a": 2}')
    with pytest.raises(StorageError, match="changed after the parent wrote it"):
        sealed.read("the job")


def _pinned_job(config: RetrainConfig) -> TrainJob:
    job = make_job(config)
    job.pin_inputs()
    assert job.manifest_sha256 and job.stats_sha256
    return job


@pytest.mark.parametrize("what", ["stats", "manifest"])
def test_root_files_the_job_names_are_read_against_the_parents_digest(what: str, small_config: RetrainConfig) -> None:
    """The statistics and the manifest are replaced after the parent pinned them (with
    well-formed files: another run's statistics, a manifest that lists fewer shards): the
    trainer refuses them before it builds anything from them."""
    from training.trainer.run import train

    job = _pinned_job(small_config)
    if what == "stats":
        path = Path(job.stats_path)
        stats = json.loads(path.read_text())
        stats["mean"] = [m + 1.0 for m in stats["mean"]]
    else:
        path = Path(job.dataset_dir) / "manifest.json"
        stats = json.loads(path.read_text())
        stats["shards"] = stats["shards"][:-1]
    path.write_text(json.dumps(stats))
    with pytest.raises(StorageError, match="changed after the parent read it"):
        train(job)
    assert not (Path(job.run_dir) / "checkpoints").exists() or not any((Path(job.run_dir) / "checkpoints").iterdir())
