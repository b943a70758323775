"""The Kubernetes objects of a multi-node deployment (`retrain manifests`), generated from its config.

- The Volcano Job the train task submits through TorchX for each run: one pod per node, all of
  them admitted together (gang scheduling), the run key in their arguments. The run key is
  known only when the run starts, so the preview holds `PREVIEW_KEY` in its place.
- What the flow-run pod needs to submit it, once per namespace: a service account, and a Role
  and RoleBinding to create, watch and delete Volcano jobs and read their pods' logs.

Applied by the operator once (the RBAC), reviewed before the first run (the job).
"""

from __future__ import annotations

from typing import Any

from training.config import RetrainConfig
from training.launch.group import FROZEN_JOB, _torchx, node_app, scheduler_cfg
from training.protocol.job import TrainJob

__all__ = ["LAUNCHER", "PREVIEW_KEY", "PREVIEW_SHA256", "launcher_rbac", "volcano_job"]

PREVIEW_KEY = "0123456789abcdef"  # stands in for the run key, which a run gets when it starts
PREVIEW_SHA256 = "0" * 64  # ... and for the frozen job's sha256, known once the run has published it
LAUNCHER = "retrain-launcher"  # the flow-run pod's service account, Role and RoleBinding


def volcano_job(config: RetrainConfig, run_key: str = PREVIEW_KEY) -> dict[str, Any]:
    """The Volcano Job a run of `config` submits (TorchX's Kubernetes scheduler, dry run: no
    cluster is asked)."""
    _torchx()
    from kubernetes.client import ApiClient
    from torchx.runner import get_runner

    rel = f"runs/{run_key}"
    job = TrainJob(run_key=run_key, run_dir=rel, dataset_dir="", stats_path="", config=config, run_rel=rel)
    with get_runner() as runner:
        info = runner.dryrun(node_app(job, f"{rel}/{FROZEN_JOB}", config.train.distributed.rdzv_port, PREVIEW_SHA256), "kubernetes",
                             cfg={**scheduler_cfg(job), "validate_spec": False})
    resource: dict[str, Any] = ApiClient().sanitize_for_serialization(info.request.resource)
    return resource


def launcher_rbac(namespace: str, service_account: str = LAUNCHER) -> list[dict[str, Any]]:
    """The service account of the flow-run pod, and what it may do in the nodes' namespace."""
    meta = {"name": LAUNCHER, "namespace": namespace}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": service_account, "namespace": namespace}},
        # What TorchX's Kubernetes scheduler calls (tests/test_k8s_manifests.py reads its source):
        # it submits, reads, lists and deletes Volcano jobs, reads their status (describe) and
        # replaces it (cancel marks a job Aborted), reads pods and streams their logs.
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta, "rules": [
            {"apiGroups": ["batch.volcano.sh"], "resources": ["jobs"],
             "verbs": ["create", "get", "list", "watch", "delete"]},
            {"apiGroups": ["batch.volcano.sh"], "resources": ["jobs/status"], "verbs": ["get", "update", "patch"]},
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
        ]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": LAUNCHER},
         "subjects": [{"kind": "ServiceAccount", "name": service_account, "namespace": namespace}]},
    ]
