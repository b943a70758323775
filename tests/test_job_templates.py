"""Every deployment's job variables exist in its work pool's base job template, hold values that
template's schema accepts, and render into the job as intended; the shipped GPU templates are the
installed workers' defaults plus their additions (never stale)."""

from __future__ import annotations

import json
import runpy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from prefect.utilities.templating import apply_values

ROOT = Path(__file__).resolve().parents[1]
DEPLOYMENTS = ROOT / "deployments"
MAKE = runpy.run_path(str(DEPLOYMENTS / "templates" / "make_templates.py"))
IMAGE = "registry.example.com/ml/retrain-pipeline:0123456789ab"


def _default_template(pool_type: str) -> dict[str, Any]:
    if pool_type == "process":
        from prefect.workers.process import ProcessWorker

        return ProcessWorker.get_default_base_job_template()
    if pool_type == "docker":
        from prefect_docker.worker import DockerWorker

        return DockerWorker.get_default_base_job_template()
    raise AssertionError(pool_type)


# pool name -> the template its `prefect work-pool create` names (deployment files' comments)
POOLS: dict[str, Any] = {
    "retrain-process": lambda: _default_template("process"),
    "retrain-docker": lambda: _default_template("docker"),
    "gpu-spot": lambda: json.loads((DEPLOYMENTS / "templates" / "ecs-gpu.json").read_text()),
    "gpu-k8s": lambda: json.loads((DEPLOYMENTS / "templates" / "kubernetes-gpu.json").read_text()),
}


def _deployments() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted(DEPLOYMENTS.glob("*.yaml")):
        for dep in yaml.safe_load(path.read_text())["deployments"]:
            found.append((f"{path.name}:{dep['name']}", dep))
    return found


@pytest.mark.parametrize("name", sorted(MAKE["TEMPLATES"]))
def test_the_shipped_templates_are_the_workers_defaults_plus_their_additions(name: str) -> None:
    committed = (DEPLOYMENTS / "templates" / name).read_text()
    assert committed == MAKE["render"](name), f"{name} is stale: run python deployments/templates/make_templates.py"


@pytest.mark.parametrize(("where", "deployment"), _deployments(), ids=[w for w, _ in _deployments()])
def test_job_variables_are_variables_of_the_pools_template(where: str, deployment: dict[str, Any]) -> None:
    pool = deployment["work_pool"]
    template = POOLS[pool["name"]]()
    schema = template["variables"]
    given = {k: (IMAGE if v == "{{ build-image.image }}" else v) for k, v in pool.get("job_variables", {}).items()}
    unknown = sorted(set(given) - set(schema["properties"]))
    assert not unknown, f"{where}: job variables {unknown} are not in the {pool['name']} pool's template"
    jsonschema.validate(given, {**schema, "required": []})
    defaults = {k: v.get("default") for k, v in schema["properties"].items()}
    rendered = apply_values(template["job_configuration"], {**defaults, **given})
    if "image" in given:
        assert IMAGE in json.dumps(rendered), f"{where}: the built image is not what the job runs"


def test_the_gpu_variables_reach_the_task_and_the_pod() -> None:
    deployments = dict(_deployments())
    ecs = deployments["gpu-spot.yaml:retrain-gpu-spot"]["work_pool"]["job_variables"]
    template = POOLS["gpu-spot"]()
    defaults = {k: v.get("default") for k, v in template["variables"]["properties"].items()}
    task = apply_values(template["job_configuration"], {**defaults, **ecs, "image": IMAGE})["task_definition"]
    container = task["containerDefinitions"][0]
    assert container["resourceRequirements"] == [{"type": "GPU", "value": "1"}] and container["stopTimeout"] == 120

    template = POOLS["gpu-k8s"]()
    defaults = {k: v.get("default") for k, v in template["variables"]["properties"].items()}
    one_node = deployments["multi-gpu.yaml:retrain-8gpu"]["work_pool"]["job_variables"]
    spec = apply_values(template["job_configuration"], {**defaults, **one_node, "image": IMAGE})["job_manifest"]["spec"]
    spec = spec["template"]["spec"]
    assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert spec["nodeSelector"]["cloud.google.com/gke-spot"] == "true" and spec["tolerations"]
    assert spec["terminationGracePeriodSeconds"] == 120
    # Eight nodes: the flow-run pod only launches them (TorchX), so it holds no GPU, and its
    # service account may submit their Volcano job (`retrain manifests --only rbac`).
    launcher = deployments["multi-gpu.yaml:retrain-8x8gpu"]["work_pool"]["job_variables"]
    spec = apply_values(template["job_configuration"], {**defaults, **launcher, "image": IMAGE})["job_manifest"]["spec"]
    spec = spec["template"]["spec"]
    assert spec["serviceAccountName"] == "retrain-launcher"
    assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 0


def test_container_deployments_run_the_image_they_build() -> None:
    for path in ("docker.yaml", "gpu-spot.yaml", "multi-gpu.yaml"):
        spec = yaml.safe_load((DEPLOYMENTS / path).read_text())
        steps = [next(iter(step)) for step in spec["build"]]
        assert steps[-1] == "prefect_docker.deployments.steps.build_docker_image", path
        assert [next(iter(step)) for step in spec["push"]] == ["prefect_docker.deployments.steps.push_docker_image"]
        assert spec["pull"] == [{"prefect.deployments.steps.set_working_directory": {"directory": "/opt/retrain"}}]
        for dep in spec["deployments"]:
            assert dep["work_pool"]["job_variables"]["image"] == "{{ build-image.image }}", (path, dep["name"])
            assert "spot" in dep["tags"], (path, dep["name"])  # the shipped automations reschedule them
