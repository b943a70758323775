"""The flows as the Prefect UI and the API see them, without a server: each flow takes the
typed config (rendered as a form, every section and key with its description), and the
deployments' parameters in `deployments/prefect.yaml` validate against it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from training.config import RetrainConfig

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", ["retrain", "tune", "watch", "plan"])
def test_each_flow_takes_the_typed_config_as_a_form(name: str) -> None:
    import importlib

    flow = getattr(importlib.import_module(f"flows.{name}"), name)
    schema = flow.parameters.model_dump()
    assert "config" in schema["properties"]
    sections = schema["definitions"]["RetrainConfig"]["properties"]
    assert {"data", "train", "eval", "cost", "storage"} <= set(sections)
    described = schema["definitions"]["EvalConfig"]["properties"]["promote_on"]
    assert described["description"] and described["default"] == "interval"


def test_the_shipped_deployments_parameters_are_valid_configs() -> None:
    shipped = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())
    configs = [d["parameters"]["config"] for d in shipped["deployments"]
               if isinstance(d.get("parameters", {}).get("config"), dict)]
    assert configs
    for config in configs:
        RetrainConfig.model_validate(config)


@pytest.mark.parametrize("name", ["retrain", "tune", "watch", "plan", "predict"])
def test_every_parameter_and_config_section_is_described_in_the_form(name: str) -> None:
    import importlib

    flow = getattr(importlib.import_module(f"flows.{name}"), name)
    schema = flow.parameters.model_dump()
    assert [p for p, spec in schema["properties"].items() if not spec.get("description")] == []
    sections = {**schema["definitions"]["RetrainConfig"]["properties"],
                **{k: v for k, v in schema["definitions"]["TrainConfig"]["properties"].items() if "$ref" in v}}
    assert [s for s, spec in sections.items() if not spec.get("description")] == []
