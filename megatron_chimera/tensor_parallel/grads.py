"""Gradients that need a tensor-parallel reduction besides the data-parallel one.

Under sequence parallelism the LayerNorm weights and biases (and row-parallel biases, BERT's LM
head transform) see only this rank's sequence chunk, so each rank's gradient is partial: they
carry ``sequence_parallel = True`` and their gradients are summed over the tensor-parallel group
once per iteration (Megatron's ``_allreduce_layernorm_grads``). The runtime does it in one place:
:class:`~megatron_chimera.distributed.grad_sync.GradientSynchronizer` sums a bucket's
sequence-parallel gradients (``main_grad``, their views of the gradient buffer) over the
tensor-parallel group right before it starts the bucket's data-parallel reduction, so the
all-reduce or reduce-scatter over the stage-replica group carries the full gradient, with or
without ``--overlap-grad-reduce`` and the distributed optimizer.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn


def is_sequence_parallel(param: nn.Parameter) -> bool:
    """Whether ``param``'s gradient is partial per tensor-parallel rank (sequence parallelism)."""
    return bool(param.requires_grad and getattr(param, "sequence_parallel", False))


def sequence_parallel_params(modules: Iterable[nn.Module]) -> list[nn.Parameter]:
    """Distinct trainable parameters marked ``sequence_parallel`` in ``modules``, in order."""
    found: list[nn.Parameter] = []
    seen: set[int] = set()
    for module in modules:
        for param in module.parameters():
            if is_sequence_parallel(param) and id(param) not in seen:
                seen.add(id(param))
                found.append(param)
    return found


def _gradient(param: nn.Parameter) -> torch.Tensor:
    """Where ``param``'s gradient accumulates: its gradient-buffer view (``main_grad``), or
    ``.grad`` for a model without buffers (zeros when it received none)."""
    main_grad = getattr(param, "main_grad", None)
    if main_grad is not None:
        return main_grad
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return param.grad


def allreduce_sequence_parallel_grads(params: list[nn.Parameter],
                                      group: dist.ProcessGroup | None) -> None:
    """Sum the gradients of ``params`` (``main_grad``, else ``.grad``) in place over ``group``,
    in one flat all-reduce per dtype."""
    if not params or group is None or dist.get_world_size(group) == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for param in params:
        grad = _gradient(param)
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for bucket in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        offset = 0
        for grad in bucket:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()
