"""A training step with no Python in it: forward, loss, backward, clipping and the AdamW update
on tensors that stay where they are, so that on a CUDA device the whole step is captured once as
a CUDA graph and replayed (`GraphedStep`), and the host launches one graph where it launched
hundreds of kernels.

What makes a step capturable (PyTorch's rules for CUDA graphs, and Megatron's full-iteration
graph): nothing in it reads the host or branches on a tensor, and every tensor it reads has a
fixed address. So:

- the learning rate is a device tensor, read from the schedule's table (`lr_table`: bit for bit
  the values `LambdaLR` gives today) at a device step counter; the fused AdamW kernel takes it
  as a tensor, and its step counts already live on the device;
- gradients are zeroed in place, never set to None: the next backward accumulates into the same
  memory;
- clipping is one fused norm over every gradient, scaled on the device (`clip_gradients`, the
  same arithmetic as `torch.nn.utils.clip_grad_norm_`, used by the eager step too);
- the batch comes from `StepInputs`: resident rows gathered inside the step at positions the host
  writes once per block of steps, or a streamed batch copied into static buffers;
- autocast runs without its weight cache under capture (a cached cast would be baked into the
  graph);
- fp16 is left to the eager step: its GradScaler reads the host every step to skip a step with
  an inf.

`torch.compile(fullgraph=True)` of `CapturableStep.__call__` on a CPU fails on any host read, a
Python branch on a tensor or a graph break: that is the test that the step is capturable
(tests/training/trainer/test_step.py), run where no GPU is.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Protocol

import torch

from training.config import TrainConfig
from training.data.batch import Batch, Groups
from training.model.network import Forward
from training.model.objectives import Task
from training.model.spec import lr_lambda

__all__ = ["CapturableStep", "GraphedStep", "ResidentInputs", "StaticInputs", "StepInputs", "block_length",
           "choose_k", "clip_gradients", "lr_table", "step_support", "sync_schedule"]

log = logging.getLogger(__name__)


def lr_table(tc: TrainConfig, base_lr: float, device: torch.device) -> torch.Tensor:
    """The learning rate of every optimizer step 0..max_steps, as `LambdaLR` computes it (the
    base rate times `lr_lambda`, in Python's doubles), on `device` in float64: the fused kernel
    reads it where it reads today's Python float, and gets the same number."""
    f = lr_lambda(tc.schedule.warmup_steps, tc.max_steps)
    return torch.tensor([base_lr * f(s) for s in range(tc.max_steps + 1)], dtype=torch.float64, device=device)


def clip_gradients(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale `grads` so that their global 2-norm is at most `max_norm`; the norm before. One
    fused norm over every gradient and one fused multiply, with no host read: the arithmetic of
    `torch.nn.utils.clip_grad_norm_` (foreach), so the eager and the captured step agree bit for
    bit."""
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
    torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


class StepInputs(Protocol):
    """Where a step's micro-batches come from, inside the step."""

    def micro(self, i: int) -> Batch: ...

    def advance(self) -> None: ...


class StaticInputs:
    """A streamed step's micro-batches, in buffers at fixed addresses: `load` copies each new
    batch into them (non-blocking, from pinned memory) before the step runs."""

    def __init__(self, accum: int) -> None:
        self.buffers: list[Batch | None] = [None] * accum

    def load(self, batches: list[Batch], copy: bool) -> None:
        """`copy`: into the buffers (a captured step reads them there); otherwise the batches
        become the buffers (an eager step reads them wherever they are)."""
        for i, batch in enumerate(batches):
            held = self.buffers[i]
            if not copy or held is None:
                self.buffers[i] = batch
                continue
            for name, value in batch.items():
                getattr(held, name).copy_(value, non_blocking=True)

    def micro(self, i: int) -> Batch:
        batch = self.buffers[i]
        assert batch is not None, "load the step's batches first"
        return batch

    def advance(self) -> None:
        """Nothing: the host loads the next step's batches."""


class ResidentInputs:
    """A resident split's micro-batches, gathered inside the step: `positions` holds the rows of
    every micro-batch of a block of steps (the host writes it once per block, from the epoch's
    order: `ResidentBatches.positions`), and `cursor`, a device counter, says which step of the
    block this is."""

    def __init__(self, tensors: dict[str, torch.Tensor], accum: int, batch_size: int, capacity: int,
                 device: torch.device) -> None:
        Batch.of(tensors)  # only the batch's groups
        self.tensors, self.accum = tensors, accum
        self.positions = torch.zeros((capacity * accum, batch_size), dtype=torch.int64, device=device)
        self.cursor = torch.zeros((1,), dtype=torch.int64, device=device)

    def start_block(self, positions: torch.Tensor) -> None:
        """The rows of the block's micro-batches, in order, one row of `positions` each."""
        self.positions[: positions.shape[0]].copy_(positions, non_blocking=True)
        self.cursor.zero_()

    def micro(self, i: int) -> Batch:
        at = self.cursor * self.accum + i
        rows = self.positions.index_select(0, at).view(-1)
        # Groups itself, not its alias Batch: dynamo traces a dataclass's constructor, not a
        # typing alias's call. The keys were checked at start.
        return Groups(**{k: t.index_select(0, rows) for k, t in self.tensors.items()})

    def advance(self) -> None:
        self.cursor.add_(1)


@dataclass(frozen=True)
class _Hyper:
    beta1: float
    beta2: float
    eps: float
    weight_decay: float


class CapturableStep:
    """One optimizer step over `accum` micro-batches from `inputs`, every operand on the device:
    see the module docstring. The optimizer's own state tensors are updated, so a checkpoint
    saves and a resume loads it as for the eager step, and the two are interchangeable at any
    step."""

    def __init__(self, model: torch.nn.Module, forward: Forward, task: Task, optimizer: torch.optim.Optimizer,
                 table: torch.Tensor, tc: TrainConfig, accum: int, device: torch.device, dtype: torch.dtype | None,
                 inputs: StepInputs) -> None:
        (group,) = optimizer.param_groups  # step_support checked it: the built-in AdamW's one group
        self.model, self.forward, self.task, self.optimizer = model, forward, task, optimizer
        self.table, self.accum, self.device, self.dtype, self.inputs = table, accum, device, dtype, inputs
        self.clip = tc.optim.grad_clip
        self.params = [p for p in group["params"] if p.requires_grad]
        beta1, beta2 = group["betas"]
        self.hyper = _Hyper(float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]))
        self.counter = torch.zeros((), dtype=torch.int64, device=device)  # the optimizer step, on the device
        self.autocast_cache = True
        self._init_state()

    def _init_state(self) -> None:
        """Gradients and AdamW's state allocated now (as its first step would: step counts in
        float32 on the parameter's device, moments zero), so their addresses never change."""
        state = self.optimizer.state
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if not state[p]:
                state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                            "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
        self.grads = [p.grad for p in self.params if p.grad is not None]  # every one, allocated above
        self.exp_avgs = [state[p]["exp_avg"] for p in self.params]
        self.exp_avg_sqs = [state[p]["exp_avg_sq"] for p in self.params]
        self.steps = [state[p]["step"] for p in self.params]

    def sync(self, step: int) -> None:
        """The device counter at optimizer step `step` (at the start, and after a resume)."""
        self.counter.fill_(step)

    def __call__(self) -> torch.Tensor:
        """The step; its summed loss, on the device."""
        torch._foreach_zero_(self.grads)
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        for i in range(self.accum):
            loss = self.task.forward_loss(self.forward, self.inputs.micro(i), self.device, self.dtype,
                                          cache=self.autocast_cache)
            if self.accum > 1:
                loss = loss / self.accum  # the summed gradient is a mean
            loss.backward()
            loss_sum = loss_sum + loss.detach()
        with torch.no_grad():
            if self.clip > 0:
                clip_gradients(self.grads, self.clip)
            h = self.hyper
            # What `torch.optim.AdamW(fused=True).step()` runs for one device and dtype, called
            # directly: the Python around it is kept out of torch.compile and graphs (it groups
            # tensors by device on every call), and here every parameter shares one of each.
            torch._foreach_add_(self.steps, 1)
            torch._fused_adamw_(self.params, self.grads, self.exp_avgs, self.exp_avg_sqs, [], self.steps,
                                amsgrad=False, lr=self.table[self.counter], beta1=h.beta1, beta2=h.beta2,
                                weight_decay=h.weight_decay, eps=h.eps, maximize=False)
            self.counter.add_(1)
            self.inputs.advance()
        return loss_sum


def step_support(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
                 built_in: bool, precision: str, world_size: int) -> str | None:
    """Why this run's step cannot run as `CapturableStep` (None: it can)."""
    if not built_in:
        return "model.factory names a TrainSpec with its own optimizer or schedule"
    if precision == "fp16":
        return "fp16's GradScaler reads the host every step to skip steps with an inf"
    if world_size > 1:
        return "DDP's gradient all-reduce runs host code in every backward"
    if not isinstance(optimizer, torch.optim.AdamW) or len(optimizer.param_groups) != 1:
        return "the optimizer is not the built-in AdamW"
    group = optimizer.param_groups[0]
    if not group.get("fused") or group.get("amsgrad") or group.get("maximize"):
        return "train.optim.fused is off (the capturable update is AdamW's fused kernel)"
    if len({(p.device, p.dtype) for p in group["params"]}) > 1:
        return "the parameters are on several devices or of several dtypes"
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        return "the learning-rate schedule is not the built-in warm-up and cosine"
    return None


class GraphedStep:
    """A `CapturableStep` captured as one CUDA graph after warm-up steps on a side stream, then
    replayed: one launch a step. Warm-up steps are real steps of the run (run by the step itself,
    eagerly); capture records without running, so the run's state moves only on replays."""

    def __init__(self, step: CapturableStep) -> None:
        self.step = step
        self.graph: torch.cuda.CUDAGraph | None = None
        self.loss: torch.Tensor | None = None

    def warm_up(self) -> torch.Tensor:
        """One eager step on a side stream (cuBLAS workspaces, autograd's buffers and the
        allocator settle before capture)."""
        stream = torch.cuda.Stream(self.step.device)
        stream.wait_stream(torch.cuda.current_stream(self.step.device))
        with torch.cuda.stream(stream):
            loss = self.step()
        torch.cuda.current_stream(self.step.device).wait_stream(stream)
        return loss

    def capture(self) -> None:
        self.step.autocast_cache = False  # a cached cast is an address the graph would keep
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.loss = self.step()
        self.graph = graph

    def __call__(self) -> torch.Tensor:
        assert self.graph is not None and self.loss is not None
        self.graph.replay()
        return self.loss


def sync_schedule(scheduler: torch.optim.lr_scheduler.LRScheduler, optimizer: torch.optim.Optimizer,
                  step: int) -> None:
    """The schedule's host state as the eager loop leaves it after `step` steps (its
    `LambdaLR.step()` count, last epoch and rates), set in one go at a block's end: the captured
    step reads its rate from the table, and a checkpoint or a validation reads these."""
    assert isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR)  # step_support checked it
    rates = [base * fn(step) for fn, base in zip(scheduler.lr_lambdas, scheduler.base_lrs, strict=True)]
    for group, rate in zip(optimizer.param_groups, rates, strict=True):
        group["lr"] = rate
    # LambdaLR's own fields, which its state_dict saves: step() would set the same, but warns
    # when the optimizer's step() was never called (the captured step calls its kernel).
    scheduler.last_epoch, scheduler._step_count, scheduler._last_lr = step, step + 1, rates


def block_length(step: int, k: int, stops: list[int]) -> int:
    """Steps in the block that starts at `step`: to the next multiple of `k` (blocks keep to
    multiples of k, so a run resumed inside a block realigns) and no further than any of `stops`
    (the run's end, a tuning rung)."""
    end = (step // k + 1) * k
    return max(1, min([end, *[s for s in stops if s > step]]) - step)


def choose_k(boundary_seconds: float, step_seconds: float, period: int, max_block_seconds: float = 0.5,
             limit: int = 256) -> int:
    """Steps per block: the smallest divisor of `period` (the steps between validations and
    step-counted checkpoints, which blocks must never skip) at which the boundary's host work
    (timing, heartbeat, budget and stop decisions, the ranks' agreement) costs under 2 % of the
    block, and no larger than `max_block_seconds` of steps allows (a stop lands at the next
    boundary)."""
    if step_seconds <= 0 or not math.isfinite(step_seconds):
        return 1
    divisors = [d for d in range(1, period + 1) if period % d == 0]
    cap = max(1, min(limit, int(max_block_seconds / step_seconds)))
    for d in divisors:
        if d > cap:
            break
        if boundary_seconds < 0.02 * d * step_seconds:
            return d
    return max([d for d in divisors if d <= cap] or [1])
