"""Deployments against a real Prefect server: deploy, schedule, trigger, run on a worker."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tests.conftest import small_overrides
from tests.e2e.conftest import POOL, ROOT, PrefectServer, deployment, flow_run, flow_runs_of, wait_for
from training.config import RetrainConfig, load_config

pytestmark = pytest.mark.slow


def test_schedule_concurrency_and_parameter_schema(deployed: PrefectServer) -> None:
    retrain = deployment(deployed, "retrain")
    (schedule,) = retrain["schedules"]
    assert schedule["schedule"]["cron"] == "0 3 * * 6"
    assert schedule["schedule"]["timezone"] == "Europe/Berlin"
    assert schedule["active"] is True
    assert retrain["global_concurrency_limit"]["limit"] == 1
    assert retrain["work_pool_name"] == POOL
    # Long runs and light ones on queues of their own (retrain server gives them priorities and limits).
    assert retrain["work_queue_name"] == "training"
    assert deployment(deployed, "predict", flow="predict")["work_queue_name"] == "light"
    assert deployment(deployed, "watch", flow="watch")["work_queue_name"] == "light"
    # The flow's one parameter is the typed config model: the UI form is built from this schema.
    schema = retrain["parameter_openapi_schema"]
    assert schema["properties"]["config"]["$ref"] == "#/definitions/RetrainConfig"
    assert "Optimizer steps at most." in json.dumps(schema["definitions"]["TrainConfig"])
    # Lists with defaults show them in the UI's form (a default_factory has none in the schema).
    assert schema["definitions"]["ModelConfig"]["properties"]["hidden"]["default"] == [128, 64]
    assert schema["definitions"]["DataConfig"]["properties"]["numeric"]["default"][0] == "price"

    incremental = deployment(deployed, "retrain-incremental")
    assert incremental["schedules"][0]["active"] is False
    assert incremental["schedules"][0]["schedule"]["timezone"] == "Europe/Berlin"  # shared via an anchor
    assert incremental["parameters"]["config"]["train"]["init_from"] == "champion"
    assert incremental["global_concurrency_limit"]["limit"] == 1

    # Data arrival: a look that is due while the last one still runs is dropped, never queued.
    watch = deployment(deployed, "watch", flow="watch")
    assert watch["global_concurrency_limit"]["limit"] == 1
    assert watch["concurrency_options"]["collision_strategy"] == "CANCEL_NEW"

    # The tuning deployment: no schedule, its config (search space and budget) valid as deployed.
    tune = deployment(deployed, "tune", flow="tune")
    assert tune["schedules"] == [] and tune["entrypoint"] == "flows/tune.py:tune"
    tuned = RetrainConfig.model_validate(tune["parameters"]["config"])
    assert tuned.tune.space and tuned.tune.max_usd == 5.0

    # Scoring after retraining: a deployment trigger, i.e. an automation on the server that runs
    # `predict` when a run of the `retrain` deployment completes.
    predict = deployment(deployed, "predict", flow="predict")
    assert predict["entrypoint"] == "flows/predict.py:predict" and predict["schedules"] == []
    assert set(predict["parameter_openapi_schema"]["required"]) == {"input", "output"}
    automations = deployed.api().post("/automations/filter", json={}).json()
    (linked,) = [a for a in automations
                 if any(action.get("deployment_id") == predict["id"] for action in a["actions"])]
    trigger = linked["trigger"]
    assert trigger["expect"] == ["retrain.run.completed"]  # the pipeline's own event: see test_deployed_runs
    assert trigger["match_related"] == {"prefect.resource.role": "deployment",
                                        "prefect.resource.name": ["retrain", "retrain-incremental"]}


@pytest.mark.parametrize("missing", ["RETRAIN_GIT_REPOSITORY", "RETRAIN_GIT_BRANCH"])
def test_a_deploy_without_the_repository_or_branch_fails_naming_the_variable(deployer, tmp_path: Path,
                                                                             missing: str) -> None:
    import subprocess
    import sys

    checkout = tmp_path / "checkout"
    subprocess.run(["git", "clone", "-q", deployer.repository.as_uri(), str(checkout)], check=True)
    env = {k: v for k, v in {**deployer.server.env, **deployer.env}.items() if k != missing}
    out = subprocess.run([sys.executable, "-m", "prefect", "deploy", "--all", "--no-prompt", "--prefect-file",
                          "deployments/prefect.yaml"], env=env, cwd=checkout, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode != 0
    said = out.stdout + out.stderr
    assert f"{missing} is not set" in said, said[-3000:]
    assert "Traceback" not in said and "An exception occurred" not in said, said[-3000:]  # one line, no traceback


def test_deployments_clone_the_code_and_reschedule_on_sigterm(deployed: PrefectServer) -> None:
    for name in ("retrain", "retrain-incremental"):
        dep = deployment(deployed, name)
        (step,) = dep["pull_steps"]
        clone = step["prefect.deployments.steps.git_clone"]
        assert clone["repository"].startswith("file://") and clone["branch"] == "main"  # resolved at deploy time
        assert dep["job_variables"]["env"]["PREFECT_FLOW_RUN_EXECUTE_SIGTERM_BEHAVIOR"] == "reschedule"
        assert dep["job_variables"]["command"] == "prefect flow-run execute"  # the supervisor that reschedules
        # Heartbeats: a run whose process dies unseen is marked crashed, then rescheduled (automations).
        assert dep["job_variables"]["env"]["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == "30"
        assert "{{" not in json.dumps(dep["pull_steps"])


def test_gpu_spot_example_reschedules_on_sigterm() -> None:
    spec = yaml.safe_load((ROOT / "deployments" / "gpu-spot.yaml").read_text())
    (dep,) = spec["deployments"]
    assert dep["work_pool"]["job_variables"]["env"]["PREFECT_FLOW_RUN_EXECUTE_SIGTERM_BEHAVIOR"] == "reschedule"
    assert dep["concurrency_limit"] == 1


def test_multi_gpu_examples_are_valid_configs() -> None:
    from training.config import RetrainConfig

    spec = yaml.safe_load((ROOT / "deployments" / "multi-gpu.yaml").read_text())
    deployments = {d["name"]: d for d in spec["deployments"]}
    single = RetrainConfig.model_validate(deployments["retrain-8gpu"]["parameters"]["config"])
    assert single.train.world_size == 8 and single.storage.is_s3
    multi = RetrainConfig.model_validate(deployments["retrain-8x8gpu"]["parameters"]["config"])
    assert multi.train.world_size == 64 and multi.train.distributed.scheduler == "kubernetes"
    spot = yaml.safe_load((ROOT / "deployments" / "gpu-spot.yaml").read_text())["deployments"][0]
    assert RetrainConfig.model_validate(spot["parameters"]["config"]).storage.is_s3


def _trigger(server: PrefectServer, params: dict) -> str:
    out = server.cli("deployment", "run", "retrain/retrain", "--params", json.dumps(params))
    match = re.search(r"UUID:\s*([0-9a-f-]{36})", out.stdout)
    assert match, out.stdout
    return match.group(1)


def test_triggered_run_completes_on_a_worker(deployed: PrefectServer, tmp_path: Path, demo_source: Path) -> None:
    config = load_config(overrides=small_overrides(tmp_path / "root", demo_source) + ["train.max_steps=30"])
    flow_run_id = _trigger(deployed, {"config": config.model_dump(mode="json")})
    elsewhere = tmp_path / "worker"  # not the repo: the flow's code comes from the pull step
    elsewhere.mkdir()
    deployed.cli("worker", "start", "--pool", POOL, "--run-once", timeout=420, cwd=elsewhere)
    run = flow_run(deployed, flow_run_id)
    assert run["state"]["type"] == "COMPLETED", run["state"]
    (report,) = (tmp_path / "root" / "runs").glob("*/report.json")
    assert json.loads(report.read_text())["steps"] == 30  # the parameter override took effect
    # Its completion fired the `predict` deployment's trigger: the scoring run is on its way.
    predict_id = deployment(deployed, "predict", flow="predict")["id"]
    (scoring,) = wait_for(lambda: flow_runs_of(deployed, predict_id), 300, "the predict run the trigger creates")
    deployed.api().delete(f"/flow_runs/{scoring['id']}")  # not run here: its input is the deployment's placeholder


def test_bad_parameter_is_rejected_before_any_work(deployed: PrefectServer, tmp_path: Path) -> None:
    params = {"config": {"train": {"batch_size": 0}, "storage": {"root": str(tmp_path / "root")}}}
    with pytest.raises(AssertionError, match="batch_size"):
        _trigger(deployed, params)  # the server validates against the schema: no run is created
    assert not (tmp_path / "root").exists()
