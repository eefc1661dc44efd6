"""Chimera generator: slot formula, reference orders, makespans, memory and size errors.

Expected orders are rebuilt here straight from docs/CHIMERA.md's formulas (not from the generator's
helpers); expected makespans are docs/CHIMERA.md's closed forms, measured with the simulator.
"""

import pytest

from megatron_chimera.schedules import build_schedule
from megatron_chimera.schedules.chimera import CONCAT_NAMES, DEFAULT_CONCAT, chimera
from megatron_chimera.schedules.simulate import CostModel, peak_inflight, simulate
from megatron_chimera.schedules.validate import validate
from tests.helpers.schedules import with_weight_actions

F_EQ_B = CostModel(forward_cost=1.0, backward_cost=1.0)
B_2F = CostModel(forward_cost=1.0, backward_cost=2.0)


def _formula_orders(D):
    """CHIMERA.md: worker holding stage s of a pipe runs local mb j at slots s+2j and 2D-1-s+2j."""
    half = D // 2
    orders = []
    for w in range(D):
        ops = []
        for pipe, stage in ((0, w), (1, D - 1 - w)):
            for j in range(half):
                ops.append((stage + 2 * j, ("F", pipe, stage, pipe * half + j)))
                ops.append((2 * D - 1 - stage + 2 * j, ("B", pipe, stage, pipe * half + j)))
        slots = [s for s, _ in ops]
        assert len(set(slots)) == len(slots)
        orders.append([op for _, op in sorted(ops)])
    return orders


def _as_tuples(schedule):
    return [[(a.kind, a.pipe, a.stage, a.microbatch) for a in r] for r in schedule.actions]


@pytest.mark.parametrize("D", [2, 4, 6, 8, 16])
def test_basic_unit_is_the_sorted_slot_formula(D):
    sched = build_schedule("chimera", D, D)
    validate(sched)
    assert _as_tuples(sched) == _formula_orders(D)
    assert sched.placement == [list(range(D)), list(range(D - 1, -1, -1))]


def test_d4_worker_orders_from_chimera_md():
    sched = chimera(4, 4)
    names = {0: "d", 1: "u"}

    def label(a):
        return f"{a.kind} {names[a.pipe]}{a.microbatch - 2 * a.pipe}"

    assert [label(a) for a in sched.actions[0]] == [
        "F d0", "F d1", "F u0", "B u0", "F u1", "B u1", "B d0", "B d1"
    ]
    assert [label(a) for a in sched.actions[1]] == [
        "F d0", "F u0", "F d1", "F u1", "B u0", "B d0", "B u1", "B d1"
    ]


def _phase_orders(D, N):
    """The reference code's phase form of direct concatenation (docs/CHIMERA.md)."""
    h, per = D // 2, N // 2
    out = []
    for s in range(D):
        a = h - s if s < h else s - h + 1
        b = h - a
        X, Y = (0, 1) if s < h else (1, 0)
        seq = [("F", X)] * a
        for u in range(N // D):
            if u:
                seq += [("B", X), ("F", X)] * a
            seq += [("F", Y), ("F", X)] * b + [("F", Y), ("B", Y)] * a + [("B", X), ("B", Y)] * b
        seq += [("B", X)] * a
        count, order = {}, []
        for kind, p in seq:
            c = count.get((kind, p), 0)
            count[(kind, p)] = c + 1
            order.append((kind, p, s if p == 0 else D - 1 - s, p * per + c))
        out.append(order)
    return out


@pytest.mark.parametrize("D,k", [(2, 3), (4, 2), (6, 3), (8, 4), (16, 2)])
def test_direct_concatenation_matches_reference_phases(D, k):
    sched = chimera(D, k * D, concat="direct")
    validate(sched)
    assert _as_tuples(sched) == _phase_orders(D, k * D)


@pytest.mark.parametrize("D,N", [(4, 4), (8, 8), (8, 32), (6, 18)])
@pytest.mark.parametrize("concat", ["direct", "slot-merge"])
def test_makespan_forward_equals_backward(D, N, concat):
    result = simulate(chimera(D, N, concat=concat), F_EQ_B)
    assert result.makespan == pytest.approx(2 * N + D - 2)
    for name in ("1f1b", "gpipe"):
        assert simulate(build_schedule(name, D, N), F_EQ_B).makespan == pytest.approx(
            2 * (N + D - 1)
        )


@pytest.mark.parametrize("D", [4, 8, 16])
def test_backward_twice_forward_makespans(D):
    assert simulate(chimera(D, D), B_2F).makespan == pytest.approx(5 * D - 4)
    for N in (D, 4 * D):
        assert simulate(build_schedule("1f1b", D, N), B_2F).makespan == pytest.approx(
            3 * (N + D - 1)
        )
    for k in (2, 4):
        N = k * D
        direct = simulate(chimera(D, N, concat="direct"), B_2F)
        assert direct.makespan == pytest.approx(3 * N + (k + 1) * (D - 2))
        doubling = simulate(chimera(D, N, concat="forward-doubling"), B_2F)
        assert doubling.makespan == pytest.approx(3 * N + 1.5 * (D - 2))
        assert max(doubling.peak_inflight) <= 2 * D


def test_d8_n32_figures_of_chimera_md():
    assert simulate(chimera(8, 32, concat="direct"), B_2F).makespan == 126
    assert simulate(build_schedule("1f1b", 8, 32), B_2F).makespan == 117
    assert simulate(chimera(8, 32, concat="forward-doubling"), B_2F).makespan == 105


@pytest.mark.parametrize("D", [4, 8, 16])
@pytest.mark.parametrize("k", [1, 3])
def test_peak_inflight_basic_unit_and_direct(D, k):
    result = simulate(chimera(D, k * D, concat="direct"), B_2F)
    assert result.peak_inflight == [D // 2 + 1 + min(w, D - 1 - w) for w in range(D)]


def test_slot_merge_beats_direct_and_1f1b_within_memory():
    sched = build_schedule("chimera", 8, 32)  # the default concatenation for N > D
    assert sched.meta["concat"] == DEFAULT_CONCAT == "slot-merge"
    validate(sched)
    result = simulate(sched, B_2F)
    assert result.makespan <= 108
    assert all(p <= 8 for p in result.peak_inflight)


@pytest.mark.parametrize("D,k", [(4, 4), (6, 2), (8, 2), (16, 4)])
def test_slot_merge_closed_form(D, k):
    result = simulate(chimera(D, k * D), B_2F)
    assert result.makespan == pytest.approx(3 * k * D + 2 * D - 4)
    assert max(result.peak_inflight) <= D


def test_placement_with_four_pipes_d8():
    sched = chimera(8, 8, pipes=4)
    validate(sched)
    assert sched.placement == [
        [0, 1, 2, 3, 4, 5, 6, 7],
        [4, 5, 6, 7, 0, 1, 2, 3],
        [7, 6, 5, 4, 3, 2, 1, 0],
        [3, 2, 1, 0, 7, 6, 5, 4],
    ]
    assert sched.weight_copies() == [4] * 8
    assert [len(sched.replicas_of_rank(r)) for r in range(8)] == [4] * 8
    assert list(sched.microbatches_of_pipe(3)) == [6, 7]


@pytest.mark.parametrize("D,f", [(4, 2), (8, 2), (8, 4), (12, 3), (16, 2), (16, 4), (16, 8)])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("concat", ["direct", "slot-merge"])
def test_more_pipes_bubble_ratio(D, f, k, concat):
    N = k * D
    sched = chimera(D, N, pipes=2 * f, concat=concat)
    validate(sched)
    result = simulate(sched, F_EQ_B)
    assert result.bubble_ratio == pytest.approx((D - 2 * f) / (2 * f * N + D - 2 * f))
    assert max(result.peak_inflight) <= D


@pytest.mark.parametrize("D", range(2, 41, 2))
def test_generalised_slot_formula_never_collides(D):
    from megatron_chimera.schedules.chimera import chimera_placement, unit_slots

    for f in (f for f in range(1, D // 2 + 1) if (D // 2) % f == 0):
        placement = chimera_placement(D, 2 * f)
        used = set()
        for slot, a in unit_slots(D, 2 * f):
            key = (placement[a.pipe][a.stage], slot)
            assert key not in used
            used.add(key)


@pytest.mark.parametrize(
    "args,flag",
    [
        ((5, 10, 2, None), "--pipeline-model-parallel-size"),
        ((8, 8, 6, None), "--chimera-pipes"),
        ((8, 8, 3, None), "--chimera-pipes"),
        ((8, 12, 2, None), "--num-microbatches"),
        ((8, 6, 4, None), "--num-microbatches"),
        ((8, 3, 2, None), "--num-microbatches"),
        ((8, 4, 2, "forward-doubling"), "--num-microbatches"),
        ((8, 8, 2, "forward-doubling"), "--num-microbatches"),
        ((8, 16, 4, "forward-doubling"), "--chimera-pipes"),
        ((8, 16, 2, "zigzag"), "--chimera-concat"),
    ],
)
def test_invalid_sizes_name_the_flag(args, flag):
    D, N, pipes, concat = args
    with pytest.raises(ValueError, match=flag):
        chimera(D, N, pipes=pipes, concat=concat)


def test_concat_names_and_json_round_trip():
    assert set(CONCAT_NAMES) == {"direct", "forward-doubling", "slot-merge"}
    from megatron_chimera.schedules import Schedule

    sched = chimera(4, 8, pipes=4)
    assert Schedule.from_json(sched.to_json()) == sched


def test_split_backward_puts_each_w_right_after_its_b():
    plain = chimera(4, 8)
    split = with_weight_actions(plain, delay=0)
    validate(split)
    assert split.split_backward
    for p_order, s_order in zip(plain.actions, split.actions):
        assert [a for a in s_order if a.kind != "W"] == p_order
        for i, a in enumerate(s_order):
            if a.kind == "B":
                assert s_order[i + 1] == a.__class__("W", a.pipe, a.stage, a.microbatch)
    costs = CostModel(forward_cost=1.0, backward_cost=2.0, weight_cost=1.0)
    split_result, plain_result = simulate(split, costs), simulate(plain, B_2F)
    assert split_result.busy == plain_result.busy
    # the input gradient (B = 1) reaches the previous stage before the W runs
    assert split_result.makespan <= plain_result.makespan


def test_backward_halving_is_forward_doubling_on_half_size_microbatches():
    from megatron_chimera.schedules.chimera import chimera_backward_halving

    sched = chimera_backward_halving(4, 8)
    validate(sched)
    assert sched.num_microbatches == 16 and sched.meta["microbatch_fraction"] == 0.5
    assert sched.actions == chimera(4, 16, concat="forward-doubling").actions
    # half-size micro-batches: at backward = 2 x forward a backward slot takes a forward's time
    result = simulate(sched, CostModel(0.5, 1.0))
    assert result.makespan < simulate(chimera(4, 8, concat="direct"), CostModel(1.0, 2.0)).makespan
    assert max(peak_inflight(sched)) * 0.5 <= 4  # D full-size activations
    with pytest.raises(ValueError, match="backward halving"):
        chimera_backward_halving(4, 6)


@pytest.mark.parametrize("D,pipes", [(2, 2), (4, 2), (6, 2), (8, 2), (8, 4), (12, 6)])
def test_fewer_microbatches_than_d_is_the_basic_unit_without_the_others(D, pipes):
    """N < D (a multiple of the pipes): each rank's order is the basic unit's order with the
    micro-batches beyond N/2f of every pipe removed (renumbered), valid, and its makespan at
    F = B is the slot count 2D + 2N/2f - 2 (the unit's last backward at stage 0)."""
    full = chimera(D, D, pipes=pipes)
    for N in range(pipes, D, pipes):
        sched = chimera(D, N, pipes=pipes)
        validate(sched)
        n, per_unit = N // pipes, D // pipes
        expected = [[(a.kind, a.pipe, a.stage, a.pipe * n + a.microbatch % per_unit)
                     for a in r if a.microbatch % per_unit < n] for r in full.actions]
        assert _as_tuples(sched) == expected
        assert sched.num_microbatches == N and sched.meta["concat"] == "none"
        assert simulate(sched, F_EQ_B).makespan == pytest.approx(2 * D + 2 * n - 2)
        assert chimera(D, N, pipes=pipes, concat="direct").actions == sched.actions


def test_two_sequences_at_d4_beat_one_pipe_and_match_the_sliced_generator_at_k1():
    """Unsliced Chimera at N = 2, D = 4 (one micro-batch per pipe) is a real schedule: at
    B = 2F it is one pass of a micro-batch through D stages, 3D (the pipes run side by side and
    never wait for each other), against 1F1B's 3(N + D - 1); the sliced generator's k = 1 order
    costs the same."""
    from megatron_chimera.schedules.one_f_one_b import one_f_one_b
    from megatron_chimera.schedules.slices import sliced_schedule

    sched = chimera(4, 2)
    assert simulate(sched, B_2F).makespan == pytest.approx(3 * 4)  # one F+B pass per stage
    assert simulate(one_f_one_b(4, 2), B_2F).makespan == pytest.approx(3 * (2 + 4 - 1))
    assert simulate(sliced_schedule("chimera", 4, 2, 1), B_2F).makespan == pytest.approx(
        simulate(sched, B_2F).makespan)
    assert build_schedule("chimera", 4, 2).actions == sched.actions
