"""Simulator: hand-computed timelines, communication costs, all-reduce order, memory, bubbles."""

import math
from dataclasses import replace

import pytest

from megatron_chimera.schedules import Action, Schedule, build_schedule
from megatron_chimera.schedules.simulate import CostModel, peak_inflight, simulate


def test_gpipe_single_microbatch_with_p2p_latency():
    # F chain D*F + (D-1)*c, then the B chain D*B + (D-1)*c
    D, c = 4, 0.25
    costs = CostModel(forward_cost=1.0, backward_cost=2.0, p2p_alpha=0.05,
                      p2p_beta=0.01, activation_bytes=20.0)
    assert costs.p2p_time() == pytest.approx(c)
    result = simulate(build_schedule("gpipe", D, 1), costs)
    assert result.makespan == pytest.approx(D * 3.0 + 2 * (D - 1) * c)
    first = result.events_of_rank(1)[0]
    assert (first.kind, first.start, first.end) == ("F", pytest.approx(1.25), pytest.approx(2.25))


def test_action_overhead_is_paid_before_every_compute():
    """GPipe, one micro-batch, D=4: 8 actions in one chain, each after the host's overhead h
    (after a message too: the receiver wakes, then starts); busy time stays the compute."""
    D, h = 4, 0.125
    result = simulate(build_schedule("gpipe", D, 1),
                      CostModel(forward_cost=1.0, backward_cost=2.0, p2p_alpha=0.25,
                                action_overhead=h))
    assert result.makespan == pytest.approx(D * 3.0 + 2 * (D - 1) * 0.25 + 2 * D * h)
    first = result.events_of_rank(0)[0]
    assert (first.start, first.end) == (pytest.approx(h), pytest.approx(1 + h))
    assert result.busy == pytest.approx([3.0] * D)
    # two forwards back to back on one rank: the second starts h after the first ends
    two = simulate(build_schedule("gpipe", 2, 2), CostModel(1.0, 2.0, action_overhead=h))
    f0, f1 = two.events_of_rank(0)[:2]
    assert f1.start - f0.end == pytest.approx(h)


def test_per_stage_costs_and_busy_time():
    costs = CostModel(forward_cost=[1.0, 2.0, 3.0], backward_cost=[2.0, 4.0, 6.0])
    result = simulate(build_schedule("1f1b", 3, 5), costs)
    assert result.busy == pytest.approx([15.0, 30.0, 45.0])
    # the slowest stage is never idle once started, so the makespan is its work plus its
    # wait for the first forward (1 + 2) and the drain of the first stages (4 + 2)
    assert result.makespan == pytest.approx(3 + 45 + 6)
    with pytest.raises(ValueError, match="forward_cost has 2 entries for 3 stages"):
        simulate(build_schedule("1f1b", 3, 5), CostModel(forward_cost=[1.0, 1.0]))


@pytest.mark.parametrize("D,N", [(4, 4), (4, 12), (8, 8)])
def test_bubble_ratio_of_1f1b_matches_paper(D, N):
    result = simulate(build_schedule("1f1b", D, N), CostModel(1.0, 1.0))
    assert result.bubble_ratio == pytest.approx((D - 1) / (N + D - 1))
    assert result.compute_span == result.makespan


def test_allreduce_eager_descending_and_rabenseifner():
    # gpipe D=2, N=1, F=B=1: F0 [0,1] F1 [1,2] B1 [2,3] B0 [3,4]; dp=2 -> r=2 replicas,
    # all-reduce = 2 log2(2) alpha + 2 (1/2) bytes beta = 2*1 + 100*0.01 = 3
    costs = CostModel(1.0, 1.0, allreduce_alpha=1.0, allreduce_beta=0.01,
                      grad_bytes=100.0, data_parallel_size=2)
    assert costs.allreduce_time(2, 100.0) == pytest.approx(3.0)
    assert costs.allreduce_time(8, 100.0) == pytest.approx(2 * 3 * 1.0 + 2 * 7 / 8 * 1.0)
    result = simulate(build_schedule("gpipe", 2, 1), costs)
    assert result.grad_sync_end == {1: pytest.approx(6.0), 0: pytest.approx(7.0)}
    assert result.makespan == pytest.approx(7.0)
    assert result.compute_span == pytest.approx(4.0)
    assert [a.stage for a in result.allreduces] == [1, 0]


def test_allreduce_waits_for_all_replicas_and_serialises_per_rank():
    sched = build_schedule("chimera", 4, 4)
    costs = CostModel(1.0, 2.0, allreduce_alpha=1.0, data_parallel_size=1)
    result = simulate(sched, costs)
    last_backward = {}
    for e in result.events:
        if e.kind == "B":
            key = (e.rank, e.stage)
            last_backward[key] = max(last_backward.get(key, 0.0), e.end)
    channel_free = {}
    assert [a.stage for a in result.allreduces] == [3, 2, 1, 0]
    for ar in result.allreduces:
        assert ar.replicas == 2 and len(ar.ranks) == 2
        expected_start = max(
            max(last_backward[(r, ar.stage)], channel_free.get(r, 0.0)) for r in ar.ranks
        )
        assert ar.start == pytest.approx(expected_start)
        assert ar.end - ar.start == pytest.approx(2 * math.log2(2) * 1.0)
        for r in ar.ranks:
            channel_free[r] = ar.end
    # stage 3 and stage 0 share ranks 0 and 3: stage 0's sync queues behind stage 3's
    assert result.grad_sync_end[0] >= result.grad_sync_end[3] + 2.0 - 1e-9
    assert result.makespan == pytest.approx(max(a.end for a in result.allreduces))


def test_grad_reduce_modes_and_concurrent_channels():
    """gpipe D=2, N=1, F=B=1 (B1 [2,3] on rank 1, B0 [3,4] on rank 0), each all-reduce 3:
    ``stage`` starts stage 1 at 3; ``end`` waits for the rank's last compute (the same here,
    rank 1 ends at 3) -- on rank 0 of a 2-stage 1F1B, ``end`` also waits for its last B;
    ``overlap`` with 2 buckets starts the first bucket half-way through the last backward
    (2.5) and chains the second (1.5 each). Chimera's rank 0 holds stages 0 and 3: with one
    channel their all-reduces never overlap, with two they do."""
    costs = CostModel(1.0, 1.0, allreduce_alpha=1.0, allreduce_beta=0.01, grad_bytes=100.0,
                      data_parallel_size=2)
    sched = build_schedule("gpipe", 2, 1)
    eager = simulate(sched, costs).allreduces[0]
    assert (eager.stage, eager.start, eager.end) == (1, pytest.approx(3.0), pytest.approx(6.0))
    overlap = simulate(sched, replace(costs, grad_reduce="overlap", grad_buckets=2))
    first = overlap.allreduces[0]
    # each bucket: 2 log2(2) alpha + 50 * 0.01 = 2.5; second bucket ready at 3, waits for 5
    assert (first.start, first.end) == (pytest.approx(2.5), pytest.approx(7.5))
    late = simulate(build_schedule("1f1b", 2, 4), replace(costs, grad_reduce="end"))
    rank_end = {r: max(e.end for e in late.events_of_rank(r)) for r in range(2)}
    for a in late.allreduces:
        assert a.start >= max(rank_end[r] for r in a.ranks) - 1e-9
    with pytest.raises(ValueError, match="grad_reduce"):
        simulate(sched, replace(costs, grad_reduce="later"))
    chimera = build_schedule("chimera", 4, 4)
    base = CostModel(1.0, 2.0, allreduce_alpha=4.0)
    for channels, overlapping in ((1, False), (2, True)):
        ars = {a.stage: a for a in simulate(chimera, replace(base, allreduce_channels=channels))
               .allreduces}
        assert (ars[0].start < ars[3].end) is overlapping, (channels, ars)


def _split_single_rank(order):
    return Schedule(
        name="hand", num_ranks=1, num_stages=1, num_pipes=1, num_microbatches=2,
        placement=[[0]], actions=[[Action(*a) for a in order]], split_backward=True,
    )


def test_split_backward_costs_and_memory_released_at_w():
    sched = _split_single_rank(
        [("F", 0, 0, 0), ("B", 0, 0, 0), ("F", 0, 0, 1), ("W", 0, 0, 0), ("B", 0, 0, 1),
         ("W", 0, 0, 1)]
    )
    result = simulate(sched, CostModel(forward_cost=1.0, backward_cost=3.0, weight_cost=1.0))
    assert [(e.kind, e.end - e.start) for e in result.events] == [
        ("F", 1.0), ("B", 2.0), ("F", 1.0), ("W", 1.0), ("B", 2.0), ("W", 1.0)
    ]
    assert result.makespan == pytest.approx(8.0)
    assert peak_inflight(sched) == [2]  # micro-batch 0 lives until its W, after F of 1
    with pytest.raises(ValueError, match="--weight-cost"):
        simulate(sched, CostModel(forward_cost=1.0, backward_cost=1.0, weight_cost=2.0))


def test_weight_cost_ignored_for_unsplit_schedules():
    sched = build_schedule("1f1b", 4, 8)
    a = simulate(sched, CostModel(1.0, 2.0, weight_cost=1.0))
    b = simulate(sched, CostModel(1.0, 2.0))
    assert a.makespan == b.makespan == 3 * (8 + 4 - 1)


def test_result_views_and_json():
    result = simulate(build_schedule("chimera", 4, 8), CostModel(1.0, 2.0))
    data = result.to_dict()
    assert data["makespan"] == result.makespan
    assert len(data["events"]) == 4 * 8 * 2
    assert data["weight_copies"] == {"0": 2, "1": 2, "2": 2, "3": 2}
    assert set(data["events"][0]) == {"rank", "kind", "pipe", "stage", "microbatch", "start", "end"}
    for rank in range(4):
        events = result.events_of_rank(rank)
        assert all(x.end <= y.start + 1e-9 for x, y in zip(events, events[1:]))
