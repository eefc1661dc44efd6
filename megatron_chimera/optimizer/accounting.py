"""Bytes a rank holds for training state, counted from the tensors themselves.

Builds the gradient buffers and the optimizer (local or distributed) over a rank's stage modules,
takes one step so the optimizer creates its moments, and adds up the tensors: parameters (every
local copy), gradient buffers (padding included) and optimizer state (fp32 main parameters that
are separate copies, plus per-element moments). Works on meta tensors, so billion-parameter
stages cost no memory; the memory model (:mod:`megatron_chimera.tuning.rank_memory`) is checked
against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megatron_chimera.config import OptimizerConfig
from megatron_chimera.distributed.grad_buffer import ShardGroup, build_grad_buffers
from megatron_chimera.optimizer.builder import get_megatron_optimizer
from megatron_chimera.optimizer.param_state import is_elementwise


@dataclass(frozen=True)
class StateBytes:
    """Training-state bytes of one rank."""

    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def measure_state_bytes(stage_modules: dict[int, nn.Module], optimizer: OptimizerConfig,
                        grad_reduce_in_fp32: bool,
                        shard_counts: dict[int | str, int] | None = None) -> StateBytes:
    """Bytes of ``stage_modules`` (this rank's stages, fp32 or bf16) after one optimizer step;
    with ``shard_counts`` (stage -> stage-replica group size, ``TIED`` -> embedding group size)
    under the distributed optimizer, as shard rank 0 of every group holds them. Parameters
    sharing one storage (the local copies of the tied embedding) count once. Leaves the
    modules' hooks removed."""
    if optimizer.fp16:
        raise ValueError("state accounting takes fp32 or bf16 models (fp16 has the bytes of bf16)")
    buffers = build_grad_buffers(stage_modules, grad_reduce_in_fp32, shard_counts=shard_counts,
                                 param_buffers=bool(shard_counts))
    shards = None
    if shard_counts:
        shards = {unit: ShardGroup(None, count, 0) for unit, count in shard_counts.items()}
    try:
        config = OptimizerConfig(**{**optimizer.__dict__, "clip_grad": 0.0})
        opt = get_megatron_optimizer(config, [stage_modules[s] for s in sorted(stage_modules)],
                                     grad_buffers=buffers, shards=shards)
        opt.zero_grad()
        opt.step()
        model_params = {id(p): p for m in stage_modules.values() for p in m.parameters()}
        model_dtype = next(iter(model_params.values())).dtype
        state = 0
        for main in opt.main_params:
            if main.dtype != model_dtype:  # a separate fp32 copy (else the model's own storage)
                state += _nbytes(main)
            state += sum(_nbytes(v) for v in opt.optimizer.state.get(main, {}).values()
                         if is_elementwise(v, main.numel()))
        grads = sum(_nbytes(b.grad_data) for b in buffers.all_buffers())
        shared = {id(c) for c in buffers.tied_copies[1:]}  # the first copy's storage
        params = sum(_nbytes(p) for p in model_params.values() if id(p) not in shared)
        return StateBytes(params, grads, state)
    finally:
        buffers.remove_hooks()

