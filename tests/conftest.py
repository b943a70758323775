"""Shared fixtures: small real datasets and configs, and a real S3 endpoint (moto's server) on
127.0.0.1. Nothing here talks to any other address."""

from __future__ import annotations

import contextlib
import os
import subprocess
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

import tempfile

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# Never touch the developer's ~/.prefect: one throwaway home per test session.
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="retrain-test-prefect-home-")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
# Credentials for the loopback S3 server only; never a developer's real ones, never the
# instance metadata service.
S3_SECRET = "test-secret-must-never-be-printed"
os.environ.update({
    "AWS_ACCESS_KEY_ID": "AKIATESTKEYNEVERPRINT",
    "AWS_SECRET_ACCESS_KEY": S3_SECRET,
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
})
for _var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
    os.environ.pop(_var, None)

from training.config import RetrainConfig, load_config  # noqa: E402
from training.data.ingest.demo import ensure_demo_dataset  # noqa: E402

from tests.fault_proxy import FaultProxy  # noqa: E402

SMALL_ROWS = 8000


# The unit tier (`-m unit`): tests that call the code in this process, on small data, and start
# no server, child process or container, so a developer runs it after every change. A test is
# in it unless its folder is a tier of servers and processes, it is marked so, it asks for a
# server's fixture, or its module is one of those below, which start processes or train at
# length; `unit_guard` checks the first promise as each unit test runs.
_NOT_UNIT_FOLDERS = ("e2e", "flows", "containers", "cuda")
_NOT_UNIT_MARKS = ("slow", "container", "cuda")
_SERVER_FIXTURES = {"s3_server", "s3_bucket", "fault_proxy", "prefect_server", "prefect_harness", "mlflow_url"}
_NOT_UNIT = (  # a module, or a module's test (a prefix of the test's id)
    "test_ddp.py",  # torchrun and gloo process groups
    "test_preemption.py",  # kills training processes
    "test_warm_children.py",  # warm training children
    "test_forks.py",  # training children forked from the zygote
    "test_stage_calls.py",  # evaluation in a child process
    "test_sealed_job.py",  # a training child refusing a swapped job
    "test_disk_full.py",  # a training process on a small filesystem
    "test_checkpoint.py::test_a_writer_killed_during_its_write",  # a writer process, SIGKILLed
    "test_root_lock.py",  # competing processes
    "test_s3_lease.py",  # competing processes on S3
    "test_source_index.py",  # competing writer processes
    "test_s3_storage.py",  # a real S3 endpoint, or none, at the other end
    "test_docs_generated.py",  # renders every page
    "test_no_work_history.py",  # reads the git history
    "test_layering.py",  # imports each layer in a fresh interpreter
    "test_types.py",  # mypy in a child process
    "test_gpu_check_rehearsal.py",  # the GPU check's every part, in child processes
    "test_unchanged.py",  # the CLI's and the flow's imports, in fresh interpreters
    "test_warm_start.py",  # the train stage's training process
    "test_transform.py",  # imports in a fresh interpreter
    "test_cli_help.py::test_version",  # the installed entry point
    "test_deploy_steps.py::test_the_image_is_tagged",  # git in a child process
    "test_predict.py::test_the_export_loads_without_the_project",  # a fresh interpreter
    "test_predict.py::test_a_full_disk_while_scoring",  # mounts a small filesystem
    "test_plan.py::test_the_memory_estimate_matches_a_measured_cpu_step",  # a measuring child
    "test_incremental.py::test_retrain_when_drift",  # the train stage's training process
    "test_threads.py::test_a_real_burner_is_counted",  # a CPU-burning process
    "test_numerics.py::test_with_a_gpu_driver_nvidia_smi",  # a stand-in nvidia-smi process
    "test_loader.py::test_workers_deliver_the_single_process_order",  # DataLoader worker processes
    "test_loop.py::test_workers_change_nothing_but_speed",  # DataLoader worker processes
    "test_throughput.py::test_the_worker_probe_measures_real_workers",  # DataLoader worker processes
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The `unit` tier (see above); the `cuda` tier runs where a CUDA GPU is visible and is
    skipped elsewhere."""
    tests = Path(__file__).parent
    unit = pytest.mark.unit
    for item in items:
        parts = Path(str(item.fspath)).relative_to(tests).parts
        test = f"{parts[-1]}::{item.name}"
        if (parts[0] not in _NOT_UNIT_FOLDERS and not test.startswith(_NOT_UNIT)
                and not any(item.get_closest_marker(m) for m in _NOT_UNIT_MARKS)
                and not _SERVER_FIXTURES & set(getattr(item, "fixturenames", ()))):
            item.add_marker(unit)
    _heavy_files_first(items)
    marked = [item for item in items if item.get_closest_marker("cuda")]
    if not marked:
        return
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in marked:
            item.add_marker(skip)


# On two workers (pytest-xdist, --dist loadfile) a file is a unit of work, handed to whichever
# worker is free next. The files that share the `deployed` server (a work pool and every shipped
# deployment, about 25 s to set up) make one unit, so that one worker sets it up.
_ONE_UNIT = ("tests/e2e/test_deployed_runs.py", "tests/e2e/test_deployment.py", "tests/e2e/test_ui.py")


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getoption("dist") != "loadfile":
        return None  # the scheduling asked for on the command line
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return _ONE_UNIT[0] if path in _ONE_UNIT else path

    config.option.loadscopereorder = False  # the order _heavy_files_first gives
    return Scheduling(config, log)


def _heavy_files_first(items: list[pytest.Item]) -> None:
    """The `deployed` unit, then the files that start servers and processes, then the unit
    tier's files, most tests first: the long files start early, and the last to start are
    short, so neither worker idles at the end while the other finishes a long file (xdist's own
    order, most tests first, starts the unit tier's files first). A file's tests keep their order."""
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)

    def rank(path: str) -> tuple[int, int]:
        tests = files[path]
        if path in _ONE_UNIT:
            return (0, 0)
        if any(item.get_closest_marker("unit") is None for item in tests):
            return (1, 0)
        return (2, -len(tests))

    items[:] = [item for path in sorted(files, key=rank) for item in files[path]]


class _NoProcessInUnitTests(RuntimeError):
    pass


@pytest.fixture(scope="session")
def _matplotlib_font_cache() -> None:
    """matplotlib builds its font cache on its first import on a machine, and runs `fc-list`
    to do it where fontconfig is installed (Chromium brings it). That process is the machine's
    one-off, not the test's: built before the guard, a unit test that plots starts none."""
    import matplotlib.font_manager  # noqa: F401


@pytest.fixture(autouse=True)
def unit_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A unit test that starts a process fails, naming the promise it broke."""
    if request.node.get_closest_marker("unit") is None:
        return
    request.getfixturevalue("_matplotlib_font_cache")

    def refuse(*args: object, **kwargs: object) -> None:
        raise _NoProcessInUnitTests(f"{request.node.nodeid} is in the unit tier, which starts no process: add it "
                                    "to _NOT_UNIT in tests/conftest.py, or mark it slow")

    import multiprocessing.process

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(os, "fork", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)  # DataLoader workers too


@pytest.fixture(scope="session")
def demo_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small demo-generator Parquet file shared by the session (read-only by convention), in
    row groups of 2,000 rows: with `small_overrides` it packs into two segments, so the suite's
    datasets are made of several, as a growing source's are."""
    import pyarrow.parquet as pq

    path, _ = ensure_demo_dataset(tmp_path_factory.mktemp("demo-gen"), rows=SMALL_ROWS, seed=7)
    grouped = tmp_path_factory.mktemp("demo-src") / path.name
    pq.write_table(pq.read_table(path), grouped, row_group_size=2000)
    return grouped


def small_overrides(root: Path, source: Path) -> list[str]:
    return [
        f"storage.root={root}",
        f"data.source={source}",
        "data.rows_per_member=256",
        "data.shard_size_mb=0.06",
        "data.segment_rows=4000",
        "train.batch_size=128",
        "train.max_steps=60",
        "train.eval_every=20",
        "train.checkpoint.every=20",
        "train.schedule.warmup_steps=5",
        "train.retry.delay_seconds=0",
        # Explicit: tests choose their workers and threads (the auto probes have their own
        # tests; auto's load measurement waits up to 0.25 s at each start).
        "train.loader.num_workers=0",
        "train.loader.torch_threads=1",
        "model.hidden=[32, 16]",
        "model.embedding_dim=4",
    ]


@pytest.fixture
def small_config(tmp_path: Path, demo_source: Path) -> RetrainConfig:
    return load_config(overrides=small_overrides(tmp_path / "root", demo_source))


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """moto's standalone S3 server: a real HTTP endpoint on 127.0.0.1 for the session."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    _, port = server.get_host_and_port()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def s3_bucket(s3_server: str, request: pytest.FixtureRequest) -> str:
    """A fresh, empty bucket for one test."""
    import re

    import boto3

    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-") + f"-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=name)
    return name


@pytest.fixture
def fault_proxy(s3_server: str) -> Iterator[FaultProxy]:
    proxy = FaultProxy(int(s3_server.rsplit(":", 1)[1]))
    yield proxy
    proxy.close()


def s3_overrides(bucket: str, endpoint: str, local_dir: Path, prefix: str = "team/retrain") -> list[str]:
    """Config overrides for an s3:// root on the loopback server, with short timeouts so that
    fault tests end quickly."""
    return [
        f"storage.root=s3://{bucket}/{prefix}",
        f"storage.endpoint_url={endpoint}",
        f"storage.local_dir={local_dir}",
        "storage.connect_timeout_s=2",
        "storage.read_timeout_s=3",
        "storage.max_attempts=4",
        "storage.multipart_mb=5",
        "cost.tags={team: ranking, project: ctr}",
    ]


@contextlib.contextmanager
def small_filesystem(path: Path, size_kb: int) -> Iterator[Path]:
    """A real filesystem of `size_kb` at `path` (tmpfs; needs CAP_SYS_ADMIN, as root in CI has):
    a real full disk, with ENOSPC and SIGBUS exactly as a user meets them."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({mounted.stderr.strip()}); the disk-full test needs one")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
