"""The multi-node settings refuse what cannot run, each in one line that names the key."""

from __future__ import annotations

import pytest

from training.config import load_config
from training.errors import ConfigError

K8S = ["train.distributed.nnodes=2", "train.distributed.scheduler=kubernetes", "train.distributed.kubernetes.image=i:1"]


@pytest.mark.parametrize(("overrides", "says"), [
    (["train.distributed.nnodes=2", "train.distributed.min_nnodes=3"], "min_nnodes 3 is above train.distributed.nnodes 2"),
    (["train.distributed.nnodes=2", "train.distributed.scheduler=kubernetes"], "needs train.distributed.kubernetes.image"),
    ([*K8S, "train.distributed.kubernetes.gpu=8"], "train.precision auto cannot be resolved for nodes on Kubernetes"),
    (["train.distributed.nnodes=4", "train.distributed.min_nnodes=3", "train.batch_size=8"],
     "divisible by nproc_per_node x nodes = 3 for every node count"),
    (["train.distributed.rdzv_endpoint=10.0.0.1:29400"],
     "'train.distributed.rdzv_endpoint' is no longer a setting: the nodes are started by TorchX"),
    (["train.rdzv_id=x"], "'train.rdzv_id' is no longer a setting"),
])
def test_a_multi_node_setting_that_cannot_run_is_refused_in_one_line(overrides: list[str], says: str) -> None:
    with pytest.raises(ConfigError, match=says) as err:
        load_config(overrides=overrides)
    assert "\n" not in str(err.value)


def test_nodes_on_kubernetes_with_named_numerics_are_accepted() -> None:
    config = load_config(overrides=[*K8S, "train.distributed.kubernetes.gpu=8", "train.precision=bf16"])
    from training.protocol.numerics import job_numerics

    assert job_numerics(config) == ("cuda", "bf16")  # the nodes', though this machine has no GPU
