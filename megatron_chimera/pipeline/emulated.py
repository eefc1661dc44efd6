"""Emulated-compute stage modules: pipeline stages that *wait* instead of computing.

A forward takes ``forward_s``, a backward ``backward_s``; with split backward, B takes the
input-gradient time ``backward_s - weight_s`` and W takes ``weight_s``. Each action does tiny real
tensor work and waits *until its deadline*, so the work is part of the emulated time rather than
added to it (a stage with more tiny layers is not slower), and a time of zero never waits. A wait
sleeps, then spins its last :data:`SPIN_S` (the OS wakes a sleeper late, a device does not finish
late). Sleeping ranks do not compete for cores, so 8 ranks on 2 cores behave like 8 devices and
the measured iteration time exposes the schedule plus the runtime's overheads.

* :class:`EmulatedStage` runs in our executor: its :class:`Linear` layers take the
  weight-gradient time through :class:`SleepingWeightGradStore` (pass it as the executor's
  ``weight_grad_store_factory``).
* :class:`EmulatedCollectives` gives the gradient reduction a cost: each rank's buckets cross
  one emulated link, overlapping the (sleeping) compute.
* :class:`EmulatedTorchStage` runs in ``torch.distributed.pipelining``: the input-gradient and
  weight-gradient sleeps sit on separate autograd branches, so torch's split backward (which
  differentiates w.r.t. inputs and weights separately) takes each time once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megatron_chimera.model.linear import Linear, WeightGradStore
from megatron_chimera.pipeline.grad_sync import Collectives


@dataclass(frozen=True)
class EmulatedCosts:
    """Seconds per micro-batch and stage: forward, whole backward, and its weight-gradient part."""

    forward_s: float
    backward_s: float
    weight_s: float = 0.0

    def __post_init__(self) -> None:
        if min(self.forward_s, self.backward_s, self.weight_s) < 0:
            raise ValueError("emulated times must be >= 0")
        if self.weight_s > self.backward_s:
            raise ValueError(
                f"--weight-ms ({self.weight_s * 1e3:g}) must not exceed --backward-ms "
                f"({self.backward_s * 1e3:g}): W is part of the backward"
            )

    @property
    def input_grad_s(self) -> float:
        """Time of B when the backward is split."""
        return self.backward_s - self.weight_s

    def scaled(self, factor: float) -> EmulatedCosts:
        """Costs of a stage ``factor`` times as large (e.g. 1/v for v chunks per rank)."""
        return EmulatedCosts(self.forward_s * factor, self.backward_s * factor,
                             self.weight_s * factor)


#: the last part of every emulated wait is spun, not slept: waking from ``time.sleep`` takes the
#: OS 0.15-0.5 ms on the 2-core development VM (up to 3 ms under load), which a device that
#: computes for exactly the emulated time does not add (see docs/RUNTIME.md, the executor's cost)
SPIN_S = 0.0005


def sleep_until(deadline: float) -> None:
    """Wait until ``time.perf_counter()`` reaches ``deadline``: sleep until :data:`SPIN_S`
    before it, then spin (no call when it has passed)."""
    remaining = deadline - time.perf_counter()
    if remaining > SPIN_S:
        time.sleep(remaining - SPIN_S)
    while time.perf_counter() < deadline:
        pass


class _Deadlines:
    """The clock of one emulated action that sleeps in ``parts`` pieces (one per layer): piece
    ``k`` ends at ``start + k/parts`` of the action's time, so the real work between the pieces
    is absorbed instead of added."""

    def __init__(self, parts: int) -> None:
        self.parts = parts
        self._start = 0.0
        self._seconds = 0.0
        self._done = 0

    def begin(self, seconds: float) -> None:
        """The action starts now and lasts ``seconds``."""
        self._start, self._seconds, self._done = time.perf_counter(), seconds, 0

    def next_part(self) -> None:
        """Sleep until the end of the next piece."""
        self._done += 1
        if self._seconds > 0:
            sleep_until(self._start + self._seconds * self._done / self.parts)


class _SleepInBackward(torch.autograd.Function):
    """Identity whose backward sleeps ``seconds()`` (or, given ``deadlines``, its next piece);
    ``anchor`` keeps it in the graph at stage 0."""

    @staticmethod
    def forward(ctx, x, anchor, seconds: Callable[[], float],  # type: ignore[override]
                deadlines: _Deadlines | None = None):
        ctx.seconds, ctx.deadlines = seconds, deadlines
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if ctx.deadlines is not None:
            ctx.deadlines.next_part()
        elif ctx.seconds() > 0:
            sleep_until(time.perf_counter() + ctx.seconds())
        return grad.contiguous(), None, None, None


class _BackwardBegins(torch.autograd.Function):
    """Identity on a stage's output whose backward (the stage's first) starts its deadlines."""

    @staticmethod
    def forward(ctx, x, deadlines: _Deadlines, seconds: Callable[[], float]):  # type: ignore[override]
        ctx.deadlines, ctx.seconds = deadlines, seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.deadlines.begin(ctx.seconds())
        return grad, None, None


class SleepingWeightGradStore(WeightGradStore):
    """WeightGradStore whose flush (the W action) also sleeps each queued layer's W time."""

    def __init__(self) -> None:
        super().__init__()
        self._sleep_s = 0.0

    def put(self, weight, bias, inputs, grad_output) -> None:  # noqa: D102 - see base class
        self._sleep_s += getattr(weight, "emulated_weight_seconds", 0.0)
        super().put(weight, bias, inputs, grad_output)

    def flush(self) -> None:
        """Compute the (tiny) real gradients, then sleep until the queued weight-gradient time
        has passed."""
        deadline = time.perf_counter() + self._sleep_s
        self._sleep_s = 0.0
        super().flush()
        sleep_until(deadline)


class EmulatedStage(nn.Module):
    """A pipeline stage for our executor: ``[s, b, h] -> [s, b, h]`` (the loss ``[b, s]`` last).

    ``layers`` tiny linear layers share the stage's times; in backward each layer's parameters
    receive their gradients after its share of the time, so gradient buckets of a layer become
    final one after another, as in a real stage (what ``--overlap-grad-reduce`` exploits).
    """

    def __init__(self, costs: EmulatedCosts, pre_process: bool, post_process: bool,
                 hidden: int = 4, seed: int = 0, layers: int = 1) -> None:
        super().__init__()
        if layers < 1:
            raise ValueError(f"an emulated stage needs at least one layer, got {layers}")
        self.costs = costs
        self.pre_process, self.post_process = pre_process, post_process
        self.num_layers = layers
        self.linears = nn.ModuleList(Linear(hidden, hidden) for _ in range(layers))
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for linear in self.linears:
                linear.weight.copy_(torch.randn(hidden, hidden, generator=g) * hidden**-0.5)
                linear.bias.zero_()
                linear.weight.emulated_weight_seconds = costs.weight_s / layers
        self.anchor = nn.Parameter(torch.zeros(()))
        self.input_tensor: torch.Tensor | None = None
        self._backward_deadlines = _Deadlines(layers)

    @property
    def linear(self) -> Linear:
        """The first layer."""
        return self.linears[0]

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """Input activations of a non-first stage."""
        self.input_tensor = tensor

    def _backward_seconds(self) -> float:
        deferred = self.linear.weight_grad_store is not None
        return self.costs.input_grad_s if deferred else self.costs.backward_s

    def forward(self, batch: torch.Tensor | None) -> torch.Tensor:
        """The tiny layers (loss per token at the last stage), done when the forward time is."""
        deadline = time.perf_counter() + self.costs.forward_s
        hidden = batch if self.pre_process else self.input_tensor
        for linear in self.linears:
            hidden = _SleepInBackward.apply(hidden, self.anchor, self._backward_seconds,
                                            self._backward_deadlines)
            hidden = linear(hidden)
        if self.post_process:
            hidden = hidden.pow(2).mean(dim=-1).t()
        sleep_until(deadline)
        return _BackwardBegins.apply(hidden, self._backward_deadlines, self._backward_seconds)


class _DelayedWork:
    """A collective's work that also waits until the emulated link has carried its bytes."""

    def __init__(self, work: dist.Work, done_at: float) -> None:
        self.work, self.done_at = work, done_at

    def wait(self) -> bool:
        """Wait for the real collective, then for the emulated transfer."""
        self.work.wait()
        sleep_until(self.done_at)
        return True

    def is_completed(self) -> bool:
        """Both the collective and the emulated transfer are done."""
        return self.work.is_completed() and time.perf_counter() >= self.done_at


class EmulatedCollectives(Collectives):
    """Real collectives that complete as if each rank's buckets crossed one link of
    ``seconds_per_element``: a bucket starts when issued or when the previous one is through,
    whichever is later (so reductions overlap compute, which sleeps, but not each other)."""

    def __init__(self, seconds_per_element: float) -> None:
        if seconds_per_element < 0:
            raise ValueError("the emulated reduction time must be >= 0")
        self.seconds_per_element = seconds_per_element
        self._link_free_at = 0.0

    def _delayed(self, work: dist.Work, elements: int) -> _DelayedWork:
        start = max(time.perf_counter(), self._link_free_at)
        self._link_free_at = start + elements * self.seconds_per_element
        return _DelayedWork(work, self._link_free_at)

    def all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> _DelayedWork:
        """All-reduce taking the emulated time of ``tensor``'s elements."""
        return self._delayed(super().all_reduce(tensor, group), tensor.numel())

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor,
                       group: dist.ProcessGroup) -> _DelayedWork:
        """Reduce-scatter taking the emulated time of ``tensor``'s elements."""
        return self._delayed(super().reduce_scatter(output, tensor, group), tensor.numel())


def emulated_forward_step(batch: torch.Tensor | None, model: EmulatedStage):
    """``forward_step_func`` for :class:`EmulatedStage` (loss = mean of the last stage's output)."""
    output = model(batch)

    def loss_func(per_token: torch.Tensor):
        loss = per_token.mean()
        return loss, {"loss": loss.detach()}

    return output, loss_func


class EmulatedTorchStage(nn.Module):
    """The same emulated stage for ``torch.distributed.pipelining`` (``[b, s, h]`` in and out)."""

    def __init__(self, costs: EmulatedCosts, is_first: bool, hidden: int = 4) -> None:
        super().__init__()
        self.costs = costs
        self.weight = nn.Parameter(torch.randn(hidden, hidden) * hidden**-0.5)
        self.anchor = nn.Parameter(torch.zeros(())) if is_first else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Input-gradient and weight-gradient sleeps on separate branches, done when the forward
        time is."""
        deadline = time.perf_counter() + self.costs.forward_s
        h = _SleepInBackward.apply(x, self.anchor, lambda: self.costs.input_grad_s)
        w = _SleepInBackward.apply(self.weight, None, lambda: self.costs.weight_s)
        out = h + w.sum() * 0.0
        sleep_until(deadline)
        return out


def emulated_stage_costs(costs: EmulatedCosts, num_stages: int, num_ranks: int,
                         end_factor: float = 1.0, split: bool = True) -> list[EmulatedCosts]:
    """Per-stage emulated times of a schedule with ``num_stages`` stages on ``num_ranks`` ranks:
    each stage ``num_ranks / num_stages`` of ``costs``, plus (end_factor - 1) x ``costs`` on the
    first and the last stage (embedding, LM head); no W time when the backward is not split."""
    base = costs.scaled(num_ranks / num_stages)
    extra = costs.scaled(end_factor - 1)
    out = []
    for stage in range(num_stages):
        c = base
        if stage in (0, num_stages - 1):
            c = EmulatedCosts(c.forward_s + extra.forward_s, c.backward_s + extra.backward_s,
                              c.weight_s + extra.weight_s)
        out.append(c if split else EmulatedCosts(c.forward_s, c.backward_s, 0.0))
    return out
