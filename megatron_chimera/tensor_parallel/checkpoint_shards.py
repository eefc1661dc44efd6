"""Checkpoints hold full tensors whatever T: shards are joined on save and split on load.

A checkpoint written with T = 2 resumes with T = 1 (and the reverse) because a stage file stores,
for every tensor-parallel parameter (and its per-parameter optimizer state of the same shape), the
layout-independent master tensor (:func:`.utils.master_shape`): the T shards concatenated along
``partition_dim`` and cut to ``master_size`` -- which drops the rows Megatron's T-dependent
vocabulary padding adds (zero, never used). Loading zero-pads to this run's T shards and keeps
this rank's.

Joining is a collective over the tensor-parallel group (one gather per dtype, to tensor rank 0,
which writes); with T = 1 both directions are the identity.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron_chimera import parallel_state
from megatron_chimera.tensor_parallel.utils import (
    is_tensor_parallel,
    join_shards,
    master_shape,
    shard_of_master,
)

ModelState = dict[str, torch.Tensor]
OptimizerState = dict[str, dict[str, Any]]


def _sharded(tensor: Any, param: nn.Parameter, shape: tuple[int, ...]) -> bool:
    return torch.is_tensor(tensor) and tuple(tensor.shape) == shape and is_tensor_parallel(param)


def _shards_to_join(model: ModelState, optimizer: OptimizerState | None,
                    params: dict[str, nn.Parameter]) -> list[tuple[str, str | None]]:
    """(name, optimizer key or None) of every local shard to join, in one order on every rank."""
    keys: list[tuple[str, str | None]] = []
    for name in sorted(params):
        param = params[name]
        if name in model and _sharded(model[name], param, tuple(param.shape)):
            keys.append((name, None))
        for key in sorted((optimizer or {}).get(name, {})):
            if _sharded(optimizer[name][key], param, tuple(param.shape)):
                keys.append((name, key))
    return keys


def _gather(tensors: list[torch.Tensor], group: dist.ProcessGroup, dst: int,
            world: int) -> list[list[torch.Tensor]] | None:
    """Per tensor, the T shards (by tensor rank) on ``dst``; one gather per dtype."""
    out: list[list[torch.Tensor]] = [[] for _ in tensors]
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, tensor in enumerate(tensors):
        by_dtype.setdefault(tensor.dtype, []).append(i)
    me = dist.get_rank()
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend(group) == "nccl" else torch.device("cpu"))
    for indices in by_dtype.values():
        flat = torch.cat([tensors[i].detach().reshape(-1) for i in indices]).to(device)
        parts = [torch.empty_like(flat) for _ in range(world)] if me == dst else None
        dist.gather(flat, parts, dst=dst, group=group)
        if parts is None:
            continue
        parts = [p.cpu() for p in parts]
        offset = 0
        for i in indices:
            n = tensors[i].numel()
            out[i] = [p[offset:offset + n].view_as(tensors[i]) for p in parts]
            offset += n
    return out if me == dst else None


def join_tensor_parallel_state(model: ModelState, optimizer: OptimizerState | None,
                               params: dict[str, nn.Parameter]
                               ) -> tuple[ModelState, OptimizerState | None] | None:
    """The full tensors of this stage's ``model`` state and per-parameter ``optimizer`` state
    (both keyed by the names of ``params``) on tensor rank 0, None on the others. Every rank of
    the tensor-parallel group must call it with the same names."""
    world = parallel_state.get_tensor_model_parallel_world_size()
    if world == 1:
        return model, optimizer
    keys = _shards_to_join(model, optimizer, params)
    local = [model[n] if k is None else optimizer[n][k] for n, k in keys]
    gathered = _gather(local, parallel_state.get_tensor_model_parallel_group(),
                       parallel_state.get_tensor_model_parallel_src_rank(), world)
    if gathered is None:
        return None
    model = dict(model)
    optimizer = {n: dict(entry) for n, entry in optimizer.items()} if optimizer else optimizer
    for (name, key), shards in zip(keys, gathered):
        param = params[name]
        full = join_shards(param, shards).clone()
        if key is None:
            model[name] = full
        else:
            optimizer[name][key] = full
    return model, optimizer


def split_tensor_parallel_state(model: ModelState, optimizer: OptimizerState | None,
                                params: dict[str, nn.Parameter]
                                ) -> tuple[ModelState, OptimizerState | None]:
    """This rank's shards of full ``model`` / ``optimizer`` tensors (new dicts; tensors of other
    shapes, e.g. Adam's step, are kept)."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return model, optimizer
    model = dict(model)
    optimizer = {n: dict(entry) for n, entry in optimizer.items()} if optimizer else optimizer
    for name, param in params.items():
        shape = master_shape(param)
        if name in model and _sharded(model[name], param, shape):
            model[name] = shard_of_master(param, model[name]).clone()
        for key, value in (optimizer or {}).get(name, {}).items():
            if _sharded(value, param, shape):
                optimizer[name][key] = shard_of_master(param, value).clone()
    return model, optimizer
