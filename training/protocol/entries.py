"""The child processes' entry points, by module name: what a launcher runs with `python -m`, and
what a zygote agrees to fork. Both sides read these; only the worker side imports the modules."""

from __future__ import annotations

__all__ = ["FORKABLE", "HOLD_FLAG", "NODE_MODULE", "STAGE_CHILD_MODULE", "WORKER_MODULE", "ZYGOTE_MODULE"]

WORKER_MODULE = "training.worker.train"
# Stage work that needs torch (evaluation, promotion), run outside the flow's process.
STAGE_CHILD_MODULE = "training.worker.stage"
# The modules a zygote runs in its children: each takes `JOB ERROR PARENT_PID ...` and has a
# `main(argv) -> int`.
FORKABLE = (WORKER_MODULE, STAGE_CHILD_MODULE)
ZYGOTE_MODULE = "training.worker.zygote"
# One node of a multi-node job, started by TorchX on each machine.
NODE_MODULE = "training.worker.node"
# A training worker started with it stays warm: it reads its next job on stdin.
HOLD_FLAG = "--hold"
