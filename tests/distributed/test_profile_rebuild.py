"""Profiling on 4 gloo ranks with emulated stages of known F/B/W times, then the rebuild.

Each stage sleeps its own F, B and W (heavier end stages, B != W), so the profiler must measure
them per stage; every rank must agree on the same costs and build the same, valid schedule, which
then runs: lowered again (SEND / RECV placed for the new order, ``validate_lowered`` on every
rank) by new executors on the running transport, under NCCL's point-to-point rules (the
harness's default mode), training and evaluation.
"""

from __future__ import annotations

import hashlib
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from .harness import spawn_world

pytestmark = pytest.mark.distributed

# per stage: forward, input-gradient B, weight-gradient W (seconds); the order built for 1:1:1
# takes 381 ms under these costs, the one built for them 364 ms (simulated)
F = (0.012, 0.010, 0.010, 0.014)
B = (0.024, 0.020, 0.020, 0.028)
W = (0.006, 0.005, 0.005, 0.007)


def _profile_and_rebuild(rank: int, world_size: int) -> None:
    from megatron_chimera import parallel_state
    from megatron_chimera.distributed.grad_buffer import build_grad_buffers
    from megatron_chimera.distributed.grad_sync import GradientSynchronizer
    from megatron_chimera.pipeline.emulated import (
        EmulatedCosts,
        EmulatedStage,
        SleepingWeightGradStore,
        emulated_forward_step,
    )
    from megatron_chimera.pipeline.executor import Gradients, PipelineExecutor, StageWork
    from megatron_chimera.pipeline.profiling import ProfileRebuild
    from megatron_chimera.pipeline.topology import PipelineTopology
    from megatron_chimera.schedules import build_schedule
    from megatron_chimera.schedules.lowering import connection_order, lower
    from megatron_chimera.schedules.registry import ChimeraZBOptions
    from megatron_chimera.schedules.validate import validate, validate_lowered

    schedule = build_schedule("chimera-zb", 4, 8)
    parallel_state.initialize_model_parallel(4, schedule.placement, 4,
                                             timeout=timedelta(minutes=1))
    stages = {s: EmulatedStage(EmulatedCosts(F[s], B[s] + W[s], W[s]), s == 0, s == 3, 4, s)
              for s in schedule.stages_of_rank(rank)}
    grad_sync = GradientSynchronizer.from_parallel_state(build_grad_buffers(stages, True))

    def executor_for(sched, transport=None, train=True):
        return PipelineExecutor(
            sched, PipelineTopology.from_parallel_state(),
            StageWork(stages, emulated_forward_step, (8, 2, 4), torch.float32),
            Gradients(loss_scale_divisor=8, grad_sync=grad_sync if train else None,
                      weight_grad_store_factory=SleepingWeightGradStore),
            transport=transport)

    executor = executor_for(schedule)
    profile = ProfileRebuild(schedule, ChimeraZBOptions(), iterations=2)
    batch = [torch.randn(8, 2, 4)] * 8
    report = None
    for iteration in range(3):
        profile.start_iteration(executor)
        executor.run(batch)
        got = profile.finish_iteration(executor)
        if got is not None:
            assert iteration == 1 and report is None
            report = got
    assert report is not None and executor.action_timer is None and not profile.active
    # the first iteration was a warm-up: one recorded iteration's worth of samples per replica
    assert len(profile.recorder.samples[("F", schedule.stages_of_rank(rank)[0])]) == 4
    costs = report.costs
    ratios = []
    for measured, slept in ((costs.forward, F), (costs.backward, B), (costs.weight, W)):
        for stage in range(4):  # sleeping at least the time; overheads and load on top
            assert measured[stage] >= slept[stage], (measured, slept)
            ratios.append(measured[stage] / slept[stage])
    # the action's own time, not the wait for its input (that would be a multiple of it): on a
    # loaded machine a rank can be descheduled mid-sleep, so one entry may be off, not most
    assert sorted(ratios)[len(ratios) // 2] <= 1.5, (costs.to_dict(), ratios)
    validate(report.schedule)
    assert report.changed and report.predicted_gain > 0.02, report.line()
    digest = hashlib.sha256(report.schedule.to_json().encode()).hexdigest()
    views: list = [None] * world_size
    dist.all_gather_object(views, (costs.to_dict(), digest))
    assert all(view == views[0] for view in views), views
    for forward_only in (False, True):  # the new order's communication keeps NCCL's rules
        validate_lowered(lower(report.schedule, forward_only))
    old = set(connection_order(*executor.lowered.values()))
    assert executor.transport.connected == old
    rebuilt = executor_for(report.schedule, executor.transport)  # as training switches
    assert set(connection_order(*rebuilt.lowered.values())) <= old  # same placement
    rebuilt.run(batch)  # the rebuilt order runs (NCCL semantics: the harness's default)
    executor_for(report.schedule, executor.transport, train=False).run(batch, forward_only=True)
    assert executor.transport.connected == old  # nothing reconnected
    parallel_state.destroy_model_parallel()


@pytest.mark.timeout(150)
def test_profiled_costs_are_measured_per_stage_agreed_and_rebuilt_identically():
    spawn_world(_profile_and_rebuild, 4, timeout_s=140)
