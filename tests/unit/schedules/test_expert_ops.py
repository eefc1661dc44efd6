"""The expert all-to-alls as ops of the lowered schedule (schedules/expert_ops.py): the order
the one-thread paired runtime issues them in, and validate_lowered's proof that every member
of an expert-parallel group issues them in one order."""

from __future__ import annotations

import pytest

from megatron_chimera.errors import ScheduleError
from megatron_chimera.schedules import build_schedule
from megatron_chimera.schedules.actions import BACKWARD, FORWARD
from megatron_chimera.schedules.expert_ops import (
    BACKWARD_NAMES,
    FORWARD_NAMES,
    StageLayout,
    expert_ops,
)
from megatron_chimera.schedules.lowering import lower
from megatron_chimera.schedules.validate import validate_lowered

pytestmark = pytest.mark.timeout(60)

#: stage 0 one MoE layer, stage 1 three (odd counts), stage 2 none, stage 3 two in one
#: checkpointed region after a plain one
LAYOUTS = {0: StageLayout((None,)), 1: StageLayout((None, None, None)),
           3: StageLayout((None, 0, 0))}


def _chimera():
    schedule = build_schedule("chimera", 4, 8, overlap_moe_expert_parallel_comm=True)
    assert any(schedule.pairs)
    return lower(schedule, False)


def test_every_action_issues_its_layers_all_to_alls():
    """Per F: 3 per MoE layer of its stage; per B: 2 per layer, 5 per checkpointed layer (its
    replay), + 3 per layer with the executor's recomputation; none on the MoE-free stage."""
    lowered = _chimera()
    for recompute in (False, True):
        for rank in range(4):
            ops = expert_ops(lowered, rank, LAYOUTS, recompute)
            for action in lowered.compute_lists()[rank]:
                regions = LAYOUTS.get(action.stage, StageLayout(())).regions
                mine = [op.name for op in ops if op.action == action]
                if action.kind == FORWARD:
                    assert mine == list(FORWARD_NAMES) * len(regions)
                else:
                    replays = sum(r is not None for r in regions)
                    want = (len(regions) * 2 + replays * 3
                            + (len(regions) * 3 if recompute else 0))
                    assert len(mine) == want, (action, mine)
                    assert mine.count(BACKWARD_NAMES[0]) == len(regions)


def test_a_pair_interleaves_and_in_turn_does_not():
    """In an F&B pair the B's combine gradient comes first, then F's and B's alternate; with
    overlap off the halves' all-to-alls follow one another."""
    lowered = _chimera()
    rank = next(r for r, starts in enumerate(lowered.schedule.pairs) if starts)
    on = expert_ops(lowered, rank, LAYOUTS)
    off = expert_ops(lowered, rank, LAYOUTS, overlap=False)
    assert sorted(on) == sorted(off) and on != off

    def alternates(ops):
        kinds = [op.action for op in ops]
        return any(kinds[i] == kinds[i + 2] != kinds[i + 1] for i in range(len(kinds) - 2))

    assert alternates(on) and not alternates(off)
    for action in {op.action for op in on if op.action.kind == BACKWARD
                   and op.action.stage in (0, 1)}:  # cut layers: the combine's gradient first
        assert next(op for op in on if op.action == action).name == "combine.bwd"


def test_validate_lowered_rejects_a_swapped_dispatch_on_one_ep_rank():
    """Two EP ranks of one pipeline rank: their lowered all-to-alls agree; with two dispatches
    swapped on one of them validate_lowered names the position and both ops."""
    lowered = _chimera()
    ops = expert_ops(lowered, 1, LAYOUTS)
    validate_lowered(lowered, [1], expert_ops={10: ops, 11: list(ops)}, expert_groups=[[10, 11]])
    dispatches = [i for i, op in enumerate(ops) if op.name == "dispatch"]
    i = dispatches[0]
    j = next(k for k in dispatches if ops[k].action != ops[i].action)  # another action's
    swapped = list(ops)
    swapped[i], swapped[j] = swapped[j], swapped[i]
    with pytest.raises(ScheduleError, match=rf"all-to-all {i} is .*:dispatch on rank 10 but "):
        validate_lowered(lowered, [1], expert_ops={10: ops, 11: swapped},
                         expert_groups=[[10, 11]])
