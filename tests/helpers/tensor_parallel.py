"""Full (unsharded) tensors of tensor-parallel parameters, for tests that compare a sharded run
with a single-process reference."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megatron_chimera import parallel_state
from megatron_chimera.tensor_parallel.utils import is_tensor_parallel, join_shards


def full_tensor(param: nn.Parameter, value: torch.Tensor | None = None) -> torch.Tensor:
    """``value`` (default: ``param`` itself) joined over the tensor-parallel group along the
    parameter's ``partition_dim`` (strided shards interleaved back) and cut to its master size;
    replicated tensors as they are. A collective of the tensor-parallel group."""
    value = (param if value is None else value).detach()
    if not is_tensor_parallel(param) or parallel_state.get_tensor_model_parallel_world_size() == 1:
        return value.clone()
    world = parallel_state.get_tensor_model_parallel_world_size()
    parts = [torch.empty_like(value) for _ in range(world)]
    dist.all_gather(parts, value.contiguous(),
                    group=parallel_state.get_tensor_model_parallel_group())
    return join_shards(param, parts).clone()


def full_state(module: nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (or its gradient, zeros when None) of ``module`` as full tensors."""
    out = {}
    for name, param in module.named_parameters():
        value = param
        if grads:
            value = param.grad if param.grad is not None else torch.zeros_like(param)
        out[name] = full_tensor(param, value)
    return out
