"""Sequence-sliced pipelines in the schedule IR: the slice-order rule is enforced by the
validator, the generators' orders keep it (and NCCL's rules once lowered), the simulator costs
slices by their attention work, and at D=8 with 4 sequences per iteration (F = B) slicing brings
Chimera's bubble under 20% where unsliced 1F1B idles 64% of the time."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_chimera.errors import ScheduleError
from megatron_chimera.schedules import build_schedule
from megatron_chimera.schedules.actions import BACKWARD, Action
from megatron_chimera.schedules.lowering import lower
from megatron_chimera.schedules.simulate import CostModel, simulate
from megatron_chimera.schedules.slices import (
    balanced_slice_lengths,
    slice_order_errors,
    slice_work,
    sliced_schedule,
)
from megatron_chimera.schedules.validate import validate, validate_lowered

EQUAL = CostModel(forward_cost=1.0, backward_cost=1.0)


@pytest.mark.parametrize("name,ranks,sequences,slices", [
    ("1f1b", 4, 2, 2), ("1f1b", 4, 3, 4), ("chimera", 4, 2, 4), ("chimera", 8, 4, 2),
    ("zb-h1", 4, 2, 3), ("chimera-zb", 4, 2, 4)])
def test_generated_orders_are_valid_and_keep_slice_order(name, ranks, sequences, slices):
    schedule = sliced_schedule(name, ranks, sequences, slices, attention_fraction=0.4)
    validate(schedule)
    validate_lowered(lower(schedule), gradient_collectives=False)
    assert schedule.num_microbatches == sequences * slices
    assert slice_order_errors(schedule) == []
    again = type(schedule).from_json(schedule.to_json())
    assert again.sequence_slices == slices


def test_validator_refuses_a_backward_before_the_next_slices():
    schedule = sliced_schedule("1f1b", 2, 1, 2)
    actions = [list(a) for a in schedule.actions]
    last = actions[1]  # the last stage: swap its two backwards (slice 0 first: wrong)
    i, j = (last.index(Action(BACKWARD, 0, 1, m)) for m in (0, 1))
    last[i], last[j] = last[j], last[i]
    broken = dataclasses.replace(schedule, actions=actions)
    with pytest.raises(ScheduleError, match="slice order"):
        validate(broken)


def test_slice_work_grows_along_the_sequence_and_balanced_lengths_shrink():
    work = slice_work(4, 0.5)
    assert sum(work) == pytest.approx(1.0)
    assert work == sorted(work) and work[-1] > work[0]
    lengths = balanced_slice_lengths(4096, 4, 0.5)
    assert sum(lengths) == 4096 and lengths == sorted(lengths, reverse=True)
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n / 4096)
    per_slice = [0.5 * (b - a) + 0.5 * (b * b - a * a) for a, b in zip(bounds, bounds[1:])]
    assert max(per_slice) - min(per_slice) < 1e-3  # equal compute


def test_simulator_costs_later_slices_more():
    schedule = sliced_schedule("1f1b", 2, 1, 4, attention_fraction=0.6)
    events = [e for e in simulate(schedule, EQUAL).events if e.rank == 0 and e.kind == "F"]
    durations = [e.end - e.start for e in sorted(events, key=lambda e: e.microbatch)]
    assert durations == pytest.approx(slice_work(4, 0.6))


def test_sliced_chimera_bubble_at_d8_with_four_sequences():
    """F = B, D = 8, 4 sequences: unsliced 1F1B idles (D-1)/(N+D-1) = 64%; sliced into 8
    (32 pipeline units) Chimera stays under 20% (and below sliced 1F1B)."""
    unsliced = simulate(build_schedule("1f1b", 8, 4), EQUAL).bubble_ratio
    assert unsliced == pytest.approx(7 / 11)
    chimera = simulate(sliced_schedule("chimera", 8, 4, 8), EQUAL).bubble_ratio
    one_f_one_b = simulate(sliced_schedule("1f1b", 8, 4, 8), EQUAL).bubble_ratio
    print(f"\nD=8, 4 sequences, F=B: 1F1B {unsliced:.1%}, sliced (k=8) 1F1B "
          f"{one_f_one_b:.1%}, sliced Chimera {chimera:.1%}")
    assert chimera <= 0.20
    assert chimera < one_f_one_b


def test_split_backward_fills_the_sliced_bubbles():
    """Chimera-ZB's order on slices (W = half the backward) idles less than sliced Chimera's."""
    costs = CostModel(forward_cost=1.0, backward_cost=1.0, weight_cost=0.5)
    zb = simulate(sliced_schedule("chimera-zb", 8, 4, 4), costs).bubble_ratio
    plain = simulate(sliced_schedule("chimera", 8, 4, 4), EQUAL).bubble_ratio
    assert zb < plain


def test_uniform_stage_costs_give_the_ratio_built_order():
    """``stage_costs`` uniform at F : B : W = 1 : 0.5 : 0.5 is the default order (the ratios)."""
    for name in ("zb-h1", "chimera-zb"):
        default = sliced_schedule(name, 4, 2, 4, attention_fraction=0.4)
        measured = sliced_schedule(name, 4, 2, 4, attention_fraction=0.4,
                                   stage_costs=((1.0,) * 4, (0.5,) * 4, (0.5,) * 4))
        assert measured.actions == default.actions


@pytest.mark.parametrize("name", ["zb-h1", "chimera-zb"])
def test_profile_rebuild_of_a_sliced_order_uses_the_measured_stage_costs(name):
    """rebuild_for_costs on a sliced split-backward order: the sliced generator again, for the
    measured per-stage costs (backward 3x the forward, W a tenth of it, where the running order
    assumed 1 : 0.5 : 0.5): a valid sliced order with the same slices, never slower than the
    running one under those costs; for these costs strictly faster (the simulator, which
    charges each slice its work). For costs where the rebuilt order is slower the running one
    is kept."""
    from megatron_chimera.schedules.costs import StageCosts
    from megatron_chimera.schedules.measured import rebuild_for_costs
    from megatron_chimera.schedules.simulate import simulate

    running = sliced_schedule(name, 4, 2, 4, attention_fraction=0.5)
    costs = StageCosts.uniform(1.0, 2.7, 0.3, 4)
    report = rebuild_for_costs(running, None, costs)
    new = report.schedule
    validate(new)
    assert (new.sequence_slices, new.num_microbatches, new.placement, new.name) == (
        4, running.num_microbatches, running.placement, running.name)
    assert new.meta["slice_work"] == running.meta["slice_work"]
    model = costs.cost_model(True)
    assert simulate(new, model).makespan == pytest.approx(report.decision.chosen.makespan)
    assert report.rebuilt.makespan < report.before.makespan, report.line()
    assert report.changed and not report.decision.fell_back
    if name == "chimera-zb":  # a heavy first stage: the greedy rebuild is slower here
        kept = rebuild_for_costs(running, None, StageCosts((2.0, 1, 1, 1), (2.0, 1, 1, 1),
                                                           (0.5,) * 4))
        assert kept.rebuilt.makespan > kept.before.makespan and not kept.changed


def test_stage_time_recorder_counts_slices_as_whole_sequences():
    """A sliced order's slice times are divided by the slice's share of the work."""
    from megatron_chimera.pipeline.profiling import StageTimeRecorder
    from megatron_chimera.schedules.actions import Action

    recorder = StageTimeRecorder([0.25, 0.75])
    recorder(Action("F", 0, 1, 0), 0.5)  # slice 0: 0.5 s = a whole sequence's 2 s
    recorder(Action("F", 0, 1, 3), 1.5)  # slice 1 of sequence 1: 1.5 s -> 2 s
    assert recorder.medians() == {("F", 1): pytest.approx(2.0)}
