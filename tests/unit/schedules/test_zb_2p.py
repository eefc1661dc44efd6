"""ZB-2p (schedules/zb_2p.py): at most 2D live activations per rank and, on unit costs, no bubble
but the pipeline's fill (makespan 3N + D - 1); with W < B it is shorter than ZB-H1, whose bubble
is (D-1)(F+B-W)."""

import pytest

from megatron_chimera.schedules import build_schedule
from megatron_chimera.schedules.list_scheduler import replay
from megatron_chimera.schedules.validate import validate
from megatron_chimera.schedules.weight_fill import peak_live
from megatron_chimera.schedules.zero_bubble import split_costs


def makespan(schedule, costs=(1.0, 1.0, 1.0)) -> float:
    stage_costs = split_costs(costs, schedule.num_stages)
    start = replay(schedule.actions, schedule.placement, stage_costs)
    return max(t + stage_costs.durations()[a.kind][a.stage] for a, t in start.items())


@pytest.mark.parametrize("d,n", [(4, 8), (4, 12), (8, 24), (3, 2)])
def test_zb_2p_memory_and_unit_cost_makespan(d, n):
    schedule = build_schedule("zb-2p", d, n)
    validate(schedule)
    assert max(peak_live(order) for order in schedule.actions) <= 2 * d
    if n < 2 * d - 1:  # too few micro-batches to fill the first rank's wait for its first B
        return
    assert makespan(schedule) == pytest.approx(3 * n + d - 1)
    costs = (1.0, 1.0, 0.5)  # W shorter than B: ZB-H1's bubble (D-1)(F+B-W) exceeds ZB-2p's
    assert makespan(build_schedule("zb-h1", d, n), costs) > makespan(schedule, costs)
