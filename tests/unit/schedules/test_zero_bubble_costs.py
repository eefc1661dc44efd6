"""Per-stage F/B/W and p2p costs in the split-backward generators, against independent references:
the event simulator, exhaustive search over every order on tiny instances, hand-computed bounds."""

from __future__ import annotations

import itertools
import random

import pytest

from megatron_chimera.schedules import Schedule, build_schedule
from megatron_chimera.schedules.actions import BACKWARD, FORWARD, WEIGHT, Action
from megatron_chimera.schedules.chimera import chimera_placement
from megatron_chimera.schedules.costs import StageCosts
from megatron_chimera.schedules.list_scheduler import CapDeadlock, Priority, list_schedule, replay
from megatron_chimera.schedules.simulate import simulate
from megatron_chimera.schedules.validate import validate
from megatron_chimera.schedules.weight_fill import fill_weights, peak_live, split_adjacent
from megatron_chimera.schedules.zero_bubble import chimera_zb, makespan_lower_bound, zb_h1


def random_costs(rng: random.Random, stages: int, p2p: bool = True) -> StageCosts:
    def draw(low: float, high: float) -> tuple[float, ...]:
        return tuple(round(rng.uniform(low, high), 2) for _ in range(stages))

    return StageCosts(draw(0.5, 2), draw(0.5, 3), draw(0.1, 2),
                      round(rng.uniform(0, 0.5), 2) if p2p else 0.0)


def makespan(schedule: Schedule, costs: StageCosts) -> float:
    """The independent simulator's makespan (whole backward B + W when unsplit)."""
    return simulate(schedule, costs.cost_model(schedule.split_backward)).makespan


def test_lower_bound_by_hand():
    """D=4, two pipes, stage costs F=B=(2,1,1,3), W=1, p2p 0.5 (docstring terms)."""
    costs = StageCosts((2, 1, 1, 3), (2, 1, 1, 3), (1, 1, 1, 1), 0.5)
    placement = chimera_placement(4, 2)
    # 2 micro-batches per pipe: rank 0 (stages 0 and 3) gets its first input at 0 and has
    # 2 x (2+2+1) + 2 x (3+3+1) = 24 of work
    assert makespan_lower_bound(placement, 2, costs, 4) == 24.0
    # 1 per pipe: one micro-batch's chain dominates: forwards with hops 2+.5+1+.5+1+.5+3 = 8.5,
    # backwards 3+.5+1+.5+1+.5+2 = 8.5, then W of stage 0: 18
    assert makespan_lower_bound(placement, 1, costs, 4) == 18.0


def _interleavings(chains: list[list[Action]]):
    """Every merge of ``chains`` keeping each chain's order."""
    if all(not c for c in chains):
        yield []
        return
    for i, chain in enumerate(chains):
        if chain:
            rest = chains[:i] + [chain[1:]] + chains[i + 1:]
            for tail in _interleavings(rest):
                yield [chain[0], *tail]


def _optimum(placement: list[list[int]], pipe_microbatches: list[list[int]],
             costs: StageCosts) -> float:
    """The shortest makespan over every per-rank order (each micro-batch's F, B, W in order on
    its rank), executed in order: exhaustive search."""
    num_ranks = 1 + max(max(p) for p in placement)
    chains: list[list[list[Action]]] = [[] for _ in range(num_ranks)]
    for pipe, ranks in enumerate(placement):
        for stage, rank in enumerate(ranks):
            for mb in pipe_microbatches[pipe]:
                chains[rank].append([Action(k, pipe, stage, mb) for k in (FORWARD, BACKWARD,
                                                                           WEIGHT)])
    per_rank = [list(_interleavings(c)) for c in chains]
    durations = costs.durations()
    best = float("inf")
    for orders in itertools.product(*per_rank):
        try:
            start = replay(orders, placement, costs)
        except CapDeadlock:
            continue
        best = min(best, max(t + durations[a.kind][a.stage] for a, t in start.items()))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_bound_and_generators_against_exhaustive_search(seed):
    """lower bound <= the optimum over every order, which each generator reaches on these tiny
    instances (Chimera-ZB D=2 N=2, cost-aware ZB-H1 D=3 N=2, random per-stage costs and p2p)."""
    rng = random.Random(seed)
    costs = random_costs(rng, 2)
    chimera = chimera_zb(2, 2, costs=costs)
    optimum = _optimum(chimera.placement, [[0], [1]], costs)
    assert makespan_lower_bound(chimera.placement, 1, costs, 2) <= optimum + 1e-9
    assert makespan(chimera, costs) == pytest.approx(optimum)
    costs3 = random_costs(rng, 3)
    h1 = zb_h1(3, 2, costs=costs3)
    optimum = _optimum(h1.placement, [[0, 1]], costs3)
    assert makespan_lower_bound(h1.placement, 2, costs3, 3) <= optimum + 1e-9
    assert makespan(h1, costs3) == pytest.approx(optimum)


@pytest.mark.parametrize("d,n,pipes", [(4, 8, 2), (8, 16, 2), (8, 16, 4)])
def test_chimera_zb_per_stage_costs(d, n, pipes):
    """The generator's own makespan is the simulator's; never slower than Chimera on the same
    placement (its seed) nor than the order built for 1:1:1; the bound holds; within the cap."""
    rng = random.Random(d * 100 + n + pipes)
    for _ in range(2):
        costs = random_costs(rng, d)
        sched = chimera_zb(d, n, pipes=pipes, costs=costs)
        validate(sched)
        got = makespan(sched, costs)
        assert sched.meta["model_makespan"] == pytest.approx(got, abs=1e-9)
        assert sched.meta["costs"] == costs.to_dict()
        assert got >= sched.meta["lower_bound"] - 1e-9
        paper = build_schedule("chimera", d, n, pipes=pipes)
        assert got <= makespan(paper, costs) + 1e-9
        assert got <= makespan(chimera_zb(d, n, pipes=pipes), costs) + 1e-9
        assert max(simulate(sched).peak_inflight) <= d


def test_cost_aware_zb_h1_never_slower_than_its_closed_form_or_1f1b():
    rng = random.Random(7)
    for d, n in ((4, 8), (8, 16)):
        costs = random_costs(rng, d)
        closed, aware = zb_h1(d, n), zb_h1(d, n, costs=costs)
        validate(aware)
        assert aware.meta["model_makespan"] == pytest.approx(makespan(aware, costs))
        assert makespan(aware, costs) <= makespan(closed, costs) + 1e-9
        assert makespan(aware, costs) <= makespan(build_schedule("1f1b", d, n), costs) + 1e-9
        # memory: never more live activations per rank than the closed form
        caps = [peak_live(order) for order in closed.actions]
        assert all(peak_live(order) <= cap for order, cap in zip(aware.actions, caps))
    assert "costs" not in zb_h1(4, 8).meta  # without costs: the closed form, as before


def test_heavier_end_stages_change_the_order():
    """Per-stage costs are not three scalars: with the end stages 1.5 x heavier (embedding, LM
    head; in Chimera both on ranks 0 and D-1) the order built for them reaches the bound
    16 x (4.5 + 4.5) = 144 on the end ranks; the order built for 1:1:1 does not."""
    ends = StageCosts((1.5,) + (1.0,) * 6 + (1.5,), (1.5,) + (1.0,) * 6 + (1.5,),
                      (1.5,) + (1.0,) * 6 + (1.5,))
    built = chimera_zb(8, 32, costs=ends)
    assert built.meta["lower_bound"] == 144.0
    assert makespan(built, ends) == 144.0
    assert makespan(chimera_zb(8, 32), ends) > 144.0


@pytest.mark.parametrize("guard", ["safe", "reserve", "quota"])
def test_list_scheduler_with_p2p_matches_the_simulator(guard):
    """Start times of the list scheduler (per-stage costs, p2p) are the simulator's."""
    rng = random.Random(3)
    costs = random_costs(rng, 4)
    placement = chimera_placement(4, 2)
    result = list_schedule(placement, [[0, 1, 2, 3], [4, 5, 6, 7]], costs, [4] * 4,
                           Priority(guard=guard))
    sched = Schedule("probe", 4, 4, 2, 8, placement, result.actions, split_backward=True)
    validate(sched)
    events = simulate(sched, costs.cost_model()).events
    assert {(e.kind, e.pipe, e.stage, e.microbatch): e.start for e in events} == pytest.approx(
        {tuple(a): t for a, t in result.start.items()})


def test_weight_fill_keeps_f_b_order_and_matches_in_order_execution():
    rng = random.Random(11)
    for name, d, n in (("chimera", 4, 8), ("chimera", 8, 16), ("1f1b", 4, 8)):
        unsplit = build_schedule(name, d, n)
        costs = random_costs(rng, d)
        caps = [peak_live(order) + rng.choice((0, 2)) for order in split_adjacent(
            unsplit.actions)]
        result = fill_weights(unsplit.actions, unsplit.placement, costs, caps)
        for rank, order in enumerate(result.actions):
            assert [a for a in order if a.kind != WEIGHT] == unsplit.actions[rank]
            assert peak_live(order) <= caps[rank]
        assert result.start == pytest.approx(replay(result.actions, unsplit.placement, costs))
        adjacent = replay(split_adjacent(unsplit.actions), unsplit.placement, costs)
        durations = costs.durations()
        assert result.makespan <= max(t + durations[a.kind][a.stage]
                                      for a, t in adjacent.items()) + 1e-9


def test_large_capped_build_stays_within_its_cap():
    """D=32, N=128 with 8 live activations: no seed fits (Chimera holds up to 32), too big for
    the list search budget: one deadlock-free reserve run, valid and within the cap."""
    sched = chimera_zb(32, 128, max_inflight=8, costs=(1.0, 1.5, 0.5))
    validate(sched)
    assert sched.meta["priority"].endswith("guard:reserve:0:0")
    assert max(simulate(sched).peak_inflight) <= 8
