"""What data parallelism builds for a rank's stage modules: the gradient buffers, the
synchronizer that reduces them over each stage-replica group, and the optimizer (local, or
distributed over those groups), with the global grad norm counting every parameter once."""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
from torch import nn

from megatron_chimera import parallel_state
from megatron_chimera.config import DDPConfig, OptimizerConfig
from megatron_chimera.distributed.grad_buffer import (
    TIED,
    build_grad_buffers,
    shared_embedding_weight,
)
from megatron_chimera.distributed.grad_sync import GradientSynchronizer
from megatron_chimera.optimizer import MegatronOptimizer, ShardGroup, get_megatron_optimizer
from megatron_chimera.optimizer.builder import InnerFactory
from megatron_chimera.tensor_parallel import param_is_not_tensor_parallel_duplicate


def _norm_filter(stage_modules: dict[int, nn.Module]) -> Callable[[nn.Parameter], bool]:
    """Count each stage once in the global grad norm: on its owner, tied copy with stage 0, and a
    parameter replicated over the tensor-parallel ranks on tensor rank 0 only."""
    counted: set[int] = set()
    for stage, module in stage_modules.items():
        if not parallel_state.is_stage_owner(stage):
            continue
        shared = shared_embedding_weight(module)
        for param in module.parameters():
            if param is shared and stage != 0:
                continue
            if param_is_not_tensor_parallel_duplicate(param):
                counted.add(id(param))
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
    embedding = parallel_state.get_embedding_ranks()
    if rank in embedding:
        ends = (0, parallel_state.get_num_stages() - 1)
        writers = sorted({min(parallel_state.get_stage_replica_ranks(s)) for s in ends})
        shards[TIED] = ShardGroup(parallel_state.get_embedding_group(), len(embedding),
                                  embedding.index(rank), tuple(writers))
    return shards


def build_data_parallel(optimizer_config: OptimizerConfig, ddp: DDPConfig,
                        modules: dict[int, nn.Module], make_inner: InnerFactory | None = None
                        ) -> tuple[GradientSynchronizer, MegatronOptimizer]:
    """Gradient buffers, their synchronizer and the optimizer of this rank's stage modules.

    The local optimizer reduces norm and found-inf over the model-replica group (each stage
    counted on its owner); the distributed one is sharded over each stage-replica group (the
    tied embedding over the embedding group) and reduces them over the world. Either way a
    parameter replicated over the tensor-parallel ranks counts on tensor rank 0 only. Buckets
    are sized for each stage-replica group; the synchronizer also sums sequence-parallel
    gradients over the tensor-parallel group. ``make_inner`` overrides the inner optimizer
    (tests).
    """
    sharded = ddp.use_distributed_optimizer
    shards = _shard_groups(modules) if sharded else None
    group_sizes = {s: len(parallel_state.get_stage_replica_ranks(s)) for s in modules}
    buffers = build_grad_buffers(
        modules, ddp.grad_reduce_in_fp32,
        bucket_sizes={s: ddp.bucket_elements(n) for s, n in group_sizes.items()},
        shard_counts={k: g.size for k, g in shards.items()} if shards else None,
        param_buffers=sharded)
    grad_sync = GradientSynchronizer.from_parallel_state(buffers, ddp.overlap_grad_reduce,
                                                         scatter=sharded)
    chunks = [modules[s] for s in sorted(modules)]
    if not sharded:
        replica_group = parallel_state.get_model_replica_group()
        return grad_sync, get_megatron_optimizer(
            optimizer_config, chunks, grad_norm_group=replica_group,
            found_inf_group=replica_group, norm_param_filter=_norm_filter(modules),
            grad_buffers=buffers, make_inner=make_inner)
    optimizer = get_megatron_optimizer(
        optimizer_config, chunks, grad_buffers=buffers, shards=shards,
        world_group=dist.group.WORLD, overlap_param_gather=ddp.overlap_param_gather,
        make_inner=make_inner)
    optimizer.register_param_gather_hooks(modules)
    return grad_sync, optimizer
