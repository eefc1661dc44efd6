"""Global gradient-norm clipping and zero counting over a process group.

The norm is taken on the *synchronised* gradients, each parameter counted once in the whole model
(the caller chooses which local parameters count: one replica per stage, one copy of the tied
embedding); the local sum of squares is all-reduced over ``group``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_chimera.model.fused import FusedBackend
from megatron_chimera.optimizer.kernels import multi_tensor_l2norm


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp, group) -> torch.Tensor:
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def get_grad_norm(grads_for_norm: list[torch.Tensor], group=None,
                  backend: FusedBackend | None = None,
                  device: torch.device | None = None) -> float:
    """L2 norm of all gradients on all ranks of ``group`` (None: this rank only). ``device``
    holds the reduction when this rank contributes no gradient (default: the grads' device)."""
    backend = backend or FusedBackend(apex=False)
    if grads_for_norm:
        device = grads_for_norm[0].device
        sum_sq = multi_tensor_l2norm(grads_for_norm, backend).to(device).float() ** 2
    else:
        sum_sq = torch.zeros((), dtype=torch.float32, device=device)
    sum_sq = sum_sq.reshape(1)
    return math.sqrt(_all_reduce(sum_sq, dist.ReduceOp.SUM, group).item())


def clip_grads_(grads_to_clip: list[torch.Tensor], total_norm: float, max_norm: float) -> None:
    """Scale ``grads_to_clip`` by ``max_norm / (total_norm + 1e-6)`` when that is below 1."""
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads_to_clip:
        torch._foreach_mul_(grads_to_clip, clip_coeff)


def count_zeros(grads_for_norm: list[torch.Tensor], group=None,
                device: torch.device | None = None) -> int:
    """Number of exactly-zero gradient entries over ``group`` (Megatron's num-zeros log)."""
    device = grads_for_norm[0].device if grads_for_norm else device
    total = torch.zeros(1, dtype=torch.float64, device=device)
    for grad in grads_for_norm:
        total += grad.numel() - torch.count_nonzero(grad)
    return int(_all_reduce(total, dist.ReduceOp.SUM, group).item())
