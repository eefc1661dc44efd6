"""V-Half's compressed periodic pattern (schedules/v_pattern.py), the seed of the v-half search."""

from __future__ import annotations

import pytest

from megatron_chimera.schedules.actions import Schedule
from megatron_chimera.schedules.list_scheduler import replay
from megatron_chimera.schedules.lowering import lower
from megatron_chimera.schedules.v_pattern import pattern_slots, v_half_order
from megatron_chimera.schedules.validate import validate, validate_lowered
from megatron_chimera.schedules.vshape import chunk_costs, v_placement
from megatron_chimera.schedules.weight_fill import peak_live


def _schedule(d: int, n: int) -> Schedule:
    return Schedule("v-half", d, 2 * d, 1, n, [v_placement(d)], v_half_order(d, n, v_placement(d)),
                    split_backward=True)


@pytest.mark.parametrize("d", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("n", [1, 3, 8, 12])
def test_orders_are_valid_and_hold_half_of_1f1b(d, n):
    """Every F/B/W once, no deadlock, NCCL rules met, at most D//2 + 1 activations per rank
    (half-size chunks count 0.5: 2 (D//2 + 1) chunks)."""
    schedule = _schedule(d, n)
    validate(schedule)
    validate_lowered(lower(schedule))
    assert sum(map(len, schedule.actions)) == 6 * d * n
    assert max(peak_live(actions) for actions in schedule.actions) <= 2 * (d // 2 + 1)


def test_the_pattern_repeats_every_six_slots_without_collisions():
    slots = pattern_slots(8, 4)
    placement = v_placement(8)
    for rank in range(8):
        mine = [t for a, t in slots.items() if placement[a.stage] == rank]
        assert len(mine) == len(set(mine)) == 4 * 4  # F, B of two chunks per micro-batch
        assert len({t % 6 for t in mine}) == 4  # two of every six slots left for the W's


@pytest.mark.parametrize("n,figures", [
    (32, {(1, 1, 1): 104.5, (1, 2, 1): 160, (1, 1.5, 0.5): 118.5}),
    (8, {(1, 1, 1): 32.5}),
])
def test_reproduces_the_published_v_half_figures(n, figures):
    """D=8 in our simulator (issue 30's table: V-Half 32.5 at N=8, 104.5 / 160 / 118.5 at N=32;
    units of one F on L/D layers, a chunk costs half)."""
    schedule = _schedule(8, n)
    for costs, makespan in figures.items():
        stage_costs = chunk_costs(costs, 16)
        start = replay(schedule.actions, schedule.placement, stage_costs)
        durations = stage_costs.durations()
        assert max(t + durations[a.kind][a.stage] for a, t in start.items()) == makespan
