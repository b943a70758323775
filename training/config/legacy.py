"""Keys of earlier config versions: where each now lives, so an old config gets a message
that names the new key instead of "unknown key"."""

from __future__ import annotations

__all__ = ["MOVED_TRAIN_KEYS"]


# Where each key of the flat train section of earlier versions lives now.
MOVED_TRAIN_KEYS = {
    "lr": "optim.lr", "lr_reference_batch": "optim.lr_reference_batch", "weight_decay": "optim.weight_decay",
    "grad_clip": "optim.grad_clip", "warmup_steps": "schedule.warmup_steps", "checkpoint_every": "checkpoint.every",
    "mean_seconds_between_preemptions": "checkpoint.mean_seconds_between_preemptions",
    "keep_last": "checkpoint.keep_last", "spot_notice_url": "checkpoint.spot_notice_url",
    "spot_poll_seconds": "checkpoint.spot_poll_seconds", "num_workers": "loader.num_workers",
    "torch_threads": "loader.torch_threads", "loader_cache_mb": "loader.cache_mb",
    "nproc_per_node": "distributed.nproc_per_node", "nnodes": "distributed.nnodes",
    "rdzv_endpoint": "distributed.rdzv_endpoint", "rdzv_id": "distributed.rdzv_id",
    "ddp_bucket_mb": "distributed.bucket_mb", "ddp_timeout_s": "distributed.timeout_s",
    "max_retries": "retry.max_retries", "retry_delay_seconds": "retry.delay_seconds",
    "max_restarts": "retry.max_restarts",
}


