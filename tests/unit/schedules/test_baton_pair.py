"""The simulator's piece-level pair cost (``CostModel.moe_layers_per_stage``): a pair costed as
the paired runtime's baton runs it (schedules/simulate.py: baton_pair_time), checked against
timelines worked out by hand, the perfect-overlap formula it tends to, and the runtime's rule
for which half leads."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_chimera.pipeline.overlap import leading_half
from megatron_chimera.pipeline.pair_calibration import fit_hand_over
from megatron_chimera.schedules.actions import BACKWARD, FORWARD, WEIGHT, Action, Schedule
from megatron_chimera.schedules.simulate import (
    CostModel,
    action_pieces,
    baton_pair_time,
    pair_leader,
    simulate,
)

pytestmark = pytest.mark.timeout(60)


def _pair(kinds: str, c: tuple[float, float], a: tuple[float, float], layers: int,
          hand_over: float = 0.0) -> float:
    halves = [action_pieces(k, ci, ai, layers) for k, ci, ai in zip(kinds, c, a)]
    return baton_pair_time(halves, pair_leader(tuple(kinds)), hand_over)


def test_the_leader_is_the_runtimes():
    for kinds in ("FF", "FB", "BF", "BB", "FW", "WF", "BW", "WB"):
        assert pair_leader(tuple(kinds)) == leading_half(tuple(kinds))


def test_pieces_alternate_compute_and_all_to_all():
    assert action_pieces(FORWARD, 4.0, 8.0, 1) == [(False, 2.0), (True, 4.0)] * 2
    assert action_pieces(BACKWARD, 4.0, 8.0, 2) == [(True, 2.0), (False, 1.0)] * 4


@pytest.mark.parametrize("layers", [1, 2, 4])
def test_a_balanced_f_and_b_pair_hides_everything(layers):
    """B leads (its combine's gradient), F computes meanwhile, and so on: with every piece p,
    the pair lasts 4 layers p, i.e. max(C_F + C_B, A + A), nothing exposed."""
    assert _pair("FB", (4.0, 4.0), (4.0, 4.0), layers) == pytest.approx(8.0)


@pytest.mark.parametrize("layers", [1, 2, 4])
def test_two_forwards_or_two_backwards_expose_one_piece(layers):
    """F&F: the later forward's last all-to-all has nothing to hide behind; B&B: the later
    backward's first all-to-all waits for the link. One piece (4 / 2 layers) more than max."""
    piece = 4.0 / (2 * layers)
    assert _pair("FF", (4.0, 4.0), (4.0, 4.0), layers) == pytest.approx(8.0 + piece)
    assert _pair("BB", (4.0, 4.0), (4.0, 4.0), layers) == pytest.approx(8.0 + piece)


def test_a_w_pair_hides_its_partners_all_to_alls_piece_by_piece():
    """A W has no all-to-all: it hands the baton back after each of its 2k pieces (the
    runtime's hand-over between weight-gradient entries). F (C 1, A 1) beside W (C 1), one
    layer: F c(.5) [0, .5], issues a(.5) [.5, 1]; W w(.5) [.5, 1]; F c [1, 1.5], a [1.5, 2];
    W w [1.5, 2]; F waits for its combine: 2 = max(1 + 1, 1) for every k (before the W was cut,
    3 - 1/2k: the W computed in one turn and the F's later all-to-alls ran exposed). B leads
    with its all-to-all: a [0, .5] beside w [0, .5], c [.5, 1], a [1, 1.5] beside w, c: 2."""
    for layers in (1, 2, 4):
        assert action_pieces(WEIGHT, 1.0, 0.0, layers) == [(False, 1.0 / (2 * layers))] * (
            2 * layers)
        for kinds in ("FW", "WF", "BW", "WB"):
            c, a = (1.0, 1.0), (1.0, 0.0)
            if kinds[0] == "W":
                c, a = c[::-1], a[::-1]
            assert _pair(kinds, c, a, layers) == pytest.approx(2.0)


def test_a_w_pair_is_serial_within_its_halves():
    """A short W (C .5) beside F (C 1, A 1), one layer: F c [0, .5], a [.5, 1]; W w(.25)
    [.5, .75]; F waits for a, c [1, 1.5], a [1.5, 2]; W w [1.5, 1.75]: 2 = the F's own compute
    plus all-to-all (max(1.5, 1) ignores that). A long W (C 2): F c [0, .5], a; W w(1)
    [.5, 1.5]; F c [1.5, 2], a [2, 2.5]; W w [2, 3]; the pair ends at 3 = C_F + C_W."""
    assert _pair("FW", (1.0, 0.5), (1.0, 0.0), 1) == pytest.approx(2.0)
    assert _pair("FW", (1.0, 2.0), (1.0, 0.0), 1) == pytest.approx(3.0)
    # each hand-over (.1) delays its receiver: F c [0, .5], a [.5, 1]; W w [.6, 1.1]; F c
    # [1.2, 1.7], a [1.7, 2.2]; W w [1.8, 2.3], finishes; F takes the baton back at 2.4
    assert _pair("FW", (1.0, 1.0), (1.0, 0.0), 1, 0.1) == pytest.approx(2.4)


def test_many_layers_tend_to_perfect_overlap():
    for kinds in ("FB", "FF", "BB"):
        for c, a in (((1.0, 2.0), (1.0, 1.0)), ((1.0, 1.0), (2.0, 2.0)), ((2.0, 1.0), (1.0, 1.0))):
            perfect = max(sum(c), sum(a))
            assert _pair(kinds, c, a, 400) == pytest.approx(perfect, rel=5e-3)
            assert _pair(kinds, c, a, 1) >= perfect - 1e-12
    # a W beside an F or B: max(C + C_W, C + A), the partner's own pieces being serial
    for kinds in ("FW", "BW"):
        for c in ((1.0, 0.5), (1.0, 1.0), (1.0, 2.0), (0.5, 1.0)):
            perfect = max(sum(c), c[0] + 1.0)
            assert _pair(kinds, c, (1.0, 0.0), 400) == pytest.approx(perfect, rel=5e-3)
            assert _pair(kinds, c, (1.0, 0.0), 1) >= perfect - 1e-12


def test_a_half_cannot_end_before_its_own_compute_and_all_to_all():
    """F (C 2, A 2) with B (C .5, A .5): max(C_F + C_B, A + A) says 2.5, but the forward's own
    pieces are serial: 2 + 2. One layer, B leads: B's a(.25) [0, .25]; F c(1) [0, 1], its
    a(1) [1, 2]; B c(.25) [1, 1.25], its a(.25) [2, 2.25] (the link); F c(1) [2, 3], its a(1)
    [3, 4]; B c(.25) [3, 3.25]; the pair ends with F's combine at 4."""
    assert _pair("FB", (2.0, 0.5), (2.0, 0.5), 1) == pytest.approx(4.0)


def test_each_hand_over_costs_the_receiver():
    """A balanced F&B pair of one layer hands the baton over 4 times between issues and once
    when B finishes (F is then waiting): 5 hand-overs, but the last only matters where F's
    combine ended before it."""
    base = _pair("FB", (4.0, 4.0), (4.0, 4.0), 1)
    assert _pair("FB", (4.0, 4.0), (4.0, 4.0), 1, 0.1) == pytest.approx(base + 0.5)
    times = [_pair("FF", (4.0, 4.0), (4.0, 4.0), 2, h) for h in (0.0, 0.1, 0.2, 0.4)]
    assert times == sorted(times) and times[-1] > times[0]


def test_the_hand_over_fit_inverts_the_model():
    def model(h):
        return _pair("FB", (4.0, 4.0), (4.0, 4.0), 2, h)

    for h in (0.0, 0.05, 0.3):
        assert fit_hand_over(model(h), model) == pytest.approx(h, abs=1e-6)
    assert fit_hand_over(model(0.0) - 1.0, model) == 0.0  # faster than the model: no cost


def _rank_with_pair(kinds: str) -> Schedule:
    """One rank: F0 F1 B0 B1 with the middle two paired (F1, B0) or the first two (F0, F1)."""
    actions = [Action(FORWARD, 0, 0, 0), Action(FORWARD, 0, 0, 1), Action(BACKWARD, 0, 0, 0),
               Action(BACKWARD, 0, 0, 1)]
    return Schedule("t", 1, 1, 1, 2, [[0]], [actions], pairs=[[1 if kinds == "FB" else 0]])


@pytest.mark.parametrize("kinds", ["FB", "FF"])
def test_the_simulator_uses_the_baton_only_when_given_layers(kinds):
    """moe_layers_per_stage 0 keeps max(compute, all-to-all) per pair (the comparison tables'
    costs are unchanged); k > 0 charges an F&B pair its baton time, unpaired actions alike,
    and an F&F pair both forwards one after the other (the one-thread runtime has two drivers
    then: nothing of either is hidden)."""
    sched = _rank_with_pair(kinds)
    costs = CostModel(1.0, 1.0, all_to_all_cost=1.0)
    perfect = simulate(sched, costs)
    assert perfect.makespan == pytest.approx(2 * 2 + 2)  # two unpaired (C + A), a pair max(2, 2)
    for layers in (1, 2):
        result = simulate(sched, replace(costs, moe_layers_per_stage=layers))
        extra = 0.0 if kinds == "FB" else 2.0  # F&F: C + A more than max(2, 2)
        assert result.makespan == pytest.approx(perfect.makespan + extra)
        assert result.exposed_all_to_all == [pytest.approx(2 + extra)]
    with pytest.raises(ValueError, match="moe_layers_per_stage"):
        simulate(sched, replace(costs, moe_layers_per_stage=-1))
