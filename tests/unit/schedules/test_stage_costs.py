"""Per-stage costs: the three forms of --chimera-zb-costs, round trips, errors naming the flag."""

from __future__ import annotations

import argparse
import json

import pytest

from megatron_chimera.schedules.costs import StageCosts, costs_text, load_costs, parse_costs
from megatron_chimera.schedules.registry import ChimeraZBOptions, add_schedule_arguments, get_spec
from megatron_chimera.schedules.simulate import CostModel

PER_STAGE = StageCosts((1.5, 1.0, 1.0, 2.0), (2.0, 1.5, 1.5, 3.0), (0.5, 0.75, 0.75, 1.0), 0.1)


def test_three_forms():
    assert parse_costs("1,1.5,0.5") == (1.0, 1.5, 0.5)
    assert parse_costs("1,2,1;3,4,2") == StageCosts((1.0, 3.0), (2.0, 4.0), (1.0, 2.0))
    assert parse_costs("1,2,1; 3,4,2 ;p2p=0.25").p2p == 0.25
    assert parse_costs(PER_STAGE.to_text()) == PER_STAGE


def test_file_forms(tmp_path):
    plain = tmp_path / "costs.json"
    plain.write_text(json.dumps(PER_STAGE.to_dict()))
    assert parse_costs(f"@{plain}") == PER_STAGE
    records = tmp_path / "records.json"  # e.g. a list of records, the first with stage costs
    records.write_text(json.dumps([{"schedule": "x"}, {"stage_costs": PER_STAGE.to_dict()}]))
    assert load_costs(str(records)) == PER_STAGE
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"stage_costs": {"F": [1], "B": [2], "W": [1]}}))
    assert load_costs(str(wrapped)) == StageCosts((1.0,), (2.0,), (1.0,))


@pytest.mark.parametrize("text,message", [
    ("1,2", "three positive numbers"),
    ("1,x,1", "F,B,W numbers"),
    ("1,0,1", "three positive numbers"),
    ("1,2,1;p2p=x", "p2p=T needs a number"),
    ("p2p=1;", "at least one F,B,W triple"),
    ("@/nonexistent/costs.json", "cannot read"),
])
def test_errors_name_the_flag(text, message):
    with pytest.raises(ValueError, match=message) as info:
        parse_costs(text)
    assert "--chimera-zb-costs" in str(info.value)


def test_bad_files_name_the_flag(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="--chimera-zb-costs: .* is not valid JSON"):
        parse_costs(f"@{bad}")
    bad.write_text(json.dumps({"F": [1, 1], "B": [1], "W": [1, 1]}))
    with pytest.raises(ValueError, match="one entry per stage"):
        parse_costs(f"@{bad}")
    bad.write_text(json.dumps({"F": [1], "B": [1]}))
    with pytest.raises(ValueError, match="lacks \\['W'\\]"):
        parse_costs(f"@{bad}")
    bad.write_text(json.dumps({"F": [1], "B": [-1], "W": [1]}))
    with pytest.raises(ValueError, match="every B must be a positive"):
        parse_costs(f"@{bad}")


def test_broadcast_and_stage_count_checks():
    one = StageCosts((1.0,), (2.0,), (1.0,), 0.5)
    assert StageCosts.of(one, 3) == StageCosts.uniform(1, 2, 1, 3, p2p=0.5)
    assert StageCosts.of((1, 2, 1), 2) == StageCosts.uniform(1, 2, 1, 2)
    with pytest.raises(ValueError, match="--chimera-zb-costs: the costs have 4 stages"):
        StageCosts.of(PER_STAGE, 8)
    with pytest.raises(ValueError, match="--chimera-zb-costs: the costs have 4 stages"):
        get_spec("chimera-zb").build(8, 16, ChimeraZBOptions(costs=PER_STAGE))


def test_flags_round_trip_through_the_registry(tmp_path):
    """to_flags writes per-stage costs inline; parsing the flags gives the same options."""
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(PER_STAGE.to_dict()))
    parser = argparse.ArgumentParser()
    add_schedule_arguments(parser)
    spec = get_spec("chimera-zb")
    options = spec.options_from(parser.parse_args(
        ["--chimera-zb-costs", f"@{path}", "--chimera-zb-fallback", "refuse"]))
    assert options == ChimeraZBOptions(costs=PER_STAGE, fallback="refuse")
    flags = spec.to_flags(options)
    assert spec.options_from(parser.parse_args(flags[2:])) == options
    assert costs_text((1.0, 1.5, 0.5)) == "1.0,1.5,0.5"
    assert spec.label(options) == "chimera-zb"  # costs and policies are not variants


def test_cost_model_splits_or_merges_the_backward():
    split, whole = PER_STAGE.cost_model(True), PER_STAGE.cost_model(False)
    assert split == CostModel(PER_STAGE.forward, (2.5, 2.25, 2.25, 4.0), PER_STAGE.weight,
                              p2p_alpha=0.1)
    assert whole.weight_cost == 0.0 and whole.backward_cost == split.backward_cost


def test_rounding_and_quantising():
    noisy = StageCosts((1.0004, 0.9996), (1.4987, 1.5012), (0.5003, 0.4991))
    assert noisy.quantized(0.05) == StageCosts((1.0, 1.0), (1.5, 1.5), (0.5, 0.5))
    assert noisy.rounded(3).forward == (1.0, 1.0)
    tiny = StageCosts((1.0,), (1.0,), (1e-6,))
    assert tiny.quantized(0.05).weight == (0.05,)  # never rounds a time away


def test_profiled_costs_keep_the_given_message_time_in_their_unit():
    measured = StageCosts((0.02, 0.03), (0.04, 0.04), (0.01, 0.01))  # seconds, mean F 25 ms
    given = parse_costs("1,2,1;1,2,1;p2p=0.02")  # relative to F = 1
    assert measured.with_message_time_of(given).p2p == pytest.approx(0.02 * 0.025)
    assert measured.with_message_time_of(given).forward == measured.forward
    for none in (None, (1.0, 2.0, 1.0), parse_costs("1,2,1;1,2,1")):
        assert measured.with_message_time_of(none) == measured


def test_profiled_rebuild_builds_for_the_given_message_time(monkeypatch):
    """ProfileRebuild: F/B/W as measured (agreed over the ranks), p2p from --chimera-zb-costs."""
    from types import SimpleNamespace

    from megatron_chimera.pipeline import profiling
    from megatron_chimera.schedules import build_schedule

    measured = StageCosts.uniform(0.01, 0.02, 0.01, 4)
    monkeypatch.setattr(profiling, "agree_stage_costs", lambda *args: measured)
    options = ChimeraZBOptions(costs=parse_costs("1,2,1;p2p=0.5"))
    profile = profiling.ProfileRebuild(build_schedule("chimera-zb", 4, 8), options, 1)
    executor = SimpleNamespace(action_timer=None)
    profile.start_iteration(executor)
    report = profile.finish_iteration(executor)
    assert report.costs.p2p == pytest.approx(0.005)  # 0.5 F of the measured 10 ms
    expected = build_schedule("chimera-zb", 4, 8, costs=report.costs.quantized())
    assert report.rebuilt.schedule.actions == expected.actions
    assert expected.actions != build_schedule(
        "chimera-zb", 4, 8, costs=measured.quantized()).actions  # the message time mattered


# ---------------------------------------------------------------- MoE all-to-all times
def test_all_to_all_is_paid_by_every_unpaired_f_and_b():
    """1F1B, uniform stages, no messages: the makespan is (N + D - 1)(F + B) in closed form; an
    all-to-all time A per direction makes it (N + D - 1)(F + B + 2A), split backward or not."""
    from megatron_chimera.schedules import build_schedule
    from megatron_chimera.schedules.simulate import simulate
    d, n, f, b, w, a = 4, 8, 1.0, 1.5, 0.5, 0.75
    schedule = build_schedule("1f1b", d, n)
    plain = simulate(schedule, StageCosts.uniform(f, b, w, d).cost_model(False))
    moe = StageCosts.uniform(f, b, w, d, all_to_all=a)
    charged = simulate(schedule, moe.cost_model(False))
    assert plain.makespan == pytest.approx((n + d - 1) * (f + b + w))
    assert charged.makespan == pytest.approx((n + d - 1) * (f + b + w + 2 * a))
    assert moe.durations()["F"] == (f + a,) * d and moe.durations()["W"] == (w,) * d
    split = simulate(build_schedule("zb-h1", d, n), moe.cost_model(True))
    busy = n * (f + b + w + 2 * a)  # every rank's compute and all-to-alls, W paying none
    assert split.busy == pytest.approx([busy] * d)


def test_all_to_all_round_trips_through_every_form(tmp_path):
    costs = StageCosts((1.0, 2.0), (2.0, 3.0), (1.0, 1.0), 0.5, (0.25, 0.5))
    assert StageCosts.from_dict(costs.to_dict()) == costs
    assert parse_costs(costs.to_text()) == costs
    assert parse_costs("1,2,1;2,3,1;p2p=0.5;a2a=0.3").all_to_all == (0.3, 0.3)
    assert costs.for_stages(1).all_to_all == (0.75,)
    assert costs.for_stages(4).all_to_all == (0.125, 0.125, 0.25, 0.25)
    assert costs.scaled(2).all_to_all == (0.5, 1.0)
    assert StageCosts.of(StageCosts.uniform(1, 2, 1, 1, all_to_all=0.5), 3).all_to_all == (0.5,) * 3
    assert "all-to-all" in costs.summary(1.0, "s")
    with pytest.raises(ValueError, match="a2a"):
        StageCosts((1.0, 2.0), (2.0, 3.0), (1.0, 1.0), 0.0, (0.25,))
    with pytest.raises(ValueError, match="a2a"):
        parse_costs("1,2,1;a2a=x")
