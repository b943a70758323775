"""Keys of earlier config versions: where each now lives, so an old config gets a message
that names the new key instead of "unknown key"."""

from __future__ import annotations

__all__ = ["MOVED_TRAIN_KEYS", "RETIRED_KEYS"]


# Where each key of the flat train section of earlier versions lives now.
MOVED_TRAIN_KEYS = {
    "lr": "optim.lr", "lr_reference_batch": "optim.lr_reference_batch", "weight_decay": "optim.weight_decay",
    "grad_clip": "optim.grad_clip", "warmup_steps": "schedule.warmup_steps", "checkpoint_every": "checkpoint.every",
    "mean_seconds_between_preemptions": "checkpoint.mean_seconds_between_preemptions",
    "keep_last": "checkpoint.keep_last", "spot_notice_url": "checkpoint.spot_notice_url",
    "spot_poll_seconds": "checkpoint.spot_poll_seconds", "num_workers": "loader.num_workers",
    "torch_threads": "loader.torch_threads", "loader_cache_mb": "loader.cache_mb",
    "nproc_per_node": "distributed.nproc_per_node", "nnodes": "distributed.nnodes",
    "ddp_bucket_mb": "distributed.bucket_mb", "ddp_timeout_s": "distributed.timeout_s",
    "max_retries": "retry.max_retries", "retry_delay_seconds": "retry.delay_seconds",
    "max_restarts": "retry.max_restarts",
}




_STATIC_RENDEZVOUS = ("the nodes are started by TorchX and meet at torchrun's c10d rendezvous on the first node, "
                      "under the run key: remove it (train.distributed.rdzv_port sets the port)")

# Keys that are gone, with what replaced them: "unknown key" would leave the user guessing.
RETIRED_KEYS = {
    "train.distributed.rdzv_endpoint": _STATIC_RENDEZVOUS, "train.rdzv_endpoint": _STATIC_RENDEZVOUS,
    "train.distributed.rdzv_id": _STATIC_RENDEZVOUS, "train.rdzv_id": _STATIC_RENDEZVOUS,
}
