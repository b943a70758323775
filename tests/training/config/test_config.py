from __future__ import annotations

from pathlib import Path

import pytest

from training.config import RetrainConfig, apply_overrides, load_config
from training.errors import ConfigError


def test_defaults_are_the_demo() -> None:
    config = load_config()
    assert config.data.source is None
    assert config.storage.root == ".retrain"
    assert config.train.precision == "auto"


def test_set_parses_yaml_scalars_and_lists() -> None:
    config = load_config(overrides=["train.batch_size=256", "model.hidden=[64, 32]", "train.optim.lr=1e-3",
                                    "eval.target_auc=0.8", "data.source=/x.parquet"])
    assert config.train.batch_size == 256
    assert config.model.hidden == [64, 32]
    assert config.train.optim.lr == pytest.approx(1e-3)
    assert config.eval.target_auc == 0.8


def test_unknown_key_is_named() -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'train\.batchsize'"):
        load_config(overrides=["train.batchsize=3"])


@pytest.mark.parametrize("value", ["0", "-5"])
def test_non_positive_batch_size_is_rejected(value: str) -> None:
    with pytest.raises(ConfigError, match=r"train\.batch_size: Input should be greater than 0"):
        load_config(overrides=[f"train.batch_size={value}"])


def test_every_problem_is_listed_in_one_error(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("train:\n  batch_size: 0\n  optim: {lr: -1}\n  bogus: 1\n  checkpoint_every: 20\ndata:\n  label: y\n")
    with pytest.raises(ConfigError) as info:
        load_config(cfg)
    message = str(info.value)
    assert str(cfg) in message
    assert "train.batch_size" in message and "train.optim.lr" in message and "train.bogus" in message
    # A key of the flat train section of earlier versions names its new place.
    assert "'train.checkpoint_every' has moved to 'train.checkpoint.every'" in message
    assert "\n" not in message


def test_missing_config_file_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml is not valid YAML at line"):
        load_config(bad)


def test_malformed_override() -> None:
    with pytest.raises(ConfigError, match="expected dotted.key=value"):
        apply_overrides({}, ["train.batch_size"])


def test_columns_listed_twice_are_rejected() -> None:
    with pytest.raises(ConfigError, match="listed twice"):
        load_config(overrides=["data.numeric=[a, b]", "data.categorical=[b]"])


def test_config_round_trips_through_json() -> None:
    config = load_config(overrides=["train.max_steps=7"])
    assert RetrainConfig.model_validate_json(config.model_dump_json()) == config


@pytest.mark.parametrize("root", ["s3://bucket/../../..", "s3://bucket/team/../x", "s3://../x", "s3://b/./x"])
def test_an_s3_root_may_not_climb_out_of_its_working_copy(root: str) -> None:
    with pytest.raises(ConfigError, match=r"'\.' and '\.\.' are not allowed"):
        load_config(overrides=[f"storage.root={root}"])


def test_every_config_field_is_marked_computed_or_operational() -> None:
    """A field added without a mark fails here (and in `fingerprinted` at run time), so it can
    never silently join or leave a run key."""
    import inspect

    from pydantic import Field

    import training.config as config_module
    from training.config import _Section, fingerprinted, is_computed

    sections = [c for _, c in inspect.getmembers(config_module, inspect.isclass)
                if issubclass(c, _Section) and c is not _Section]
    assert len(sections) >= 10
    for section in sections:
        for name in section.model_fields:
            is_computed(section, name)  # raises TypeError on an unmarked field

    class Unmarked(_Section):
        marked: int = Field(1, json_schema_extra=config_module.COMPUTED)
        forgotten: int = Field(2)

    with pytest.raises(TypeError, match="Unmarked.forgotten is not marked"):
        fingerprinted(Unmarked())


def test_fingerprint_membership_follows_the_marks() -> None:
    from training.protocol.job import train_fingerprint

    base = RetrainConfig()
    fp = train_fingerprint(base, "cpu", "fp32")
    # Operational: memory and speed only.
    assert train_fingerprint(base.model_copy(update={"model": base.model.model_copy(
        update={"gradient_checkpointing": True})}), "cpu", "fp32") == fp
    operational = load_config(overrides=["train.loader.num_workers=2", "train.compile=true",
                                         "train.checkpoint.keep_last=5", "train.distributed.bucket_mb=50"])
    assert train_fingerprint(operational, "cpu", "fp32") == fp
    # Computed: the numerics actually used, whatever was requested.
    assert train_fingerprint(base, "cuda", "bf16") != fp
    assert train_fingerprint(base, "cpu", "bf16") != fp
    assert train_fingerprint(base.model_copy(update={"train": base.train.model_copy(update={"optim": base.train.optim.model_copy(update={"lr": 1e-2})})}),
                             "cpu", "fp32") != fp
