"""Planning a pack of many new files on an S3 source: footers read `PLAN_THREADS` at a time
against one by one, the same files and code in the same run.

Each new file costs a footer read (two ranged GETs) before anything is packed, so a source of
many new files is planned in round trips. The endpoint is moto's S3 server on 127.0.0.1 behind a
loopback proxy that holds each request `DELAY_MS` before passing it on, a stand-in for a network
round trip; on bare loopback a request costs moto's handling alone. The figure is the ratio of
the two plans' seconds, median over interleaved rounds; it depends on the delay chosen and on
how many requests moto serves at once on this machine.
"""

from __future__ import annotations

import io
import socket
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_s3 import _server
from benchmarks.common import demo_parquet

FILES = 200
ROWS_PER_FILE = 50
DELAY_MS = 20
ROUNDS = 3


def _pipe(source: socket.socket, sink: socket.socket, delay: float) -> None:
    try:
        while data := source.recv(65536):
            if delay:
                time.sleep(delay)
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for s in (source, sink):
            try:
                s.close()
            except OSError:
                pass


def _delaying_proxy(upstream_port: int, delay: float) -> int:
    """A loopback TCP proxy that holds every chunk a client sends for `delay` seconds."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(256)

    def accept() -> None:
        while True:
            client, _ = listener.accept()
            upstream = socket.create_connection(("127.0.0.1", upstream_port))
            threading.Thread(target=_pipe, args=(client, upstream, delay), daemon=True).start()
            threading.Thread(target=_pipe, args=(upstream, client, 0.0), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return int(listener.getsockname()[1])


def _plan_seconds(endpoint: str, work: Path, threads: int, name: str) -> float:
    import training.data.ingest.packing as packing
    from training.config import load_config
    from training.data.ingest.dataset_store import DatasetStore
    from training.storage.root import StorageRoot

    packing.PLAN_THREADS = threads
    config = load_config(overrides=["data.source=s3://bench-plan/src/", f"storage.root=s3://bench-plan/{name}",
                                    f"storage.endpoint_url={endpoint}", f"storage.local_dir={work / name}"])
    store = DatasetStore(StorageRoot.from_config(config))
    t0 = time.perf_counter()
    plan, _ = packing.plan_pack(config.data.source or "", config.data, store, config.storage)
    seconds = time.perf_counter() - t0
    assert len(plan.todo) == FILES and not plan.ready
    return seconds


def run(work: Path) -> dict[str, Any]:
    import boto3
    import pyarrow.parquet as pq

    import training.data.ingest.packing as packing

    server, upstream = _server()
    pooled_threads = packing.PLAN_THREADS
    try:
        port = int(upstream.rsplit(":", 1)[1])
        s3 = boto3.client("s3", endpoint_url=upstream)
        s3.create_bucket(Bucket="bench-plan")
        table = pq.read_table(demo_parquet(work, FILES * ROWS_PER_FILE))
        for i in range(FILES):
            buffer = io.BytesIO()
            pq.write_table(table.slice(i * ROWS_PER_FILE, ROWS_PER_FILE), buffer)
            s3.put_object(Bucket="bench-plan", Key=f"src/day-{i:04d}.parquet", Body=buffer.getvalue())
        endpoint = f"http://127.0.0.1:{_delaying_proxy(port, DELAY_MS / 1000)}"
        serial, pooled = [], []
        for r in range(ROUNDS):  # interleaved, each on a fresh root: every file is new to it
            serial.append(_plan_seconds(endpoint, work, 1, f"serial-{r}"))
            pooled.append(_plan_seconds(endpoint, work, pooled_threads, f"pooled-{r}"))
    finally:
        packing.PLAN_THREADS = pooled_threads
        server.stop()
    ratios = [p / s for p, s in zip(pooled, serial, strict=True)]
    return {
        "endpoint": f"moto S3 server on 127.0.0.1 behind a proxy adding {DELAY_MS} ms per request",
        "new_files": FILES,
        "plan_threads": pooled_threads,
        "rounds": ROUNDS,
        "plan_seconds_one_by_one": round(statistics.median(serial), 2),
        "plan_seconds_threaded": round(statistics.median(pooled), 2),
        "threaded_vs_one_by_one": round(statistics.median(ratios), 3),
        "threaded_vs_one_by_one_per_round": [round(r, 3) for r in ratios],
    }
