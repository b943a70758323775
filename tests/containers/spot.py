"""What the container tests need around a real Docker engine: the base image, the build's extra
files, the docker deployment, and the containers and S3 objects of a flow run. Plain functions:
no pytest here."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import boto3
import yaml

ROOT = Path(__file__).resolve().parents[2]
BASE_IMAGE = "retrain-test-base:bookworm"
IMAGE_NAME = "retrain-test"
AWS_ENV = {"AWS_ACCESS_KEY_ID": "AKIATESTKEYNEVERPRINT", "AWS_SECRET_ACCESS_KEY": "test-secret-must-never-be-printed",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


def docker(*args: str, timeout: float = 600, check: bool = True) -> str:
    out = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args)} failed: {out.stderr[-2000:]}")
    return out.stdout.strip()


def docker_ready() -> str | None:
    """Why Docker cannot be used here, or None when it can."""
    if shutil.which("docker") is None:
        return "no docker command"
    out = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True)
    return None if out.returncode == 0 else f"no Docker engine: {out.stderr.strip()[:300]}"


def ensure_base_image(tag: str = BASE_IMAGE) -> str:
    """A Debian bookworm image with python3 and its venv module, built from Debian's packages
    (no container registry is reachable here): debootstrap, then `docker import`. Kept by the
    engine, so a machine builds it once."""
    if docker("images", "-q", tag):
        return tag
    with tempfile.TemporaryDirectory(prefix="retrain-rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        subprocess.run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv", "bookworm",
                        str(rootfs)], check=True, capture_output=True, timeout=900)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(["docker", "import", "-", tag], stdin=tar.stdout, check=True, capture_output=True, timeout=600)
        tar.wait()
    return tag


def _pip_setting(name: str) -> str | None:
    """A setting of this machine's pip configuration (`pip config list`), or None."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    for line in out.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(f".{name}"):
            return value.strip().strip("'\"")
    return None


def build_extras() -> dict[str, Path]:
    """What the image build takes from this machine, as its pip does: the CPU torch wheel from
    pip's find-links folder, and pip's CA bundle. Relative path in the build context -> file."""
    import torch

    extras: dict[str, Path] = {}
    version = torch.__version__
    for folder in filter(None, (_pip_setting("find-links") or "").split()):
        for wheel in Path(folder.removeprefix("file://")).glob(f"torch-{version}-*.whl"):
            extras[f"docker/build-extras/{wheel.name}"] = wheel
    cert = _pip_setting("cert") or os.environ.get("PIP_CERT")
    if cert and Path(cert).is_file():
        extras["docker/build-extras/ca-bundle.crt"] = Path(cert)
    return extras


def docker_spec(pool: str, name: str, config: dict[str, Any], base_image: str, torch_index: str) -> dict[str, Any]:
    """deployments/docker.yaml for this machine: the shipped build step with a local base image
    and the host's network (the registry is reachable only from it), no push (no registry is
    reachable), and the flow's containers on the host's network (the server and S3 endpoint
    listen on 127.0.0.1)."""
    spec = yaml.safe_load((ROOT / "deployments" / "docker.yaml").read_text())
    build = spec["build"][-1]["prefect_docker.deployments.steps.build_docker_image"]
    build["buildargs"] = {"BASE_IMAGE": base_image, "TORCH_INDEX_URL": torch_index}
    build["network_mode"] = "host"
    build["pull"] = False  # the base image is local: there is no registry to refresh it from
    spec.pop("push")
    (dep,) = spec["deployments"]
    variables = dep["work_pool"]["job_variables"]
    variables.update(network_mode="host", image_pull_policy="Never", auto_remove=False,
                     env={**variables["env"], **AWS_ENV, "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30"})
    dep.update(name=name, parameters={"config": config}, schedules=[])
    dep["work_pool"]["name"] = pool
    return spec


def containers_of(flow_run_id: str, every: bool = True) -> list[dict[str, Any]]:
    """The flow run's containers, oldest first: id, state and exit code."""
    ids = docker("ps", *(["-a"] if every else []), "-q", "--filter", f"label=io.prefect.flow-run-id={flow_run_id}")
    found = []
    for cid in ids.split():
        info = json.loads(docker("inspect", cid))[0]
        found.append({"id": cid, "created": info["Created"], "running": info["State"]["Running"],
                      "exit_code": info["State"]["ExitCode"]})
    return sorted(found, key=lambda c: c["created"])


class RunOnS3:
    """What a run on an s3:// root has published: checkpoints, heartbeat, report."""

    def __init__(self, endpoint: str, bucket: str, prefix: str) -> None:
        self.s3 = boto3.client("s3", endpoint_url=endpoint)
        self.bucket, self.prefix = bucket, prefix

    def keys(self, under: str) -> list[str]:
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=f"{self.prefix}/{under}")
        return [o["Key"] for page in pages for o in page.get("Contents", [])]

    def complete_checkpoints(self) -> list[int]:
        """Steps of the checkpoints whose manifest (uploaded last) is on S3."""
        steps = []
        for key in self.keys("runs/"):
            parts = key.split("/")
            if parts[-1] == "manifest.json" and parts[-3] == "checkpoints":
                steps.append(int(parts[-2].removeprefix("step-")))
        return sorted(steps)

    def json(self, key_suffix: str) -> dict[str, Any] | None:
        matches = [k for k in self.keys("runs/") if k.endswith(key_suffix)]
        if not matches:
            return None
        return json.loads(self.s3.get_object(Bucket=self.bucket, Key=matches[0])["Body"].read())

    def heartbeat_step(self) -> int | None:
        beat = self.json("/heartbeat.json")
        return None if beat is None else int(beat["step"])


def watch_heartbeat(run: RunOnS3, stop: Callable[[], bool], samples: list[tuple[float, int]]) -> None:
    """Record (time, step) of the run's heartbeat on S3 until `stop()` (a thread's body)."""
    while not stop():
        try:
            step = run.heartbeat_step()
        except Exception:  # noqa: BLE001 - a sample missed under load is only a sample
            step = None
        if step is not None and (not samples or samples[-1][1] != step):
            samples.append((time.time(), step))
        time.sleep(0.1)


def first_resumed_step_after(samples: list[tuple[float, int]], since: float, resumed_from: int) -> float | None:
    """Seconds from `since` (the reclaim) to the first heartbeat of the new attempt past the
    step it resumed from: the attempt first publishes that step, then the steps it trains."""
    after = [(t, s) for t, s in samples if t >= since]
    restart = next((i for i, (_, s) in enumerate(after) if s == resumed_from), None)
    if restart is None:
        return None
    return next((t - since for t, s in after[restart:] if s > resumed_from), None)
