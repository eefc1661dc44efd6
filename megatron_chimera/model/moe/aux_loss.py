"""The MoE auxiliary losses: their gradient injected into the backward and their logged values.

An auxiliary loss (load balancing, z-loss) is not added to the language-model loss, which only
the last stage sees; as in Megatron (``MoEAuxLossAutoScaler``) it rides on an activation of its
own layer: :func:`attach_aux_loss` returns the activation unchanged and, in the backward, gives
the loss the gradient ``scale`` -- the factor the training loop applies to the main loss
(1 / (micro-batches x data-parallel replicas), times the fp16 loss scale), set on each router by
:func:`set_aux_loss_scale`. So the auxiliary gradient of a micro-batch is the same on every
pipeline layout.

Logged values (Megatron's names: ``load_balancing_loss``, ``seq_load_balancing_loss``,
``z_loss``; each divided by its coefficient) are kept per layer as a running (sum, count) of the
forwards; a recomputed forward repeats its value, so the mean stays that of the micro-batches.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``output``; the backward gives ``aux_loss`` the gradient ``scale``."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor,  # noqa: D102
                scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_shape = aux_loss.shape
        ctx.aux_dtype = aux_loss.dtype
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):  # noqa: D102
        grad_aux = torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype,
                              device=grad_output.device)
        return grad_output, grad_aux, None


def attach_aux_loss(output: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
    """``output`` unchanged; back-propagating through it also back-propagates ``aux_loss`` with
    gradient ``scale``."""
    return _AttachAuxLoss.apply(output, aux_loss, scale)


class AuxLossLog:
    """Per-name running (sum, count) of one layer's logged auxiliary losses (detached)."""

    def __init__(self) -> None:
        self.values: dict[str, tuple[torch.Tensor, int]] = {}

    def record(self, name: str, value: torch.Tensor) -> None:
        """Add one forward's value of ``name``."""
        total, count = self.values.get(name, (None, 0))
        value = value.detach().float()
        self.values[name] = (value if total is None else total + value, count + 1)

    def pop(self) -> dict[str, torch.Tensor]:
        """The mean of each name since the last pop, and forget them."""
        means = {name: total / count for name, (total, count) in self.values.items()}
        self.values.clear()
        return means


def moe_routers(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """Every MoE router inside ``modules`` (the stage modules of a rank): the modules keeping an
    :class:`AuxLossLog` as ``aux_log``."""
    return [m for module in modules for m in module.modules()
            if isinstance(getattr(m, "aux_log", None), AuxLossLog)]


def set_aux_loss_scale(modules: Iterable[nn.Module], scale: float) -> None:
    """Set the gradient the auxiliary losses of every router in ``modules`` receive (the main
    loss's factor: 1 / (N x W), times the fp16 loss scale)."""
    for router in moe_routers(modules):
        router.aux_loss_scale = float(scale)


def pop_aux_losses(modules: Iterable[nn.Module]) -> dict[str, dict[int, torch.Tensor]]:
    """``{name: {layer_number: mean value}}`` of every router in ``modules`` since the last
    call (local to this rank: the caller averages over data-parallel replicas)."""
    out: dict[str, dict[int, torch.Tensor]] = {}
    for router in moe_routers(modules):
        for name, value in router.aux_log.pop().items():
            out.setdefault(name, {})[router.layer_number] = value
    return out
