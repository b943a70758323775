"""The container tests: a real Docker engine, a real Prefect server with a docker work pool and
its worker, and moto's S3 server on 127.0.0.1 as the storage root. They run as a stage of their
own (`python -m pytest -m container`): building the image takes minutes on a fresh machine."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.containers.spot import BASE_IMAGE, IMAGE_NAME, build_extras, docker, docker_ready, docker_spec, ensure_base_image
from tests.e2e.conftest import Deployer, PrefectServer, deployer, postgres, prefect_server, start_worker  # noqa: F401

pytestmark = pytest.mark.container


@pytest.fixture(scope="session")
def docker_engine() -> None:
    why = docker_ready()
    if why is not None:
        pytest.fail(f"the container tests need a running Docker engine ({why}); .ci/run starts one")


@pytest.fixture(scope="session")
def docker_pool(docker_engine: None, prefect_server: PrefectServer) -> str:  # noqa: F811
    name = f"docker-{uuid.uuid4().hex[:8]}"
    prefect_server.cli("work-pool", "create", name, "--type", "docker")
    return name


class Deployed:
    """The shipped docker deployment, built and deployed as CI would (less the push)."""

    def __init__(self, deployer: Deployer, pool: str) -> None:  # noqa: F811
        self.deployer, self.pool = deployer, pool
        self.base = ensure_base_image(BASE_IMAGE)
        self.extras = build_extras()
        # With the CPU wheel at hand, no PyTorch index is needed (none is reachable here).
        self.torch_index = "" if any(rel.endswith(".whl") for rel in self.extras) else "https://download.pytorch.org/whl/cpu"
        self.image: str | None = None

    def deploy(self, name: str, config: dict[str, Any]) -> str:
        spec = docker_spec(self.pool, name, config, self.base, self.torch_index)
        self.deployer.deploy(spec, name, files=self.extras, env={"RETRAIN_IMAGE": IMAGE_NAME}, timeout=1800)
        tags = docker("images", IMAGE_NAME, "--format", "{{.Tag}}").split()
        self.image = f"{IMAGE_NAME}:{tags[0]}"
        return name


@pytest.fixture(scope="session")
def deployed_image(deployer: Deployer, docker_pool: str) -> Deployed:  # noqa: F811
    return Deployed(deployer, docker_pool)


def image_bytes(image: str) -> int:
    return int(docker("image", "inspect", image, "--format", "{{.Size}}"))


__all__ = ["Deployed", "image_bytes", "Path"]
