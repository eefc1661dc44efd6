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
import torch.distributed as dist
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


AUX_LOSS_LOG_NAMES = ("load_balancing_loss", "seq_load_balancing_loss", "z_loss")


class AuxLossLog:
    """Per-name running (sum, count) of one layer's logged auxiliary losses (detached)."""

    def __init__(self) -> None:
        self.values: dict[str, tuple[torch.Tensor, int]] = {}

    def record(self, name: str, value: torch.Tensor) -> None:
        """Add one forward's value of ``name`` (one of :data:`AUX_LOSS_LOG_NAMES`)."""
        total, count = self.values.get(name, (None, 0))
        value = value.detach().float()
        self.values[name] = (value if total is None else total + value, count + 1)

    def pop_sums(self) -> dict[str, tuple[torch.Tensor, int]]:
        """(sum, count) of each name since the last pop, and forget them."""
        sums = dict(self.values)
        self.values.clear()
        return sums

    def pop(self) -> dict[str, torch.Tensor]:
        """The mean of each name since the last pop, and forget them."""
        return {name: total / count for name, (total, count) in self.pop_sums().items()}


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


def reduce_aux_losses(modules: Iterable[nn.Module], num_layers: int,
                      group: dist.ProcessGroup | None = None,
                      device: torch.device | None = None) -> dict[str, dict[int, float]]:
    """``{name: {layer_number: mean}}`` over every forward of every rank of ``group`` (the
    world by default) since the last call: one all-reduce of (sum, count) per name and layer, so
    a layer's mean is over all its micro-batches whatever the pipeline layout (replicas holding
    a layer, tensor-parallel duplicates, recomputed forwards all weigh alike). Every rank of the
    group calls it."""
    names = AUX_LOSS_LOG_NAMES
    table = torch.zeros(len(names), num_layers, 2, dtype=torch.float64, device=device)
    for router in moe_routers(modules):
        for name, (total, count) in router.aux_log.pop_sums().items():
            table[names.index(name), router.layer_number - 1] += torch.stack(
                [total.to(table), torch.tensor(float(count), dtype=table.dtype,
                                               device=table.device)])
    if dist.is_initialized():
        dist.all_reduce(table, group=group)
    return {name: {layer + 1: float(table[i, layer, 0] / table[i, layer, 1])
                   for layer in range(num_layers) if table[i, layer, 1] > 0}
            for i, name in enumerate(names) if bool((table[i, :, 1] > 0).any())}


def aux_loss_figures(per_layer: dict[str, dict[int, float]], per_layer_logging: bool
                     ) -> dict[str, float]:
    """The logged figures (Megatron's): each auxiliary loss averaged over the MoE layers, and
    with ``--moe-per-layer-logging`` each layer's as ``<name> layer <n>``."""
    figures: dict[str, float] = {}
    for name, layers in per_layer.items():
        figures[name] = sum(layers.values()) / len(layers)
        if per_layer_logging:
            figures.update({f"{name} layer {n}": v for n, v in sorted(layers.items())})
    return figures
