"""Gradients that need a tensor-parallel reduction besides the data-parallel one.

Under sequence parallelism the LayerNorm weights and biases (and row-parallel biases, BERT's LM
head transform) see only this rank's sequence chunk, so each rank's gradient is partial: they
carry ``sequence_parallel = True`` and their gradients are summed over the tensor-parallel group
once per iteration, after the stage-replica reduction (Megatron's
``allreduce_sequence_parallel_grads``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn


def sequence_parallel_params(modules: Iterable[nn.Module]) -> list[nn.Parameter]:
    """Distinct trainable parameters marked ``sequence_parallel`` in ``modules``, in order."""
    found: list[nn.Parameter] = []
    seen: set[int] = set()
    for module in modules:
        for param in module.parameters():
            if param.requires_grad and getattr(param, "sequence_parallel", False) \
                    and id(param) not in seen:
                seen.add(id(param))
                found.append(param)
    return found


def allreduce_sequence_parallel_grads(grads: list[torch.Tensor],
                                      group: dist.ProcessGroup | None) -> None:
    """Sum ``grads`` (in place) over ``group`` in one flat all-reduce per dtype."""
    if not grads or group is None or dist.get_world_size(group) == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for bucket in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        offset = 0
        for grad in bucket:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()
