"""Never slower than the unsplit schedules: the fallback decision, the config-time check, the
rebuild for measured costs, and the cost grid's pinned points."""

from __future__ import annotations

import pytest

from megatron_chimera.config import ConfigError
from megatron_chimera.schedules import build_schedule
from megatron_chimera.schedules.cost_grid import grid_point
from megatron_chimera.schedules.costs import StageCosts
from megatron_chimera.schedules.fallback import FallbackRefused, decide, of_schedule
from megatron_chimera.schedules.measured import rebuild_for_costs
from megatron_chimera.schedules.registry import ChimeraZBOptions, ZBH1Options
from megatron_chimera.schedules.simulate import simulate
from megatron_chimera.training.arguments import parse_args_and_schedule

SMALL_W = StageCosts.uniform(1.0, 0.5, 0.125, 8)  # B/F 0.5, W/B 0.25: splitting gains little
BASE = ("--num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 1 --global-batch-size 32 --lr 1e-3 --train-iters 20 --mock-data "
        "--vocab-size 500 --pipeline-model-parallel-size 8").split()


# ZB-H1's closed-form order loses to 1F1B under these per-stage costs (D=4, N=8: 49 vs 47.7)
SKEWED = StageCosts((1.5, 2.8, 1.6, 1.0), (0.6, 0.6, 0.5, 0.7), (0.6, 1.8, 0.2, 2.9))


# BitPipe-ZB (two weight copies, as Chimera) loses to Chimera at D=8, N=32 under these costs
TINY_W = StageCosts.uniform(1.0, 2.0, 0.1, 8)


def test_bitpipe_zb_loses_to_chimera_and_falls_back():
    split = of_schedule(build_schedule("bitpipe-zb", 8, 32, costs=TINY_W), TINY_W)
    decision = decide(split, TINY_W)
    assert decision.fell_back and decision.chosen.label == "chimera/slot-merge"
    # the figures are the simulator's, under the same costs (whole backward B + W unsplit)
    chimera = build_schedule("chimera", 8, 32)
    assert decision.chosen.makespan == simulate(chimera, TINY_W.cost_model(False)).makespan
    assert decision.chosen.makespan < split.makespan
    assert "bitpipe-zb 121.5 | 1f1b 120.9 | chimera/slot-merge 111.8 | bitpipe 133.9" == (
        decision.figures())
    with pytest.raises(FallbackRefused, match="bitpipe-zb is predicted slower than chimera/"
                                              "slot-merge under the costs \\(121.5 vs 111.8"):
        decide(split, TINY_W, policy="refuse")


@pytest.mark.parametrize("name", ["zb-h1", "zbv"])
def test_one_weight_copy_never_falls_back_to_chimeras_two(name):
    """ZB-H1 and ZBV hold one weight copy per rank: Chimera, predicted faster, may not replace
    them (the figures say why), nor make ``refuse`` fail; 1F1B (one copy) still could."""
    split = of_schedule(build_schedule(name, 8, 32, costs=SMALL_W), SMALL_W)
    decision = decide(split, SMALL_W)
    chimera = decision.alternatives[1]
    assert chimera.label == "chimera/slot-merge" and chimera.makespan < split.makespan
    assert not decision.fell_back
    assert chimera.note == "needs 2 weight copies > 1" and decision.alternatives[0].usable
    assert "chimera/slot-merge 58 (needs 2 weight copies > 1)" in decision.figures()
    assert not decide(split, SMALL_W, policy="refuse").fell_back


def test_a_running_job_only_switches_on_its_placement():
    split = of_schedule(build_schedule("zb-h1", 8, 32, costs=SMALL_W), SMALL_W)
    decision = decide(split, SMALL_W, same_placement=True)
    assert not decision.fell_back  # 1F1B (same placement) is slower; Chimera needs a restart
    split = of_schedule(build_schedule("bitpipe-zb", 8, 32, costs=TINY_W), TINY_W)
    decision = decide(split, TINY_W, same_placement=True)
    assert not decision.fell_back
    assert "chimera/slot-merge 111.8 (other placement: needs a restart)" in decision.figures()
    closed = of_schedule(build_schedule("zb-h1", 4, 8), SKEWED)
    decision = decide(closed, SKEWED, same_placement=True)
    assert decision.fell_back and decision.chosen.label == "1f1b"
    assert (closed.makespan, decision.chosen.makespan) == pytest.approx((49.0, 47.7))
    # rebuilt for those costs, ZB-H1 keeps its split order: 1F1B is one of its seeds
    report = rebuild_for_costs(build_schedule("zb-h1", 4, 8), ZBH1Options(), SKEWED)
    assert not report.decision.fell_back and report.rebuilt.makespan <= 47.7


def test_never_needs_more_memory():
    capped = build_schedule("chimera-zb", 8, 32, max_inflight=4, costs=SMALL_W)
    decision = decide(of_schedule(capped, SMALL_W), SMALL_W)
    assert not decision.fell_back  # both unsplit schedules hold 8 activations on some rank
    assert all(p.note == "needs 8 live activations > 4" for p in decision.alternatives)


def test_chimera_zb_at_its_default_cap_never_loses_to_chimera():
    """Chimera's order with W right after B is one of Chimera-ZB's seeds, so the fallback is for
    capped or exotic cases; check it over the cost grid's corners."""
    for b, w in ((0.5, 0.125), (2.0, 0.5), (2.0, 2.0)):
        costs = StageCosts((1.5,) + (1.0,) * 6 + (1.5,), (b,) * 8, (w,) * 8)
        split = of_schedule(build_schedule("chimera-zb", 8, 16, costs=costs), costs)
        assert not decide(split, costs).fell_back


def parse(*flags: str):
    return parse_args_and_schedule([*BASE, *flags], world_size=8)


def test_config_time_fallback_and_refusal():
    config, schedule = parse("--pipeline-schedule", "bitpipe-zb", "--chimera-zb-costs", "1,2,0.1")
    assert config.parallel.pipeline_schedule == "bitpipe-zb"
    assert schedule.name == "chimera" and not schedule.split_backward
    assert schedule.meta["replaces"].startswith("bitpipe-zb (predicted slower under "
                                                "--chimera-zb-costs: bitpipe-zb ")
    assert config.training.profile_iterations == 0  # costs fixed by hand
    with pytest.raises(ConfigError, match="--chimera-zb-fallback refuse: bitpipe-zb is "
                                          "predicted slower than chimera/slot-merge"):
        parse("--pipeline-schedule", "bitpipe-zb", "--chimera-zb-costs", "1,2,0.1",
              "--chimera-zb-fallback", "refuse")
    # ZB-H1 (one weight copy) is kept although Chimera (two) is predicted faster
    _, schedule = parse("--pipeline-schedule", "zb-h1", "--chimera-zb-costs", "1,0.5,0.125")
    assert schedule.name == "zb-h1" and "replaces" not in schedule.meta
    # Chimera-ZB for the same costs wins: kept
    _, schedule = parse("--chimera-split-backward", "--chimera-zb-costs", "1,0.5,0.125")
    assert schedule.name == "chimera-zb" and "replaces" not in schedule.meta


def test_backward_halving_is_refused_with_what_to_run():
    """The paper's third concatenation runs (tests/distributed/test_runtime.py) but needs half
    the --micro-batch-size: the flag value says so before any process group."""
    with pytest.raises(ConfigError, match="--chimera-concat backward-halving: .* run "
                                          "--chimera-concat forward-doubling with half the "
                                          "--micro-batch-size"):
        parse("--chimera-pipes", "2", "--chimera-concat", "backward-halving")
    _, schedule = parse("--chimera-pipes", "2", "--chimera-concat", "forward-doubling")
    assert schedule.meta["concat"] == "forward-doubling"


def test_rebuild_for_measured_costs():
    running = build_schedule("chimera-zb", 8, 32)
    measured = StageCosts.uniform(1.0, 2.0, 0.5, 8).scaled(1e-3)  # seconds
    report = rebuild_for_costs(running, ChimeraZBOptions(), measured)
    assert report.changed and not report.decision.fell_back
    again = rebuild_for_costs(running, ChimeraZBOptions(), measured)
    assert again.schedule.actions == report.schedule.actions  # deterministic: same on every rank
    assert report.rebuilt.makespan < report.before.makespan
    assert report.predicted_gain == pytest.approx(1 - report.rebuilt.makespan /
                                                  report.before.makespan)
    line = report.line()
    assert line.startswith(" measured F/B/W per stage [ms]: s0 1/2/0.5, s1 1/2/0.5")
    assert "rebuilt chimera-zb for them: predicted iteration 131.5 -> 120.5 ms" in line
    # the rebuilt order is built for the measured costs quantised to 5% of F
    assert report.schedule.meta["costs"] == [1e-3, 2e-3, 5e-4]


def test_rebuild_keeps_the_running_order_when_it_is_not_slower():
    running = build_schedule("chimera-zb", 8, 16)
    report = rebuild_for_costs(running, ChimeraZBOptions(), StageCosts.uniform(1, 1, 1, 8))
    assert not report.changed and report.predicted_gain == 0.0
    assert "kept the running chimera-zb order" in report.line()
    with pytest.raises(ValueError, match="does not split the backward"):
        rebuild_for_costs(build_schedule("1f1b", 8, 16), None, SMALL_W)


def test_rebuild_of_zb_h1_on_its_placement():
    running = build_schedule("zb-h1", 8, 32)
    report = rebuild_for_costs(running, ZBH1Options(), SMALL_W)
    assert report.schedule.placement == running.placement
    assert "chimera/slot-merge 5.8e+04 ms (needs 2 weight copies > 1)" in report.line()


@pytest.mark.parametrize("name,d,n,costs", [
    ("chimera-zb", 8, 32, StageCosts.uniform(1.0, 2.0, 0.5, 8)),  # rebuilt split order
    ("chimera-zb", 4, 8, SKEWED),
    ("zb-h1", 4, 8, SKEWED),
    ("zb-h1", 4, 8, StageCosts.uniform(1.0, 0.5, 0.125, 4)),  # kept (1F1B is not faster)
])
def test_a_rebuilt_schedule_lowers_under_nccl_rules(name, d, n, costs):
    """What a running job switches to is lowered again by its new executors: it must keep
    NCCL's rules (validate_lowered) and need no direction the running schedule lacked (the
    process groups are the placement's)."""
    from megatron_chimera.schedules.lowering import lower
    from megatron_chimera.schedules.validate import validate_lowered

    running = build_schedule(name, d, n)
    options = ChimeraZBOptions() if name == "chimera-zb" else ZBH1Options()
    report = rebuild_for_costs(running, options, costs)
    for forward_only in (False, True):
        new, old = lower(report.schedule, forward_only), lower(running, forward_only)
        validate_lowered(new)
        assert set(new.connections) <= set(old.connections)
        assert report.schedule.placement == running.placement


@pytest.mark.parametrize("n,b_over_f,w_over_b,end", [
    (32, 2.0, 0.25, 1.0), (32, 1.5, 0.5, 1.0), (32, 1.0, 0.5, 1.5), (8, 2.0, 0.5, 1.0)])
def test_cost_grid_points(n, b_over_f, w_over_b, end):
    """Built from measured costs (true +-2%): within 3% of the bound or of the best schedule
    known with the true costs, and never slower than 1F1B or Chimera slot-merge."""
    point = grid_point(8, n, b_over_f, w_over_b, end_factor=end, noise=0.02, seed=1)
    assert point.gap_to_bound <= 0.03 or point.gap_to_best_known <= 0.03, point.to_dict()
    assert point.chosen_makespan <= min(point.makespans["1f1b"], point.makespans["chimera"])
    assert point.lower_bound <= min(point.makespans.values()) + 1e-9


def test_cost_grid_measured_beats_one_one_one_where_costs_are_skewed():
    point = grid_point(8, 32, 2.0, 0.25, noise=0.02, seed=1)
    assert point.makespans["zb measured"] < 0.95 * point.makespans["zb 1:1:1"]
