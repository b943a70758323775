"""Writes the base job templates of the GPU work pools: each is its worker type's default
template plus the variables the GPU deployments set. Run it after upgrading prefect-aws or
prefect-kubernetes (tests/test_job_templates.py fails while a file is stale):

    python deployments/templates/make_templates.py

Then create the pools from them:

    prefect work-pool create gpu-spot --type ecs --base-job-template deployments/templates/ecs-gpu.json
    prefect work-pool create gpu-k8s --type kubernetes --base-job-template deployments/templates/kubernetes-gpu.json
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def ecs_gpu() -> dict[str, Any]:
    """ECS: GPUs per task (resourceRequirements) and the grace between SIGTERM and SIGKILL."""
    from prefect_aws.workers.ecs_worker import ECSWorker

    template = copy.deepcopy(ECSWorker.get_default_base_job_template())
    variables = template["variables"]["properties"]
    # A string: ECS's resourceRequirements take the count as one ("1").
    variables["gpu_count"] = {
        "title": "GPUs", "type": "string", "default": "1", "pattern": "^[0-9]+$",
        "description": "GPUs reserved for the task's container (an EC2 capacity provider with GPU instances)."}
    variables["stop_timeout"] = {
        "title": "Stop timeout", "type": "integer", "default": 120, "minimum": 2, "maximum": 120,
        "description": "Seconds between the SIGTERM that stops the container (a spot reclaim) and the SIGKILL: "
                       "time for the emergency checkpoint to reach S3."}
    container = template["job_configuration"]["task_definition"]["containerDefinitions"][0]
    container["resourceRequirements"] = [{"type": "GPU", "value": "{{ gpu_count }}"}]
    container["stopTimeout"] = "{{ stop_timeout }}"
    return template


def kubernetes_gpu() -> dict[str, Any]:
    """Kubernetes: GPU limits, the node selector and tolerations of a spot GPU node pool, labels
    on the pod (a multi-node run's rendezvous Service selects the flow-run pod by them), and a
    memory-backed /dev/shm. The namespace is the default template's `namespace` variable."""
    from prefect_kubernetes.worker import KubernetesWorker

    template = copy.deepcopy(KubernetesWorker.get_default_base_job_template())
    variables = template["variables"]["properties"]
    variables["gpu_limit"] = {"title": "GPUs", "type": "integer", "default": 1, "minimum": 0,
                              "description": "nvidia.com/gpu limit of the flow-run container."}
    variables["node_selector"] = {"title": "Node selector", "type": "object", "default": {},
                                  "additionalProperties": {"type": "string"},
                                  "description": "Labels a node must carry, e.g. the cloud's spot label."}
    variables["tolerations"] = {"title": "Tolerations", "type": "array", "default": [], "items": {"type": "object"},
                                "description": "Tolerations of the pod, e.g. for a tainted spot node pool."}
    variables["pod_labels"] = {"title": "Pod labels", "type": "object", "default": {},
                               "additionalProperties": {"type": "string"},
                               "description": "Labels on the flow-run pod (not only on its Job)."}
    variables["termination_grace_seconds"] = {
        "title": "Termination grace", "type": "integer", "default": 120, "minimum": 2,
        "description": "Seconds between the SIGTERM of a node drain or spot reclaim and the SIGKILL: time for "
                       "the emergency checkpoint to reach S3."}
    variables["shm_size"] = {
        "title": "Shared memory", "type": "string", "default": "16Gi", "pattern": "^[0-9]+(Ki|Mi|Gi)$",
        "description": "Size of the memory-backed /dev/shm: NCCL and DataLoader workers pass tensors through it, "
                       "and a container's default of 64 MB fails them."}
    spec = template["job_configuration"]["job_manifest"]["spec"]["template"]
    spec["metadata"] = {"labels": "{{ pod_labels }}"}
    pod = spec["spec"]
    pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "{{ gpu_limit }}"
    pod["containers"][0]["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    pod["volumes"] = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "{{ shm_size }}"}}]
    pod["nodeSelector"] = "{{ node_selector }}"
    pod["tolerations"] = "{{ tolerations }}"
    pod["terminationGracePeriodSeconds"] = "{{ termination_grace_seconds }}"
    return template


TEMPLATES = {"ecs-gpu.json": ecs_gpu, "kubernetes-gpu.json": kubernetes_gpu}


def render(name: str) -> str:
    return json.dumps(TEMPLATES[name](), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    for file_name in TEMPLATES:
        (HERE / file_name).write_text(render(file_name))
        print(HERE / file_name)
