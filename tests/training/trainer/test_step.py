"""The capturable step and the K-step loop, proven on a CPU: the step has no host read in it
(torch.compile(fullgraph=True) traces it whole), it trains the eager step's model bit for bit,
its schedule is LambdaLR's, and a run resumes bit-identically across and inside blocks of steps
on the resident and the streamed path."""

from __future__ import annotations

import math

import pytest
import torch

from tests.training.helpers import make_job
from training.config import RetrainConfig
from training.errors import Preempted
from training.model.spec import lr_lambda
from training.protocol.events import ChildEvent
from training.trainer.run import StopFlag, train
from training.trainer.step import StaticInputs, block_length, choose_k, lr_table
from training.trainer.trainer import Trainer


def _config(base: RetrainConfig, **train: object) -> RetrainConfig:
    config = base.model_copy(deep=True)
    config.train.optim.grad_clip = 1.0  # clipping is in the step
    for key, value in train.items():
        target = config.train
        *path, name = key.split("__")
        for part in path:
            target = getattr(target, part)
        setattr(target, name, value)
    return config


@pytest.mark.parametrize("resident", [True, False])
def test_the_step_traces_whole_with_no_host_read(resident: bool, small_config: RetrainConfig) -> None:
    """Dynamo fails on an .item(), a Python branch on a tensor, a host copy or a graph break:
    with fullgraph=True the step compiles only when a CUDA graph could hold it."""
    import torch._dynamo

    config = _config(small_config, step="graph", loader__resident=resident, grad_accum=2)
    trainer = Trainer(make_job(config))
    step = trainer.capturable
    assert step is not None
    if resident:
        step.inputs.start_block(trainer.train_batches.positions(0, 2, trainer.per_epoch))  # type: ignore[attr-defined]
    else:
        stream = iter(trainer.loader)
        assert isinstance(step.inputs, StaticInputs)
        step.inputs.load([next(stream)[2], next(stream)[2]], copy=False)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        loss = torch.compile(step.__call__, fullgraph=True, backend="eager")()
    assert loss.shape == () and math.isfinite(float(loss))

    def with_a_host_read() -> torch.Tensor:  # the test's own control: a host read is caught
        loss = step()
        if loss.item() > 0:
            return loss * 2
        return loss

    torch._dynamo.reset()
    with torch._dynamo.config.patch(trace_autograd_ops=True), pytest.raises(torch._dynamo.exc.TorchDynamoException):
        torch.compile(with_a_host_read, fullgraph=True, backend="eager")()


def test_the_lr_table_is_lambdalr_at_every_step(small_config: RetrainConfig) -> None:
    tc = small_config.train.model_copy(update={"max_steps": 97})
    tc.schedule.warmup_steps = 7
    table = lr_table(tc, 3e-3, torch.device("cpu"))
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(7, 97))
    for step in range(98):
        assert table[step].item() == scheduler.get_last_lr()[0], step
        optimizer.step()
        scheduler.step()


@pytest.mark.parametrize("resident", [True, False])
def test_the_capturable_step_trains_the_eager_model_bit_for_bit(resident: bool, small_config: RetrainConfig) -> None:
    """Two micro-batches a step, clipping, dropout, across an epoch (60 steps of 2 x 128 rows
    of this split): the eager step and the capturable one end with the same weights and
    history, whatever the blocks' lengths."""
    base = _config(small_config, loader__resident=resident, grad_accum=2, steps_per_block=4)
    base.model.dropout = 0.1
    eager = train(make_job(_config(base, step="eager", steps_per_block=1), "eager"))
    graph = train(make_job(_config(base, step="graph"), "graph"))
    assert graph.model.sha256 == eager.model.sha256
    assert [h.to_json() for h in graph.history] == [h.to_json() for h in eager.history]


def _stopped_at(job_config: RetrainConfig, name: str, at: int) -> None:
    job = make_job(job_config, name)
    stop = StopFlag()

    def emit(event: ChildEvent) -> None:
        if event.event == "checkpoint" and event.step == at:
            stop.request("test")

    with pytest.raises(Preempted):
        train(job, stop, emit)


@pytest.mark.parametrize("resident", [True, False])
def test_a_run_resumes_bit_identically_across_and_inside_blocks(resident: bool, small_config: RetrainConfig) -> None:
    """Blocks of 4 steps. Stopped at a block's end (step 20), resumed; stopped again at step 26,
    a checkpoint inside a block (written where blocks were 1 step and checkpoints every 2),
    resumed in blocks of 4, which realign to multiples of 4: the model and history are the
    uninterrupted run's."""
    base = _config(small_config, step="graph", loader__resident=resident, steps_per_block=4)
    reference = train(make_job(base, "interrupted-reference"))
    _stopped_at(base, "interrupted", 20)
    _stopped_at(_config(base, steps_per_block=1, checkpoint__every=2), "interrupted", 26)
    resumed = train(make_job(base, "interrupted"))
    assert resumed.resumed_from_steps == [20, 26]
    assert resumed.model.sha256 == reference.model.sha256
    assert [h.to_json() for h in resumed.history] == [h.to_json() for h in reference.history]


def test_an_eager_runs_checkpoint_resumes_into_the_capturable_step(small_config: RetrainConfig) -> None:
    """A checkpoint the eager step wrote (its optimizer not capturable, its schedule a Python
    float) resumes into the capturable step and ends where the eager run ends."""
    base = _config(small_config, loader__resident=True)
    reference = train(make_job(_config(base, step="eager"), "eager-reference"))
    _stopped_at(_config(base, step="eager"), "switched", 20)
    resumed = train(make_job(_config(base, step="graph"), "switched"))
    assert resumed.resumed_from_steps == [20]
    assert resumed.model.sha256 == reference.model.sha256


def test_blocks_keep_to_their_multiples_and_stops() -> None:
    assert block_length(0, 4, [60]) == 4 and block_length(26, 4, [60]) == 2 and block_length(58, 4, [60]) == 2
    assert block_length(10, 8, [60, 12]) == 2  # a tuning rung at 12
    assert block_length(5, 1, [60]) == 1


def test_k_is_the_fewest_steps_whose_host_work_is_under_two_percent() -> None:
    # 30 us of host work a block, 1 ms steps: 1 step is 3 %, 2 steps 1.5 %.
    assert choose_k(30e-6, 1e-3, 20) == 2
    assert choose_k(1e-6, 1e-3, 20) == 1
    # 0.2 ms steps under 0.1 ms of host work: 25 steps would do, the divisors of 20 give 20.
    assert choose_k(1e-4, 2e-4, 20) == 20
    assert all(20 % choose_k(b, 1e-4, 20) == 0 for b in (1e-6, 1e-5, 1e-4, 1e-3))
    # Half a second of steps at most, whatever the host work: a stop lands soon.
    assert choose_k(1.0, 0.1, 20) == 5
