"""Megatron's interleaved 1F1B: chunk placement, order, bubble and size errors."""

import pytest

from megatron_chimera.schedules import build_schedule
from megatron_chimera.schedules.simulate import CostModel, simulate
from megatron_chimera.schedules.validate import validate


def test_placement_and_weight_copies():
    sched = build_schedule("interleaved", 4, 8, virtual_pipeline_size=3)
    validate(sched)
    assert sched.num_stages == 12
    assert sched.placement == [[s % 4 for s in range(12)]]
    assert sched.stages_of_rank(1) == [1, 5, 9]
    assert sched.weight_copies() == [3, 3, 3, 3]


def test_first_rank_order_follows_megatron_chunking():
    sched = build_schedule("interleaved", 2, 4, virtual_pipeline_size=2)
    # rank 0 warms up with 2*(D-1) + (v-1)*D = 4 forwards: chunk 0 for mbs 0,1 then chunk 1
    assert [a.short() for a in sched.actions[0][:6]] == [
        "F0.0.0", "F0.0.1", "F0.2.0", "F0.2.1", "F0.0.2", "B0.2.0"
    ]
    # the first backward of every rank runs its last chunk
    for rank, order in enumerate(sched.actions):
        first_b = next(a for a in order if a.kind == "B")
        assert first_b.stage == 2 + rank


def test_n_equal_d_runs_all_forwards_first():
    sched = build_schedule("interleaved", 4, 4, virtual_pipeline_size=2)
    for order in sched.actions:
        kinds = "".join(a.kind for a in order)
        assert kinds == "F" * 8 + "B" * 8


@pytest.mark.parametrize("D,N,v", [(2, 4, 2), (4, 8, 2), (4, 16, 4), (8, 32, 2), (8, 16, 3)])
def test_bubble_shrinks_by_v(D, N, v):
    # a chunk is 1/v of a stage: F = 1/v, B = 2/v; Megatron's bubble is (D-1)(F+B)/v
    result = simulate(
        build_schedule("interleaved", D, N, virtual_pipeline_size=v), CostModel(1.0 / v, 2.0 / v)
    )
    assert result.makespan == pytest.approx(3 * N + 3 * (D - 1) / v)
    plain = simulate(build_schedule("1f1b", D, N), CostModel(1.0, 2.0))
    assert result.makespan < plain.makespan


@pytest.mark.parametrize(
    "D,N,v,flag",
    [
        (4, 6, 2, "--num-microbatches"),
        (4, 2, 2, "--num-microbatches"),
        (4, 8, 1, "--num-virtual-stages-per-pipeline-rank"),
    ],
)
def test_invalid_sizes_name_the_flag(D, N, v, flag):
    with pytest.raises(ValueError, match=flag):
        build_schedule("interleaved", D, N, virtual_pipeline_size=v)
