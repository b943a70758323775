"""One node of a multi-node job: `python -m training.worker.node RUN_KEY REL --job-sha256 HEX
--node K --rank0-env NAME --port P`, as TorchX starts it on every node (see training.launch.group).

It reads the frozen job the train task published at REL on the storage root (the storage
section comes in `RETRAIN_NODE_STORAGE`), refuses one whose bytes do not have the sha256 on its
command line (the launcher's: the root is written by others) or whose settings do not make the
run key it was started for, brings down what the job reads (the dataset's manifest and segment markers,
the feature statistics; shards come on demand) and replaces itself with torchrun at the c10d
rendezvous on the first node. It never lists the source, packs, fits, or writes the root:
global rank 0 writes the run's own files, as on one node.

A problem here is one `error` event on stdout (the launcher raises it in the flow) and exit
code EXIT_USER_ERROR.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

from pydantic import ValidationError

from training.config import StorageConfig
from training.data.ingest.dataset_store import DatasetStore
from training.data.manifest import DatasetManifest
from training.errors import EXIT_USER_ERROR, ConfigError, DataError, RetrainError
from training.launch.group import PID_DIR_ENV, STORAGE_ENV, FrozenJob
from training.launch.process import with_parent_death_signal
from training.pipeline.preprocess_stage import fitted_before
from training.pipeline.train_stage import run_key_for
from training.protocol.entries import WORKER_MODULE
from training.protocol.events import ErrorReport, NodeJoined
from training.protocol.job import TrainJob
from training.protocol.sealed import Sealed
from training.storage.root import StorageRoot
from training.copies import updated

__all__ = ["last_call_seconds", "main", "node_job", "torchrun_command"]


def _say(event: NodeJoined | ErrorReport) -> None:
    sys.stdout.write(event.model_dump_json() + "\n")
    sys.stdout.flush()


def _storage() -> StorageConfig:
    raw = os.environ.get(STORAGE_ENV)
    if not raw:
        raise ConfigError(f"{STORAGE_ENV} is not set: this entry point is started by the train task of a multi-node "
                          "run (train.distributed.nnodes > 1), not by hand")
    try:
        return StorageConfig.model_validate_json(raw)
    except ValidationError as err:
        raise ConfigError(f"{STORAGE_ENV} is not a storage section: {str(err).splitlines()[0]}") from None


def _rebased(path: str, frozen_root: Path, root: StorageRoot) -> str:
    """A path of the publisher's machine, on this node's local folder of the same root."""
    try:
        rel = Path(path).relative_to(frozen_root)
    except ValueError:
        raise ConfigError(f"the frozen job names {path}, outside its storage root {frozen_root}") from None
    return str(root.path(str(rel)))


def node_job(run_key: str, rel: str, storage: StorageConfig, job_sha256: str) -> TrainJob:
    """The frozen job at `rel`, checked to be the bytes the launcher published (`job_sha256`)
    and run `run_key`'s, with its paths on this node and what it reads brought down from the root."""
    root = StorageRoot(storage)
    where = root.display(rel)
    path = root.fetch(rel, fresh=True)
    if path is None:
        raise ConfigError(f"the frozen job {where} is not on the storage root; the train task publishes it before it "
                          "starts the nodes: run it again")
    data = Sealed(path, job_sha256).read("the frozen job")
    try:
        frozen = FrozenJob.model_validate_json(data)
        job = frozen.job
    except ValidationError as err:
        raise ConfigError(f"{where} is not a frozen training job: {str(err).splitlines()[0]}") from None
    if frozen.run_key != run_key or job.run_key != run_key:
        raise ConfigError(f"{where} holds run {job.run_key[:12]}, not run {run_key[:12]} this node was started for: "
                          "every node trains the job its train task froze; run the flow again")
    numerics = (job.numerics[0], job.numerics[1]) if job.numerics and len(job.numerics) == 2 else None
    if numerics is None or run_key_for(job.config, Path(job.dataset_dir).name, job.init_sha256, numerics) != run_key:
        # The key is a fingerprint of what the run computes: a job whose settings were changed
        # under its name (the root is writable by others) is not the run this node was started for.
        raise ConfigError(f"{where} does not hold what run {run_key[:12]} computes (its settings, dataset or numerics "
                          "differ from the ones its key was made of): damaged or tampered with; run the flow again")
    base = Path(frozen.local_root)
    job.config = updated(job.config, {"storage": storage})
    job.run_dir = _rebased(job.run_dir, base, root)
    job.dataset_dir = _rebased(job.dataset_dir, base, root)
    job.stats_path = _rebased(job.stats_path, base, root)
    if job.init_weights:
        job.init_weights = _rebased(job.init_weights, base, root)
    if root.is_remote:
        _bring_down(job, root, base)
    return job


def _bring_down(job: TrainJob, root: StorageRoot, base: Path) -> None:
    """The dataset's manifest and its segments' markers, the statistics and a warm start's
    weights, from S3 to this node's working copy (read, never written there)."""
    store = DatasetStore(root)
    fingerprint = Path(job.dataset_dir).name
    folder = store.fetch_dataset(fingerprint)
    if folder is None:
        raise DataError(f"dataset {fingerprint[:12]} of the frozen job is not on {root.display('datasets')}; run the "
                        "flow again (its pack stage writes it)")
    manifest = DatasetManifest.from_json((folder / "manifest.json").read_bytes(), root.display(
        f"datasets/{fingerprint}/manifest.json"))
    store.prime_catalog(fingerprint)  # the segments' segment.json files in one GET
    for segment in manifest.segments:
        if store.available_segment(segment.key) is None:
            raise DataError(f"segment {segment.key[:12]} of dataset {fingerprint[:12]} is not on "
                            f"{root.display('datasets/segments')}; run the flow again (its pack stage packs it)")
    if fitted_before(folder, job.config.preprocess, root, time.perf_counter()) is None:
        raise DataError(f"the feature statistics of dataset {fingerprint[:12]} are not on the storage root; run the "
                        "flow again (its preprocess stage fits them)")
    if job.init_weights and root.fetch(str(Path(job.init_weights).relative_to(root.local))) is None:
        raise DataError(f"the warm start's weights {job.init_weights} are not on the storage root; run the flow again")


def last_call_seconds(join_timeout: float) -> int:
    """torchrun's wait, once the fewest nodes (min_nnodes) are in, for more to come: 30 s by
    default, which a join timeout of 30 s or less would never let start. A quarter of the join
    timeout, at most 30 s."""
    return max(1, min(30, int(join_timeout // 4)))


def torchrun_command(job: TrainJob, sealed: Sealed, error_path: Path, host: str, port: int) -> list[str]:
    """This node's ranks under torchrun at the c10d rendezvous on `host:port`, under the run key."""
    d = job.config.train.distributed
    nodes = f"{d.min_nnodes}:{d.nnodes}" if d.min_nnodes and d.min_nnodes < d.nnodes else str(d.nnodes)
    return with_parent_death_signal([
        sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--nproc-per-node={d.nproc_per_node}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={host}:{port}", f"--rdzv-id={job.run_key}",
        f"--rdzv-conf=join_timeout={int(d.join_timeout_s)},last_call_timeout={last_call_seconds(d.join_timeout_s)}",
        f"--max-restarts={d.max_restarts}",
        "--monitor-interval=0.5", "-m", WORKER_MODULE, sealed.arg(), str(error_path)])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.worker.node")
    parser.add_argument("run_key")
    parser.add_argument("rel")
    parser.add_argument("--job-sha256", required=True)
    parser.add_argument("--node", type=int, default=0)
    parser.add_argument("--rank0-env", default="TORCHX_RANK0_HOST")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    # This node's own files stay off the root: the job as rebased here, the ranks' error files.
    own = Path(tempfile.mkdtemp(prefix=f"retrain-node-{args.node}-"))
    pid_dir = os.environ.get(PID_DIR_ENV)
    if pid_dir:  # a node on the launcher's machine: it waits for this process (torchrun, after the exec)
        (Path(pid_dir) / f"node-{args.node}.pid").write_text(str(os.getpid()))
        (Path(pid_dir) / f"node-{args.node}.home").write_text(str(own))  # removed when the group ends
    try:
        storage = _storage()
        if pid_dir and storage.is_s3:
            # Nodes that share a machine would share its working copy of the root, and one
            # node's downloads, evictions and markers would be another's: each has its own.
            storage = updated(storage, {"local_dir": str(own / "root")})
        job = node_job(args.run_key, args.rel, storage, args.job_sha256)
    except RetrainError as err:
        _say(ErrorReport(type=type(err).__name__, message=f"node {args.node}: {err}",
                         transient=getattr(err, "transient", False)))
        return EXIT_USER_ERROR
    sealed = job.seal(own / "job.json")
    host = os.environ.get(args.rank0_env) or "localhost"
    _say(NodeJoined(node=args.node, host=socket.gethostname(), endpoint=f"{host}:{args.port}"))
    command = torchrun_command(job, sealed, own / "error.json", host, args.port)
    os.execv(command[0], command)  # torchrun gets this process's signals (TorchX stops a node with SIGTERM)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
