"""Paired F&B actions (MoE all-to-all overlap): the independence rule, the validator, the walks,
the lowering, the simulator's pair cost, the pairing passes and the generators that emit pairs."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest

from megatron_chimera.schedules import build_schedule
from megatron_chimera.schedules.actions import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    Action,
    Schedule,
    independent,
)
from megatron_chimera.schedules.compare import CHIMERA_EP_LABELS, moe_table
from megatron_chimera.schedules.costs import StageCosts
from megatron_chimera.schedules.lowering import RECV, Comm, lower
from megatron_chimera.schedules.pairing import (
    DEFAULT_EP_COSTS,
    ep_costs,
    extra_warmup_pairs,
    improve_pairs,
    pair_adjacent,
    pair_weights,
    slot_order,
    with_overlap,
)
from megatron_chimera.schedules.registry import add_schedule_arguments, spec_and_options_from
from megatron_chimera.schedules.simulate import CostModel, simulate
from megatron_chimera.schedules.validate import ScheduleError, validate, validate_lowered

pytestmark = pytest.mark.timeout(120)
OVERLAP = {"overlap_moe_expert_parallel_comm": True}


def test_independence_rule():
    f, b = Action(FORWARD, 0, 1, 3), Action(BACKWARD, 1, 2, 5)
    assert independent(f, b) is None and independent(b, f) is None
    assert independent(f, Action(FORWARD, 1, 2, 5)) is None  # Chimera's warm-up pair
    assert "not independent" in independent(f, Action(BACKWARD, 0, 1, 3))
    assert "not independent" in independent(f, Action(BACKWARD, 0, 3, 3))  # same micro-batch
    w = Action(WEIGHT, 1, 2, 5)
    assert independent(f, w) is None and independent(w, f) is None  # W beside a lone F
    assert "not independent" in independent(b, w)  # the W of B's own micro-batch needs it
    assert "W carries no all-to-all" in independent(w, Action(WEIGHT, 0, 1, 3))


def _one_rank(pairs: list[list[int]]) -> Schedule:
    """One rank, two micro-batches: F0 F1 B0 B1 (F1 and B0 independent)."""
    actions = [Action(FORWARD, 0, 0, 0), Action(FORWARD, 0, 0, 1), Action(BACKWARD, 0, 0, 0),
               Action(BACKWARD, 0, 0, 1)]
    return Schedule("t", 1, 1, 1, 2, [[0]], [actions], pairs=pairs)


def test_dependent_pair_is_refused_with_a_clear_message():
    validate(_one_rank([[2]]))  # B0 with B1: independent
    bad = Schedule("t", 1, 1, 1, 2, [[0]], [[Action(FORWARD, 0, 0, 0), Action(BACKWARD, 0, 0, 0),
                                            Action(FORWARD, 0, 0, 1), Action(BACKWARD, 0, 0, 1)]],
                   pairs=[[0]])
    with pytest.raises(ScheduleError, match="dependent pair at rank 0, index 0.*F0.0.0 and "
                                            "B0.0.0 are not independent: both belong to "
                                            "micro-batch 0"):
        validate(bad)
    with pytest.raises(ScheduleError, match="overlap"):
        validate(_one_rank([[0, 1]]))
    with pytest.raises(ScheduleError, match="outside its list"):
        validate(_one_rank([[3]]))


def test_pair_waits_for_both_inputs_and_a_cycle_is_a_deadlock():
    """Pairing two warm-up forwards whose inputs come from opposite pipes can close a cycle:
    the pair-aware deadlock check finds it (the unpaired order is fine)."""
    base = slot_order("s", 8, 8, build_schedule("chimera", 8, 8).placement, 32, False)
    validate(base)
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(pair_adjacent(base, mixed_only=False))


def test_simulator_charges_a_pair_max_of_compute_and_all_to_all():
    """F0 (F1+B0) B1 on one rank, F=1, B=2, all-to-all A: F0 pays 1+A, the pair
    max(1+2, 2A), B1 2+A; exposed A + max(0, 2A-3) + A."""
    sched = _one_rank([[1]])
    sched.actions[0][1:3] = [Action(FORWARD, 0, 0, 1), Action(BACKWARD, 0, 0, 0)]
    validate(sched)
    for a2a in (0.5, 1.0, 3.0):
        result = simulate(sched, CostModel(1.0, 2.0, all_to_all_cost=a2a))
        assert result.makespan == pytest.approx((1 + a2a) + max(3, 2 * a2a) + (2 + a2a))
        assert result.exposed_all_to_all == [pytest.approx(2 * a2a + max(0, 2 * a2a - 3))]
        unpaired = simulate(replace(sched, pairs=[]), CostModel(1.0, 2.0, all_to_all_cost=a2a))
        assert unpaired.makespan == pytest.approx(2 * (1 + a2a) + 2 * (2 + a2a))
        assert unpaired.exposed_all_to_all == [pytest.approx(4 * a2a)]


def test_simulator_charges_a_weight_pair_max_of_both_computes_and_the_all_to_all():
    """F0 B0 (W0+F1) B1 W1 on one rank, split backward, F = B = W = 1, all-to-all A: the W
    computes while F1's all-to-all is in flight, so the pair lasts max(1 + 1, A) and exposes
    max(0, A - 2); F0, B0 and B1 pay 1 + A each, W1 1."""
    f0, f1 = Action(FORWARD, 0, 0, 0), Action(FORWARD, 0, 0, 1)
    b0, b1 = Action(BACKWARD, 0, 0, 0), Action(BACKWARD, 0, 0, 1)
    w0, w1 = Action(WEIGHT, 0, 0, 0), Action(WEIGHT, 0, 0, 1)
    sched = Schedule("t", 1, 1, 1, 2, [[0]], [[f0, b0, w0, f1, b1, w1]], split_backward=True,
                     pairs=[[2]])
    validate(sched)
    validate_lowered(lower(sched))
    for a2a in (0.5, 1.0, 3.0):
        result = simulate(sched, CostModel(1.0, 2.0, 1.0, all_to_all_cost=a2a))
        assert result.makespan == pytest.approx(3 * (1 + a2a) + max(2, a2a) + 1)
        assert result.exposed_all_to_all == [pytest.approx(3 * a2a + max(0, a2a - 2))]
    with pytest.raises(ScheduleError, match="not independent"):  # W0 needs B0: never a pair
        validate(replace(sched, pairs=[[1]]))


def test_pair_weights_pairs_lone_actions_with_deferred_weights():
    """Chimera-ZB-EP: the warm-up's and cool-down's lone F and B take a W (of another
    micro-batch) each, which hides their all-to-all; never slower, less exposed."""
    base = build_schedule("chimera-zb", 4, 8)
    costs = ep_costs(DEFAULT_EP_COSTS, 4, 4)
    model = costs.cost_model(True)
    before = improve_pairs(slot_order("chimera-zb", 4, 4, base.placement, 8, True), costs)
    after = pair_weights(before, costs, limit=4 + 1)
    validate(after)
    validate_lowered(lower(after))
    weight_pairs = [(r, i) for r, starts in enumerate(after.pairs) for i in starts
                    if WEIGHT in (after.actions[r][i].kind, after.actions[r][i + 1].kind)]
    assert weight_pairs
    old, new = simulate(before, model), simulate(after, model)
    assert new.makespan <= old.makespan
    assert sum(new.exposed_all_to_all) < sum(old.exposed_all_to_all)
    assert sorted(map(sorted, after.actions)) == sorted(map(sorted, before.actions))


def test_schedules_without_overlap_are_unchanged():
    """No pairs, the old serialised form, and the old closed form without all-to-all."""
    for name in ("1f1b", "chimera", "chimera-zb", "interleaved"):
        schedule = build_schedule(name, 4, 8)
        assert schedule.pairs == [] and "pairs" not in schedule.to_dict()
        assert Schedule.from_dict(schedule.to_dict()) == schedule
    assert simulate(build_schedule("1f1b", 4, 8)).makespan == 3 * (8 + 4 - 1)


@pytest.mark.parametrize(("name", "d", "n", "options"), [
    ("dualpipe", 4, 8, {}), ("dualpipe", 8, 16, {}), ("dualpipev", 4, 8, {}),
    ("dualpipev", 8, 16, {}), ("combined-1f1b", 4, 8, {}), ("combined-1f1b", 4, 16, {}),
    ("chimera", 4, 8, OVERLAP), ("chimera", 8, 16, dict(OVERLAP, pipes=4)),
    ("chimera-zb", 4, 8, OVERLAP), ("1f1b", 4, 8, OVERLAP), ("interleaved", 4, 8, OVERLAP),
    ("zb-h1", 4, 8, OVERLAP), ("bitpipe", 4, 8, OVERLAP), ("bitpipe-zb", 4, 8, OVERLAP),
    ("zbv", 4, 8, OVERLAP),
])
def test_every_pair_the_generators_emit_passes_the_validator(name, d, n, options):
    schedule = build_schedule(name, d, n, **options)
    validate(schedule)  # independence of every pair, deadlock freedom with pairs
    assert schedule.num_pairs() > 0
    for rank, starts in enumerate(schedule.pairs):
        for i in starts:
            assert independent(*schedule.actions[rank][i:i + 2]) is None
    lowered = lower(schedule)
    validate_lowered(lowered)  # receives before the pair, sends after it, NCCL's rules
    for ops in lowered.lists:
        computes = [i for i, op in enumerate(ops) if isinstance(op, Action)]
        assert len(computes) == len(set(computes))
    costs = ep_costs(DEFAULT_EP_COSTS, d, schedule.num_stages).cost_model(
        schedule.split_backward)
    assert simulate(schedule, costs).makespan > 0


def test_lowering_keeps_pair_halves_together_and_refuses_a_receive_between_them():
    schedule = build_schedule("dualpipe", 4, 8)
    lowered = lower(schedule)
    rank = 1
    starts = schedule.pair_starts()[rank]
    compute_index = -1
    ops = lowered.lists[rank]
    for i, op in enumerate(ops):
        if isinstance(op, Action):
            compute_index += 1
            if compute_index - 1 in starts:
                assert isinstance(ops[i - 1], Action)  # the first half right before
                position = i
    recv = next(op for op in lowered.lists[rank] if isinstance(op, Comm) and op.op == RECV)
    ops.remove(recv)
    ops.insert(position, recv)
    with pytest.raises(ScheduleError):
        validate_lowered(lowered)


def test_overlap_is_never_slower_than_unpaired_and_beats_it_with_all_to_all():
    costs = ep_costs(DEFAULT_EP_COSTS, 4, 4).cost_model(False)
    for name in ("1f1b", "chimera"):
        plain = simulate(build_schedule(name, 4, 8), costs)
        paired = simulate(build_schedule(name, 4, 8, **OVERLAP), costs)
        assert paired.makespan <= plain.makespan
        assert sum(paired.exposed_all_to_all) < sum(plain.exposed_all_to_all)


def test_megatron_pairing_needs_one_extra_warmup_forward():
    """Combined 1F1B: each rank runs one more forward before its first backward than the
    interleaved order, and every steady-state forward is paired."""
    base = build_schedule("interleaved", 4, 8)
    combined = extra_warmup_pairs(base)
    for before, after, starts in zip(base.actions, combined.actions, combined.pairs):
        first_b = [a.kind for a in before].index(BACKWARD)
        assert [a.kind for a in after].index(BACKWARD) == first_b + 1
        assert starts and all(after[i].kind == FORWARD and after[i + 1].kind == BACKWARD
                              for i in starts)


def test_overlap_flag_parses_round_trips_and_is_refused_where_it_does_not_apply():
    parser = argparse.ArgumentParser()
    add_schedule_arguments(parser)
    spec, options = spec_and_options_from(parser.parse_args(
        "--pipeline-schedule chimera --overlap-moe-expert-parallel-comm".split()))
    assert options.overlap_moe_expert_parallel_comm is True
    assert "--overlap-moe-expert-parallel-comm" in spec.to_flags(options)
    again = spec_and_options_from(parser.parse_args(spec.to_flags(options)))
    assert again == (spec, options)
    spec, options = spec_and_options_from(parser.parse_args([]))
    assert "--overlap-moe-expert-parallel-comm" not in spec.to_flags(options)
    with pytest.raises(ValueError, match="--overlap-moe-expert-parallel-comm does not apply to "
                                         "--pipeline-schedule gpipe"):
        spec_and_options_from(parser.parse_args(
            "--pipeline-schedule gpipe --overlap-moe-expert-parallel-comm".split()))


def test_pairs_are_chosen_for_the_given_costs():
    """Without all-to-all nothing is hidden: the overlap keeps the unpaired makespan."""
    no_a2a = StageCosts.uniform(1.0, 1.0, 1.0, 1)
    plain = build_schedule("chimera-zb", 4, 8, costs=no_a2a)
    paired = with_overlap(plain, no_a2a)
    model = no_a2a.for_stages(4).cost_model(True)
    assert simulate(paired, model).makespan <= simulate(plain, model).makespan


@pytest.mark.parametrize("name", ["chimera-zb", "chimera", "interleaved"])
def test_pairs_are_chosen_under_the_piece_level_cost_when_given(name):
    """``moe_layers_per_stage`` > 0: the pairs are chosen with each pair costed piece by piece
    (the cost the caller simulates with); never slower under it than the order chosen under
    max(compute, all-to-all), and faster for Chimera-ZB (D=4, N=8, 2 MoE layers per stage:
    32 against 36: that order's B&B pairs pay one piece each, its F&F pairs -- two drivers of
    the one-thread runtime, run in turn -- all of their all-to-alls)."""
    plain = build_schedule(name, 4, 8)
    perfect = with_overlap(plain)
    pieces = with_overlap(plain, moe_layers_per_stage=2)
    validate(pieces)
    model = ep_costs(None, 4, plain.num_stages).cost_model(plain.split_backward,
                                                          moe_layers_per_stage=2)
    chosen, other = simulate(pieces, model).makespan, simulate(perfect, model).makespan
    assert chosen <= other + 1e-9
    if name == "chimera-zb":
        assert (chosen, other) == (pytest.approx(32.0), pytest.approx(36.0))


# ------------------------------------------------------------------ issue 41's simulator table
@pytest.fixture(scope="module")
def table():
    rows = [("dualpipe", "dualpipe", {}), ("dualpipev", "dualpipev", {}),
            ("combined-1f1b v2", "combined-1f1b", {}),
            (CHIMERA_EP_LABELS[1], "chimera-zb", OVERLAP)]
    return {r["schedule"]: r for r in moe_table(8, 32, DEFAULT_EP_COSTS, rows)}


def test_chimera_ep_matches_dualpipe_and_dualpipev(table):
    """D=8, N=32, F:B:W 1:1:1, all-to-all = forward: Chimera-EP is no slower than DualPipe and
    DualPipeV and exposes less all-to-all."""
    ep = table[CHIMERA_EP_LABELS[1]]
    for other in ("dualpipe", "dualpipev"):
        assert ep["makespan"] <= table[other]["makespan"], (ep, table[other])
        assert ep["exposed_max"] < table[other]["exposed_max"]


def test_issue_41_done_when(table):
    """Issue 41: D=8, N=32, F:B:W = 1:1:1, all-to-all = compute: Chimera-EP's worst rank
    exposes at most 5% of the makespan, and its makespan is at most DualPipe's, DualPipeV's
    and combined 1F1B's (v = 2), at no more than DualPipe's D + 1 activations per rank."""
    ep = table[CHIMERA_EP_LABELS[1]]
    assert ep["peak_activations"] <= 8 + 1
    assert ep["exposed_share"] <= 0.05
    assert ep["makespan"] <= min(table[n]["makespan"]
                                 for n in ("dualpipe", "dualpipev", "combined-1f1b v2"))


def test_overlap_keeps_the_activation_cap_the_user_gave():
    """Unlimited, the paired Chimera-ZB order may hold DualPipe's D + 1 activations; with
    --pipeline-activation-cap it keeps to the cap (or to the schedule's own peak)."""
    from megatron_chimera.schedules.simulate import peak_activations

    free = build_schedule("chimera-zb", 4, 8, **OVERLAP)
    assert max(peak_activations(free)) <= 4 + 1
    plain = build_schedule("chimera-zb", 4, 8, activation_cap=3.0)
    capped = build_schedule("chimera-zb", 4, 8, activation_cap=3.0, **OVERLAP)
    assert max(peak_activations(capped)) <= max(3.0, max(peak_activations(plain)))
