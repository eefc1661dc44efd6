"""Per-rank bodies that break NCCL's rules on purpose: the NCCL-semantics mode must catch them."""

from __future__ import annotations

import datetime

import torch

from megatron_chimera import parallel_state
from megatron_chimera.config import DDPConfig
from megatron_chimera.distributed.data_parallel import build_data_parallel
from megatron_chimera.pipeline.executor import (
    ExecutorPolicy,
    Gradients,
    PipelineExecutor,
    StageWork,
)
from megatron_chimera.pipeline.topology import PipelineTopology
from megatron_chimera.schedules import build_schedule

from .toy_model import HIDDEN, MICRO_BATCH, SEQ, build_stage, forward_step, make_batch


def run_unprotected(rank: int, world_size: int, schedule_name: str, num_microbatches: int,
                    warm_up: bool, safe_posting: bool) -> None:
    """Two iterations with the connection warm-up and/or the safe posting rule switched off (in
    NCCL-semantics mode each rank is the syncing one in one of them)."""
    schedule = build_schedule(schedule_name, world_size, num_microbatches)
    parallel_state.initialize_model_parallel(world_size, schedule.placement, schedule.num_stages,
                                             timeout=datetime.timedelta(seconds=60))
    try:
        prank = parallel_state.get_pipeline_model_parallel_rank()
        stages = {s: build_stage(s, schedule.num_stages)
                  for s in schedule.stages_of_rank(prank)}
        executor = PipelineExecutor(
            schedule, PipelineTopology.from_parallel_state(),
            StageWork(stages, forward_step, (SEQ, MICRO_BATCH, HIDDEN), torch.float32),
            Gradients(loss_scale_divisor=num_microbatches,
                      grad_sync=build_data_parallel(DDPConfig(), stages).grad_sync),
            policy=ExecutorPolicy(warm_up=warm_up, safe_posting=safe_posting))
        for step in range(2):
            executor.run([make_batch(step, 0, m) for m in range(num_microbatches)])
    finally:
        parallel_state.destroy_model_parallel()


def run_early_collective(rank: int, world_size: int) -> None:
    """Chimera D=2 whose rank 0 issues its stage reductions as each iteration starts, before
    any gradient is final (a synchronizer out of the validated order): a device sync on rank 0
    then waits for rank 1's reductions, which need rank 0's forwards first. Two iterations, so
    that rank 0 is the syncing rank in one of them."""
    schedule = build_schedule("chimera", world_size, world_size)
    parallel_state.initialize_model_parallel(world_size, schedule.placement, schedule.num_stages,
                                             timeout=datetime.timedelta(seconds=60))
    try:
        prank = parallel_state.get_pipeline_model_parallel_rank()
        stages = {s: build_stage(s, schedule.num_stages) for s in schedule.stages_of_rank(prank)}
        grad_sync = build_data_parallel(DDPConfig(), stages).grad_sync
        if rank == 0:
            start = grad_sync.start_iteration

            def start_and_issue_everything(watcher=None, deferred=frozenset()):
                start(watcher, deferred)
                for item in grad_sync._items:  # noqa: SLF001 (the fault under test)
                    item.ready = True
                grad_sync._issue_ready()  # noqa: SLF001

            grad_sync.start_iteration = start_and_issue_everything
        executor = PipelineExecutor(
            schedule, PipelineTopology.from_parallel_state(),
            StageWork(stages, forward_step, (SEQ, MICRO_BATCH, HIDDEN), torch.float32),
            Gradients(loss_scale_divisor=world_size, grad_sync=grad_sync))
        for step in range(2):
            executor.run([make_batch(step, 0, m) for m in range(world_size)])
    finally:
        parallel_state.destroy_model_parallel()
