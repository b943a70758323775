"""Batch scoring with a model package: exact agreement with evaluation, idempotent output,
refused tampering, and one-line errors for bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests.training.helpers import make_job
from training.config import RetrainConfig
from training.data.manifest import load_manifest
from training.data.ingest.segments import split_of_file
from training.errors import CheckpointError, DataError
from training.model.evaluation import evaluate_package
from training.trainer.run import train
from training.model.package import meta_sha256
from training.model.batch_scoring import load_scoring_model, predict_files
from training.model.objectives import BinaryTask


@pytest.fixture
def trained(small_config: RetrainConfig) -> tuple[RetrainConfig, Path, Path]:
    job = make_job(small_config)
    result = train(job)
    return small_config, Path(result.model.uri).parent, Path(job.dataset_dir)


def _test_split(config: RetrainConfig, out: Path) -> Path:
    """The source rows the pack stage put in the test split, in their order."""
    table = pq.read_table(config.data.source)
    split = split_of_file(Path(str(config.data.source)), config.data)
    # Small row groups: the scorer must still batch exactly as evaluation does.
    pq.write_table(table.filter(pa.array(split == 2)), out, row_group_size=700)
    return out


def test_scoring_the_test_split_gives_the_evaluation_metrics_exactly(trained, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    config, package, dataset_dir = trained
    # Small batches and read chunks: many of both, misaligned with the file's row groups.
    monkeypatch.setattr("training.model.evaluation.EVAL_BATCH", 128)
    monkeypatch.setattr("training.model.batch_scoring.SCORE_BATCH", 128)
    monkeypatch.setattr("training.model.batch_scoring.READ_ROWS", 384)
    expected = evaluate_package(package, dataset_dir, load_manifest(dataset_dir), None)
    source = _test_split(config, tmp_path / "test.parquet")
    result = predict_files([source], load_scoring_model(package, None), tmp_path / "scores.parquet")
    scores = pq.read_table(result.output)
    assert result.rows == expected["rows"] == scores.num_rows
    labels = scores.column(config.data.label).to_numpy().astype(np.float32)
    got = BinaryTask.evaluate(BinaryTask.__new__(BinaryTask), labels, scores.column("probability").to_numpy())
    assert got == {k: v for k, v in expected.items() if k != "rows"}  # to the last digit
    assert scores.column_names == [*pq.read_schema(source).names, "probability", "prediction"]
    meta = scores.schema.metadata
    assert meta[b"retrain.model_sha256"].decode() == json.loads((package / "model.json").read_text())["sha256"]


def test_a_rerun_is_a_no_op_and_other_input_is_scored_again(trained, tmp_path: Path) -> None:
    config, package, _ = trained
    source = _test_split(config, tmp_path / "in.parquet")
    out = tmp_path / "scores.parquet"
    scoring = load_scoring_model(package, None)
    first = predict_files([source], scoring, out, keys=["clicked"])
    stamp = out.stat().st_mtime_ns
    again = predict_files([source], scoring, out, keys=["clicked"])
    assert not first.skipped and again.skipped and out.stat().st_mtime_ns == stamp
    assert pq.read_schema(out).names == ["clicked", "probability", "prediction"]
    table = pq.read_table(source)
    pq.write_table(table.slice(0, 100), source)
    changed = predict_files([source], scoring, out, keys=["clicked"])
    assert not changed.skipped and changed.rows == 100
    assert not list(tmp_path.glob(".scores.parquet.tmp-*"))


def test_a_tampered_package_is_refused(trained, tmp_path: Path) -> None:
    _, package, _ = trained
    copy = tmp_path / "pkg"
    shutil.copytree(package, copy)
    state = torch.load(copy / "model.pt", weights_only=True)
    name = next(iter(state))
    state[name] = state[name] + 1e-3  # one layer's weights replaced
    torch.save(state, copy / "model.pt")
    with pytest.raises(CheckpointError, match="weights do not match their sha256"):
        load_scoring_model(copy, None)
    meta = json.loads((package / "model.json").read_text())
    meta["feature_stats"]["mean"][0] += 1.0  # the preprocessing changed: the champion pointer's hash catches it
    (copy / "model.json").write_text(json.dumps(meta))
    shutil.copy(package / "model.pt", copy / "model.pt")
    with pytest.raises(CheckpointError, match="model.json does not match the sha256 recorded"):
        load_scoring_model(copy, None, expected_meta_sha256=meta_sha256(package))


def test_bad_input_is_one_line_naming_the_file_and_column(trained, tmp_path: Path) -> None:
    config, package, _ = trained
    scoring = load_scoring_model(package, None)
    table = pq.read_table(config.data.source).slice(0, 50)
    numeric = config.data.numeric[0]

    missing = tmp_path / "missing.parquet"
    pq.write_table(table.drop_columns([numeric]), missing)
    with pytest.raises(DataError, match=rf"missing.parquet: missing column\(s\) \['{numeric}'\]"):
        predict_files([missing], scoring, tmp_path / "o1.parquet")

    wrong = tmp_path / "wrong.parquet"
    pq.write_table(table.set_column(table.schema.get_field_index(numeric), numeric,
                                    pa.array(["x"] * 50)), wrong)
    with pytest.raises(DataError, match=rf"wrong.parquet: column '{numeric}' has non-numeric value 'x' at row 0"):
        predict_files([wrong], scoring, tmp_path / "o2.parquet")

    empty = tmp_path / "empty.parquet"
    pq.write_table(table.slice(0, 0), empty)
    with pytest.raises(DataError, match="has no rows to score"):
        predict_files([empty], scoring, tmp_path / "o3.parquet")
    assert not (tmp_path / "o3.parquet").exists()


def test_an_output_that_cannot_be_written_is_one_line(trained, tmp_path: Path) -> None:
    """A full disk, or an output path that cannot be a file, is one StorageError naming the
    output; no temporary file is left."""
    from training.errors import ConfigError, StorageError
    from training.pipeline.predict_stage import predict_stage

    config, package, _ = trained
    scoring = load_scoring_model(package, None)
    source = _test_split(config, tmp_path / "in.parquet")
    (tmp_path / "a-file").write_text("")
    with pytest.raises(StorageError, match=r"cannot write the scores to .*a-file/scores.parquet: .*a-file is not a folder"):
        predict_files([source], scoring, tmp_path / "a-file" / "scores.parquet")
    with pytest.raises(StorageError, match=r"cannot write the scores to /proc/self/mem"):
        predict_files([source], scoring, Path("/proc/self/mem"))
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    shutil.copy(source, inputs / "day.parquet")
    with pytest.raises(ConfigError, match=r"is inside the input folder .*: the next run would read the scores"):
        predict_stage(config, str(inputs), str(inputs / "scores.parquet"))


def test_a_full_disk_while_scoring_is_one_line(trained, tmp_path: Path) -> None:
    from tests.conftest import small_filesystem
    from training.errors import StorageError

    config, package, _ = trained
    source = _test_split(config, tmp_path / "in.parquet")
    with small_filesystem(tmp_path / "disk", 64) as disk:
        with pytest.raises(StorageError, match=r"scores.parquet: No space left on device") as err:
            predict_files([source], load_scoring_model(package, None), disk / "scores.parquet")
        assert "\n" not in str(err.value) and list(disk.iterdir()) == []


def test_no_champion_yet_is_one_line(small_config: RetrainConfig) -> None:
    from training.pipeline.predict_stage import resolve_model

    with pytest.raises(CheckpointError, match=r"no champion yet at .*models/champion: run `retrain run`"):
        resolve_model(small_config, "champion")
    with pytest.raises(CheckpointError, match="neither 'champion', a 64-hex model sha256, nor a package folder"):
        resolve_model(small_config, "/nowhere")


CHILD = """
import sys, numpy as np, torch
program = torch.export.load(sys.argv[1]).module()
num, cat = np.load(sys.argv[2]), np.load(sys.argv[3])
with torch.no_grad():
    np.save(sys.argv[4], program(torch.from_numpy(num), torch.from_numpy(cat)).numpy())
assert not any(m.split('.')[0] in ('training', 'tasks', 'flows', 'retrain_cli') for m in sys.modules), 'project imported'
"""


def test_the_export_loads_without_the_project_and_scores_as_the_package(trained, tmp_path: Path) -> None:
    import subprocess
    import sys

    from training.data.ingest.validation import category_hash
    from training.model.export import export_portable

    config, package, _ = trained
    scoring = load_scoring_model(package, None)
    export_portable(package, scoring.model, scoring.stats)
    doc = json.loads((package / "export" / "preprocess.json").read_text())
    assert doc["argument_order"] == ["num", "cat"] and doc["inputs"]["num"]["columns"] == config.data.numeric

    source = _test_split(config, tmp_path / "test.parquet")
    expected = pq.read_table(predict_files([source], scoring, tmp_path / "scores.parquet").output)
    table = pq.read_table(source)
    # What a serving stack sends: raw numerics (nulls as NaN) and the documented category hashes.
    num = np.stack([table.column(c).to_numpy(zero_copy_only=False).astype(np.float32) for c in config.data.numeric], 1)
    cat = np.stack([category_hash(table.column(c).combine_chunks()) for c in config.data.categorical], 1)
    np.save(tmp_path / "num.npy", num), np.save(tmp_path / "cat.npy", cat)
    isolated = subprocess.run([sys.executable, "-I", "-c", CHILD, str(package / "export" / "model.pt2"),
                               str(tmp_path / "num.npy"), str(tmp_path / "cat.npy"), str(tmp_path / "out.npy")],
                              cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert isolated.returncode == 0, isolated.stderr[-2000:]
    got = np.load(tmp_path / "out.npy")
    np.testing.assert_array_equal(got.reshape(-1), expected.column("probability").to_numpy())


def test_an_s3_prefix_scored_into_an_s3_key_and_a_rerun_is_a_no_op(trained, tmp_path: Path, s3_server: str,
                                                                   s3_bucket: str) -> None:
    import boto3

    from training.pipeline.predict_stage import predict_stage

    config, package, _ = trained
    config.storage.endpoint_url = s3_server
    s3 = boto3.client("s3", endpoint_url=s3_server)
    table = pq.read_table(config.data.source)
    for i, part in enumerate((table.slice(0, 3000), table.slice(3000, 2000))):
        pq.write_table(part, tmp_path / f"part-{i}.parquet")
        s3.upload_file(str(tmp_path / f"part-{i}.parquet"), s3_bucket, f"incoming/part-{i}.parquet")
    output = f"s3://{s3_bucket}/scores/latest.parquet"
    first = predict_stage(config, f"s3://{s3_bucket}/incoming", output, str(package), ["clicked"])
    assert not first.skipped and first.rows == 5000 and first.output == output
    s3.download_file(s3_bucket, "scores/latest.parquet", str(tmp_path / "got.parquet"))
    got = pq.read_table(tmp_path / "got.parquet")
    assert got.num_rows == 5000 and got.column_names == ["clicked", "probability", "prediction"]
    again = predict_stage(config, f"s3://{s3_bucket}/incoming", output, str(package), ["clicked"])
    assert again.skipped and again.rows == 5000


def test_a_csv_input_is_scored_as_its_parquet_is(trained, tmp_path: Path) -> None:
    import pyarrow.csv as pcsv

    from training.pipeline.predict_stage import predict_stage

    config, package, _ = trained
    parquet = _test_split(config, tmp_path / "rows.parquet")
    table = pq.read_table(parquet)
    table = table.drop_columns([c for c in table.column_names if c == "embedding"])  # CSV holds scalars
    pq.write_table(table, parquet)
    folder = tmp_path / "csv"
    folder.mkdir()
    pcsv.write_csv(table, folder / "rows.csv")
    from_parquet = predict_stage(config, str(parquet), str(tmp_path / "a.parquet"), model=str(package))
    from_csv = predict_stage(config, str(folder), str(tmp_path / "b.parquet"), model=str(package))
    assert from_csv.rows == from_parquet.rows == table.num_rows
    a, b = pq.read_table(tmp_path / "a.parquet"), pq.read_table(tmp_path / "b.parquet")
    assert np.allclose(a.column("probability").to_numpy(), b.column("probability").to_numpy(), atol=1e-6)
    again = predict_stage(config, str(folder), str(tmp_path / "b.parquet"), model=str(package))
    assert again.skipped  # the same CSV: nothing written twice


def test_an_output_named_csv_is_csv_with_the_parquet_outputs_scores(trained, tmp_path: Path) -> None:
    import pyarrow.csv as pa_csv

    config, package, _ = trained
    source = _test_split(config, tmp_path / "in.parquet")
    scoring = load_scoring_model(package, None)
    parquet = pq.read_table(predict_files([source], scoring, tmp_path / "scores.parquet", keys=["clicked"]).output)
    for name, delimiter in (("scores.csv", ","), ("scores.tsv", "\t")):
        out = tmp_path / name
        result = predict_files([source], scoring, out, keys=["clicked"])
        assert out.read_text().splitlines()[0].replace('"', "") == delimiter.join(["clicked", "probability", "prediction"])
        text = pa_csv.read_csv(out, parse_options=pa_csv.ParseOptions(delimiter=delimiter))
        assert result.rows == text.num_rows == parquet.num_rows
        assert np.allclose(text.column("probability").to_numpy(), parquet.column("probability").to_numpy(), atol=1e-6)
        assert text.column("prediction").to_pylist() == parquet.column("prediction").to_pylist()


def test_csv_scores_spread_a_multiclass_score_over_one_column_per_class(tmp_path: Path) -> None:
    from training.model.batch_scoring import _CsvWriter

    probs = pa.FixedSizeListArray.from_arrays(pa.array([0.1, 0.9, 0.7, 0.3], pa.float32()), 2)
    keys = pa.array(["a", "b"]).dictionary_encode()
    table = pa.table({"user": keys, "prediction": pa.array(["yes", "no"]), "probabilities": probs})
    writer = _CsvWriter(tmp_path / "s.csv", table.schema, ",", ["no", "yes"])
    writer.write_table(table)
    writer.write_table(table.slice(1))
    writer.close()
    assert (tmp_path / "s.csv").read_text().replace('"', "").splitlines() == [
        "user,prediction,probability_no,probability_yes", "a,yes,0.1,0.9", "b,no,0.7,0.3", "b,no,0.7,0.3"]
