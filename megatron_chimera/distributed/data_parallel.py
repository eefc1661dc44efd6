"""What data parallelism builds for a rank's stage modules: the gradient buffers, the
synchronizer that reduces them over each stage-replica group, the distributed optimizer's shard
groups, and which parameters count in the global grad norm (every parameter once).

The optimizer over them is built by :func:`megatron_chimera.optimizer.get_data_parallel_optimizer`
(Megatron-core's split: buffers and their reduction in ``distributed/``, optimizers in
``optimizer/``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from megatron_chimera import parallel_state
from megatron_chimera.config import DDPConfig
from megatron_chimera.distributed.grad_buffer import (
    TIED,
    ModelGradBuffers,
    ShardGroup,
    build_grad_buffers,
    expert_unit,
    grad_dtype_for,
    is_expert,
    shared_embedding_weight,
)
from megatron_chimera.distributed.grad_sync import GradientSynchronizer
from megatron_chimera.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron_chimera.tensor_parallel.weight_grad import fusion_saves_work

logger = logging.getLogger(__name__)

NormFilter = Callable[[nn.Parameter], bool]


@dataclass
class DataParallel:
    """A rank's data-parallel state: its stage ``modules``, their gradient ``buffers`` and
    ``grad_sync``; ``shards`` (the distributed optimizer's groups: each stage over its
    stage-replica group, the tied embedding over the embedding group) or None for the local
    optimizer, which counts each parameter in the norm where ``norm_filter`` says so and reduces
    over ``replica_group``; ``overlap_param_gather`` as ``--overlap-param-gather``."""

    modules: dict[int, nn.Module]
    buffers: ModelGradBuffers
    grad_sync: GradientSynchronizer
    shards: dict[int | str, ShardGroup] | None
    norm_filter: NormFilter | None
    replica_group: dist.ProcessGroup | None
    overlap_param_gather: bool = False


def _norm_filter(stage_modules: dict[int, nn.Module], experts: bool = False) -> NormFilter:
    """Count each stage once in the global grad norm: on its owner, tied copy with stage 0, and a
    parameter replicated over the tensor-parallel ranks on tensor rank 0 only. With expert
    parallelism (``experts``; the norm is then reduced over the world) the dense parameters
    count on data-parallel rank 0 and the experts on expert-data rank 0 (every expert rank
    holds different experts)."""
    counted: set[int] = set()
    if experts:
        dense_here = parallel_state.get_data_parallel_rank() == 0
        experts_here = parallel_state.get_expert_data_parallel_rank() == 0
    for stage, module in stage_modules.items():
        if not parallel_state.is_stage_owner(stage):
            continue
        shared = shared_embedding_weight(module)
        for param in module.parameters():
            if param is shared and stage != 0:
                continue
            if experts and not (experts_here if is_expert(param) else dense_here):
                continue
            if is_expert(param) or param_is_not_tensor_parallel_duplicate(param):
                counted.add(id(param))  # (experts differ on each rank of an expert group)
    return lambda param: id(param) in counted


def _shard_groups(modules: dict[int, nn.Module]) -> dict[int | str, ShardGroup]:
    """The distributed optimizer's shard groups: each local stage over its stage-replica group,
    the tied embedding over the embedding group (its writers: those of the first and last
    stage files, which both keep its entry). With tensor parallelism these groups join the ranks
    of this rank's tensor rank, so each tensor rank's shards are sharded among its equals."""
    rank = dist.get_rank()
    shards: dict[int | str, ShardGroup] = {}
    for stage in modules:
        ranks = parallel_state.get_stage_replica_ranks(stage)
        shards[stage] = ShardGroup(parallel_state.get_stage_replica_group(stage), len(ranks),
                                   ranks.index(rank), (min(ranks),))
        if parallel_state.has_expert_groups():
            ranks = parallel_state.get_expert_stage_replica_ranks(stage)
            shards[expert_unit(stage)] = ShardGroup(
                parallel_state.get_expert_stage_replica_group(stage), len(ranks),
                ranks.index(rank), (min(ranks),))
    embedding = parallel_state.get_embedding_ranks()
    if rank in embedding:
        ends = (0, parallel_state.get_num_stages() - 1)
        writers = sorted({min(parallel_state.get_stage_replica_ranks(s)) for s in ends})
        shards[TIED] = ShardGroup(parallel_state.get_embedding_group(), len(embedding),
                                  embedding.index(rank), tuple(writers))
    return shards


def _fuses_weight_grads(ddp: DDPConfig, modules: dict[int, nn.Module]) -> bool:
    """Gradient-accumulation fusion where it saves a kernel (:func:`fusion_saves_work`); where it
    does not, the buffers' hooks add the gradients (the same sums), said once."""
    if not ddp.gradient_accumulation_fusion:
        return False
    param = next((p for m in modules.values() for p in m.parameters()), None)
    if param is None:
        return False
    grad_dtype = grad_dtype_for(param.dtype, ddp.grad_reduce_in_fp32)
    if fusion_saves_work(param.device, param.dtype, grad_dtype):
        return True
    if dist.is_initialized() and dist.get_rank() == 0:
        logger.info("gradient-accumulation fusion: no fused kernel for %s parameters into %s "
                    "gradients on %s (it is a CUDA kernel; half precision needs Apex's "
                    "fused_weight_gradient_mlp_cuda or torch's addmm(out_dtype=float32)); the "
                    "gradient buffers' hooks add the "
                    "gradients instead (same sums)", param.dtype, grad_dtype, param.device.type)
    return False


def build_data_parallel(ddp: DDPConfig, modules: dict[int, nn.Module]) -> DataParallel:
    """Gradient buffers, their synchronizer and the shard groups of this rank's stage modules.

    Buckets are sized for each stage-replica group; the synchronizer also sums
    sequence-parallel gradients over the tensor-parallel group. With the distributed optimizer
    the buffers are padded for the shard groups and parameters move into parameter buffers.
    """
    sharded = ddp.use_distributed_optimizer
    shards = _shard_groups(modules) if sharded else None
    group_sizes = {s: len(parallel_state.get_stage_replica_ranks(s)) for s in modules}
    experts = parallel_state.has_expert_groups()
    buffers = build_grad_buffers(
        modules, ddp.grad_reduce_in_fp32,
        bucket_sizes={s: ddp.bucket_elements(n) for s, n in group_sizes.items()},
        shard_counts={k: g.size for k, g in shards.items()} if shards else None,
        param_buffers=sharded, fuse_wgrad_accumulation=_fuses_weight_grads(ddp, modules),
        split_experts=experts)
    grad_sync = GradientSynchronizer.from_parallel_state(buffers, ddp.overlap_grad_reduce,
                                                         scatter=sharded)
    if sharded:
        return DataParallel(modules, buffers, grad_sync, shards, None, None,
                            ddp.overlap_param_gather)
    if experts:  # the experts of one replica are spread over the expert-parallel ranks
        return DataParallel(modules, buffers, grad_sync, None, _norm_filter(modules, True),
                            dist.group.WORLD)
    return DataParallel(modules, buffers, grad_sync, None, _norm_filter(modules),
                        parallel_state.get_model_replica_group())
