"""Emulated-compute stage modules: pipeline stages that *wait* instead of computing.

A forward sleeps ``forward_s`` around tiny real tensor work, a backward sleeps ``backward_s``. With
split backward, B sleeps the input-gradient time ``backward_s - weight_s`` and W sleeps
``weight_s``. Sleeping ranks do not compete for cores, so 8 ranks on 2 cores behave like 8
devices and the measured iteration time exposes the schedule plus the runtime's overheads.

* :class:`EmulatedStage` runs in our executor: its one :class:`Linear` takes the weight-gradient
  time through :class:`SleepingWeightGradStore` (pass it as the executor's
  ``weight_grad_store_factory``).
* :class:`EmulatedTorchStage` runs in ``torch.distributed.pipelining``: the input-gradient and
  weight-gradient sleeps sit on separate autograd branches, so torch's split backward (which
  differentiates w.r.t. inputs and weights separately) takes each time once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from megatron_chimera.model.linear import Linear, WeightGradStore


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
    """A pipeline stage for our executor: ``[s, b, h] -> [s, b, h]`` (the loss ``[b, s]`` last)."""

    def __init__(self, costs: EmulatedCosts, pre_process: bool, post_process: bool,
                 hidden: int = 4, seed: int = 0) -> None:
        super().__init__()
        self.costs = costs
        self.pre_process, self.post_process = pre_process, post_process
        self.linear = Linear(hidden, hidden)
        with torch.no_grad():
            g = torch.Generator().manual_seed(seed)
            self.linear.weight.copy_(torch.randn(hidden, hidden, generator=g) * hidden**-0.5)
            self.linear.bias.zero_()
        self.linear.weight.emulated_weight_seconds = costs.weight_s
        self.anchor = nn.Parameter(torch.zeros(()))
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """Input activations of a non-first stage."""
        self.input_tensor = tensor

    def _backward_seconds(self) -> float:
        deferred = self.linear.weight_grad_store is not None
        return self.costs.input_grad_s if deferred else self.costs.backward_s

    def forward(self, batch: torch.Tensor | None) -> torch.Tensor:
        """Sleep the forward time, then one tiny linear layer (loss per token at the last stage)."""
        hidden = batch if self.pre_process else self.input_tensor
        time.sleep(self.costs.forward_s)
        hidden = _SleepInBackward.apply(hidden, self.anchor, self._backward_seconds)
        out = self.linear(hidden)
        return out.pow(2).mean(dim=-1).t() if self.post_process else out


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
