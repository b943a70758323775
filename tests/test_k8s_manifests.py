"""`retrain manifests`: the Kubernetes objects of the multi-node deployment, generated from the
deployment's own parameters and valid against the Kubernetes API's schemas (kubernetes-validate
bundles them: no cluster is asked)."""

from __future__ import annotations

import contextlib
import copy
import io
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from retrain_cli.main import main

DEPLOYMENT = f"{Path(__file__).resolve().parents[1] / 'deployments' / 'multi-gpu.yaml'}:retrain-8x8gpu"
K8S_VERSION = kubernetes_validate.latest_version()


def _manifests(*args: str) -> list[dict[str, Any]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["manifests", "--deployment", DEPLOYMENT, *args]) == 0
    return list(yaml.safe_load_all(out.getvalue()))


def _pods(job: dict[str, Any]) -> list[dict[str, Any]]:
    """Each Volcano task's pod template, as the Pod the Volcano controller makes of it."""
    return [{"apiVersion": "v1", "kind": "Pod", **task["template"]} for task in job["spec"]["tasks"]]


def test_the_launchers_rbac_and_the_nodes_pods_are_valid_kubernetes_objects() -> None:
    objects = _manifests()
    kinds = [o["kind"] for o in objects]
    assert kinds == ["ServiceAccount", "Role", "RoleBinding", "Job"]
    for obj in [*objects[:3], *_pods(objects[3])]:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_the_nodes_job_is_one_gang_of_eight_gpu_pods_from_the_deployment() -> None:
    (job,) = _manifests("--only", "job")
    assert job["apiVersion"] == "batch.volcano.sh/v1alpha1" and job["spec"]["schedulerName"] == "volcano"
    tasks = job["spec"]["tasks"]
    # No task's minAvailable: Volcano's default is every pod, all admitted together or none.
    assert len(tasks) == 8 and all("minAvailable" not in t for t in tasks) and "minAvailable" not in job["spec"]
    assert job["spec"]["maxRetry"] == 0  # a lost node ends the attempt; the train task's retry submits a new job
    for k, pod in enumerate(_pods(job)):
        spec = pod["spec"]
        (container,) = spec["containers"]
        assert container["image"] == "{{ build-image.image }}"  # the deployment's built image
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
        assert spec["serviceAccountName"] == "retrain-node"
        assert spec["nodeSelector"]["cloud.google.com/gke-spot"] == "true" and spec["tolerations"]
        command = container["command"]
        assert command[:3] == ["python", "-m", "training.worker.node"]
        assert command[command.index("--node") + 1] == str(k)
        # Node 0 hosts the rendezvous; the others find it by the name Volcano's svc plugin gives it.
        assert command[command.index("--rank0-env") + 1] == ("TORCHX_RANK0_HOST" if k == 0 else "VC_NODE_0_HOSTS")
        assert {"name": "c10d", "containerPort": 29500} in container["ports"]


def test_the_schema_check_can_fail() -> None:
    (job,) = _manifests("--only", "job")
    pod = copy.deepcopy(_pods(job)[0])
    pod["spec"]["containers"][0]["ports"][0]["containerPort"] = "c10d"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


@pytest.mark.parametrize(("deployment", "says"), [
    ("deployments/multi-gpu.yaml", "give FILE.yaml:NAME"),
    ("deployments/nothing.yaml:x", "deployment file deployments/nothing.yaml does not exist"),
    ("deployments:x", "deployment file deployments cannot be read"),
    ("deployments/multi-gpu.yaml:retrain-8gpu", "retrain manifests is for multi-node runs on Kubernetes"),
])
def test_a_wrong_deployment_is_one_line(deployment: str, says: str, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    assert main(["manifests", "--deployment", deployment]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("retrain: error: ") and says in err and "\n" not in err


# The Kubernetes client's methods TorchX's scheduler may call, as (resource, verb) a Role grants.
_CALLS = {
    "create_namespaced_custom_object": ("jobs", "create"), "get_namespaced_custom_object": ("jobs", "get"),
    "list_namespaced_custom_object": ("jobs", "list"), "delete_namespaced_custom_object": ("jobs", "delete"),
    "patch_namespaced_custom_object": ("jobs", "patch"), "replace_namespaced_custom_object": ("jobs", "update"),
    "get_namespaced_custom_object_status": ("jobs/status", "get"),
    "replace_namespaced_custom_object_status": ("jobs/status", "update"),
    "patch_namespaced_custom_object_status": ("jobs/status", "patch"),
    "read_namespaced_pod": ("pods", "get"), "list_namespaced_pod": ("pods", "list"),
    "read_namespaced_pod_log": ("pods/log", "get"),
}


def test_the_launchers_role_grants_every_call_torchxs_kubernetes_scheduler_makes() -> None:
    """Read from TorchX's own source: a call it makes that the Role does not grant would fail
    the launcher in a cluster (following the job, cancelling it) and nowhere here."""
    import re

    import torchx.schedulers.kubernetes_scheduler as scheduler

    called = set(re.findall(r"\.(\w+_namespaced_\w+)\(", Path(scheduler.__file__).read_text()))
    unknown = called - set(_CALLS)
    assert not unknown, f"TorchX calls {sorted(unknown)}: add them to _CALLS with the verb they need"
    (role,) = [o for o in _manifests() if o["kind"] == "Role"]
    granted = {(resource, verb) for rule in role["rules"] for resource in rule["resources"] for verb in rule["verbs"]}
    missing = sorted(_CALLS[c] for c in called if _CALLS[c] not in granted)
    assert missing == [], f"the Role lacks {missing}"
    assert ("jobs/status", "update") in granted  # cancel: a job marked Aborted
