"""Rank layout and process groups with tensor parallelism (Megatron's order: tensor innermost,
then data-parallel, then pipeline), and the tensor-parallel RNG tracker."""

from __future__ import annotations

import datetime
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_chimera import parallel_state as ps
from megatron_chimera.config import ConfigError
from megatron_chimera.layout import global_rank, rank_coordinates
from megatron_chimera.schedules import build_schedule
from megatron_chimera.tensor_parallel import (
    checkpoint,
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)
from megatron_chimera.tensor_parallel.random import CudaRNGStatesTracker
from tests.distributed.harness import spawn_world

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("T,W,D", [(1, 1, 4), (2, 1, 4), (2, 2, 2), (4, 2, 3), (1, 3, 2)])
def test_rank_arithmetic_puts_tensor_ranks_innermost(T, W, D):
    seen = []
    for p, dp, t in itertools.product(range(D), range(W), range(T)):
        rank = global_rank(p, dp, W, t, T)
        assert rank_coordinates(rank, W, T) == (p, dp, t)
        seen.append(rank)
    assert seen == list(range(T * W * D))  # pipeline outermost, tensor innermost
    if T > 1:  # consecutive ranks are tensor peers, then data-parallel replicas
        assert global_rank(0, 0, W, 1, T) == 1
    if W > 1:
        assert global_rank(0, 1, W, 0, T) == T


def _ranks(group) -> list[int] | None:
    return None if group is None else sorted(dist.get_process_group_ranks(group))


def _expected_groups(rank: int, T: int, W: int, D: int, placement) -> dict[str, list[int]]:
    """The groups of ``rank`` from the coordinates of every rank (brute force)."""
    everyone = {r: rank_coordinates(r, W, T) for r in range(T * W * D)}
    p, dp, t = everyone[rank]
    num_stages = len(placement[0])

    def where(**fixed):
        coordinate = {"p": 0, "dp": 1, "t": 2}
        return sorted(r for r, c in everyone.items()
                      if all(c[coordinate[k]] == v for k, v in fixed.items()))

    expected = {"tensor": where(p=p, dp=dp), "pipeline": where(dp=dp, t=t),
                "data": where(p=p, t=t), "model": where(dp=dp)}
    for stage in range(num_stages):
        holders = {pipe[stage] for pipe in placement}
        if p in holders:
            expected[f"stage {stage}"] = sorted(r for r in where(t=t) if everyone[r][0] in holders)
    ends = {pipe[s] for pipe in placement for s in (0, num_stages - 1)}
    if p in ends:
        expected["embedding"] = sorted(r for r in where(t=t) if everyone[r][0] in ends)
    return expected


def run_groups(rank: int, world_size: int, T: int, D: int, schedule_name: str) -> None:
    W = world_size // (T * D)
    schedule = build_schedule(schedule_name, D, 2 * D)
    timeout = datetime.timedelta(seconds=60)
    for bad in (dict(tensor_model_parallel_size=3), dict(tensor_model_parallel_size=T * 8)):
        try:
            ps.initialize_model_parallel(D, schedule.placement, schedule.num_stages,
                                         timeout=timeout, **bad)
        except ConfigError:
            continue
        raise AssertionError(f"accepted {bad}")
    ps.initialize_model_parallel(D, schedule.placement, schedule.num_stages, T, timeout=timeout,
                                 p2p_direction_groups=True)
    try:
        p, dp, t = rank_coordinates(rank, W, T)
        got = {"tensor": _ranks(ps.get_tensor_model_parallel_group()),
               "pipeline": _ranks(ps.get_pipeline_model_parallel_group()),
               "data": _ranks(ps.get_data_parallel_group()),
               "model": _ranks(ps.get_model_parallel_group())}
        for stage in ps._state().stage_replica_groups:  # noqa: SLF001 (the groups held)
            got[f"stage {stage}"] = _ranks(ps.get_stage_replica_group(stage))
            assert ps.get_stage_replica_ranks(stage) == got[f"stage {stage}"]
        if ps.get_embedding_group() is not None:
            got["embedding"] = _ranks(ps.get_embedding_group())
        want = _expected_groups(rank, T, W, D, schedule.placement)
        assert got == want, (rank, got, want)
        # every distinct collective group connected once, in one global order (a rank that
        # went another way round would leave its peers waiting: the world would time out)
        assert ps.connect_communicators(torch.device("cpu")) == len(
            {tuple(ranks) for ranks in want.values()})
        assert (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
                ps.get_data_parallel_world_size(), ps.get_pipeline_model_parallel_rank()) == (
                    T, t, W, p)
        assert ps.get_tensor_model_parallel_src_rank() == global_rank(p, dp, W, 0, T)
        assert ps.get_model_replica_group() is ps.get_model_parallel_group()
        if T == 1:  # one group per rank set: the model-parallel group is the pipeline group
            assert ps.get_model_parallel_group() is ps.get_pipeline_model_parallel_group()
        # p2p: only between equal tensor (and data-parallel) ranks of pipe neighbours
        for (src, dst), group in ps._state().p2p_groups.items():  # noqa: SLF001
            a, b = rank_coordinates(src, W, T), rank_coordinates(dst, W, T)
            assert a[1:] == b[1:] == (dp, t) and _ranks(group) == sorted((src, dst))
        for pipe, stage in ps.replicas_of_this_rank():
            nxt = ps.get_pipeline_next_rank(pipe, stage)
            if nxt is not None:
                assert rank_coordinates(nxt, W, T) == (schedule.placement[pipe][stage + 1], dp, t)
            assert ps.pipeline_rank_to_global_rank(p) == rank
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("T,D,schedule", [(2, 4, "chimera"), (2, 2, "1f1b"), (4, 2, "chimera")])
def test_groups_of_every_rank(T, D, schedule):
    """T=2 W=1 D=4 Chimera (the docstring's example), T=2 W=2 D=2 1F1B, T=4 W=1 D=2 Chimera."""
    spawn_world(run_groups, 8, T, D, schedule, timeout_s=100)


def test_docstring_example():
    """T=2, W=1, D=4 Chimera as drawn in parallel_state's docstring."""
    assert [rank_coordinates(r, 1, 2)[0] for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    placement = build_schedule("chimera", 4, 4).placement
    groups = _expected_groups(1, 2, 1, 4, placement)
    assert groups["tensor"] == [0, 1] and groups["pipeline"] == [1, 3, 5, 7]
    assert groups["stage 0"] == groups["stage 3"] == groups["embedding"] == [1, 7]
    assert _expected_groups(2, 2, 1, 4, placement)["stage 1"] == [2, 4]


# ----------------------------------------------------------------------------- RNG tracker
def test_fork_without_seed_is_a_no_op_for_one_process():
    tracker = CudaRNGStatesTracker()
    torch.manual_seed(3)
    with tracker.fork():
        a = torch.rand(4)
    torch.manual_seed(3)
    assert torch.equal(a, torch.rand(4))


def test_fork_uses_its_own_stream_and_restores_the_default():
    tracker = CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 77)
    torch.manual_seed(5)
    first = torch.rand(3)
    with tracker.fork():
        inside = torch.rand(3)
    after = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(first, torch.rand(3)) and torch.equal(after, torch.rand(3))
    assert torch.equal(inside, torch.rand(3, generator=torch.Generator().manual_seed(77)))
    with tracker.fork():  # the stream continues where it stopped
        again = torch.rand(3)
    g = torch.Generator().manual_seed(77)
    torch.rand(3, generator=g)
    assert torch.equal(again, torch.rand(3, generator=g))
    with pytest.raises(ValueError):
        tracker.add("other", 77)


def test_checkpoint_replays_the_tracker_stream():
    """Dropout inside the tracker's fork under tensor_parallel.checkpoint: recomputation draws
    the forward's mask, so gradients equal the stored run."""
    get_cuda_rng_tracker().reset()
    get_cuda_rng_tracker().add("model-parallel-rng", 1234)
    try:
        x = torch.randn(16, 16)

        def block(value):
            with get_cuda_rng_tracker().fork():
                return F.dropout(value.tanh(), p=0.5, training=True) * 3

        grads = []
        for use_checkpoint in (False, True):
            states = get_cuda_rng_tracker().get_states()
            value = x.clone().requires_grad_()
            out = checkpoint(block, value) if use_checkpoint else block(value)
            out.sum().backward()
            grads.append(value.grad)
            get_cuda_rng_tracker().set_states(states)
        assert torch.equal(grads[0], grads[1])
    finally:
        get_cuda_rng_tracker().reset()


def run_tracker_across_ranks(rank: int, world_size: int) -> None:
    schedule = build_schedule("1f1b", 1, 1)
    ps.initialize_model_parallel(1, schedule.placement, 1, world_size,
                                 timeout=datetime.timedelta(seconds=60))
    try:
        get_cuda_rng_tracker().reset()
        try:
            with get_cuda_rng_tracker().fork():
                pass
        except RuntimeError:
            pass
        else:
            raise AssertionError("an unseeded tracker forked with T > 1")
        model_parallel_cuda_manual_seed(42)
        outside = torch.rand(8)
        with get_cuda_rng_tracker().fork():
            inside = torch.rand(8)
        both = torch.stack([outside, inside])
        parts = [torch.empty_like(both) for _ in range(world_size)]
        dist.all_gather(parts, both)
        assert all(torch.equal(p[0], parts[0][0]) for p in parts), "default streams differ"
        assert not torch.equal(parts[0][1], parts[1][1]), "tensor-parallel streams are equal"
    finally:
        get_cuda_rng_tracker().reset()
        ps.destroy_model_parallel()


def test_tracker_streams_differ_across_tensor_ranks_and_default_streams_agree():
    spawn_world(run_tracker_across_ranks, 2, timeout_s=60)
