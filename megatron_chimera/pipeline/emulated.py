"""Emulated-compute stage modules: pipeline stages that *wait* instead of computing.

A forward sleeps ``forward_s`` around tiny real tensor work, a backward sleeps ``backward_s``. With
split backward, B sleeps the input-gradient time ``backward_s - weight_s`` and W sleeps
``weight_s``. Sleeping ranks do not compete for cores, so 8 ranks on 2 cores behave like 8
devices and the measured iteration time exposes the schedule plus the runtime's overheads.

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


class _SleepInBackward(torch.autograd.Function):
    """Identity whose backward sleeps ``seconds()``; ``anchor`` keeps it in the graph at stage 0."""

    @staticmethod
    def forward(ctx, x, anchor, seconds: Callable[[], float]):  # type: ignore[override]
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        time.sleep(ctx.seconds())
        return grad.contiguous(), None, None


class SleepingWeightGradStore(WeightGradStore):
    """WeightGradStore whose flush (the W action) also sleeps each queued layer's W time."""

    def __init__(self) -> None:
        super().__init__()
        self._sleep_s = 0.0

    def put(self, weight, bias, inputs, grad_output) -> None:  # noqa: D102 - see base class
        self._sleep_s += getattr(weight, "emulated_weight_seconds", 0.0)
        super().put(weight, bias, inputs, grad_output)

    def flush(self) -> None:
        """Sleep the queued weight-gradient time, then compute the (tiny) real gradients."""
        time.sleep(self._sleep_s)
        self._sleep_s = 0.0
        super().flush()


class EmulatedStage(nn.Module):
    """A pipeline stage for our executor: ``[s, b, h] -> [s, b, h]`` (the loss ``[b, s]`` last).

    ``layers`` tiny linear layers share the stage's times; in backward each layer's parameters
    receive their gradients after its share of the sleep, so gradient buckets of a layer become
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

    @property
    def linear(self) -> Linear:
        """The first layer."""
        return self.linears[0]

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """Input activations of a non-first stage."""
        self.input_tensor = tensor

    def _backward_seconds(self) -> float:
        deferred = self.linear.weight_grad_store is not None
        total = self.costs.input_grad_s if deferred else self.costs.backward_s
        return total / self.num_layers

    def forward(self, batch: torch.Tensor | None) -> torch.Tensor:
        """Sleep the forward time, then the tiny layers (loss per token at the last stage)."""
        hidden = batch if self.pre_process else self.input_tensor
        time.sleep(self.costs.forward_s)
        for linear in self.linears:
            hidden = _SleepInBackward.apply(hidden, self.anchor, self._backward_seconds)
            hidden = linear(hidden)
        return hidden.pow(2).mean(dim=-1).t() if self.post_process else hidden


class _DelayedWork:
    """A collective's work that also waits until the emulated link has carried its bytes."""

    def __init__(self, work: dist.Work, done_at: float) -> None:
        self.work, self.done_at = work, done_at

    def wait(self) -> bool:
        """Wait for the real collective, then for the emulated transfer."""
        self.work.wait()
        delay = self.done_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
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
        """Sleep the forward; input-gradient and weight-gradient sleeps on separate branches."""
        time.sleep(self.costs.forward_s)
        h = _SleepInBackward.apply(x, self.anchor, lambda: self.costs.input_grad_s)
        w = _SleepInBackward.apply(self.weight, None, lambda: self.costs.weight_s)
        return h + w.sum() * 0.0
