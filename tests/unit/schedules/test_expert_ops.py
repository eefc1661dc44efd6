"""The expert all-to-alls as ops of the lowered schedule (schedules/expert_ops.py): the order
the one-thread paired runtime issues them in, and validate_lowered's proof that every member
of an expert-parallel group issues them in one order."""

from __future__ import annotations

import pytest

from megatron_chimera.errors import ScheduleError
from megatron_chimera.schedules import build_schedule
from megatron_chimera.schedules.actions import BACKWARD, FORWARD
from megatron_chimera.schedules.device_sync_check import (
    Exchange,
    ExpertComm,
    _World,
    check_sync_anywhere,
)
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


def _experts(lowered, recompute=False, overlap=True, size=2):
    ops = {r: expert_ops(lowered, r, LAYOUTS, recompute, overlap)
           for r in range(lowered.schedule.num_ranks)}
    return ExpertComm(ops, size)


@pytest.mark.parametrize("name", ["chimera", "chimera-zb"])
def test_the_device_sync_proof_covers_the_all_to_alls(name):
    """The all-to-alls (odd MoE-layer counts, a stage without MoE layers, a checkpointed
    region; recomputation and overlap on and off) in the lowered lists with p2p, gradient
    collectives, W data-parallel replicas and T tensor ranks (EP over replicas or over tensor
    ranks): no device-wide sync can hang, and the collectives' plan is the p2p-only one (an EP
    group runs one list, so it reaches every all-to-all its stopped member posted)."""
    lowered = lower(build_schedule(name, 4, 8, overlap_moe_expert_parallel_comm=True))
    alone = validate_lowered(lowered)
    for recompute, overlap in ((False, True), (True, True), (True, False)):
        experts = _experts(lowered, recompute, overlap)
        assert any(isinstance(op, Exchange) for op in _World(lowered, (), 2, 1, experts).lists[1])
        plan = validate_lowered(lowered, experts=experts)
        assert plan == alone
        for data_parallel, tensor_parallel in ((1, 2), (2, 2)):
            check_sync_anywhere(lowered, None, plan.plans, data_parallel, tensor_parallel,
                                experts)
    forward = lower(lowered.schedule, True)
    validate_lowered(forward, experts=ExpertComm(
        {r: expert_ops(forward, r, LAYOUTS) for r in range(4)}, 2))


def test_an_all_to_all_waits_for_its_whole_ep_group():
    """The model blocks on an all-to-all: with replica 1's rank 0 stopped at its start, replica
    0's rank 0 posts an all-to-all but cannot go past the next operation that consumes it (a
    device sync there would hang on it)."""
    lowered = _chimera()
    world = _World(lowered, (), 2, 1, _experts(lowered))
    world.advance(frozen=(1, 0, 0))
    head = world.heads[(0, 0, 0)]
    assert head < len(world.lists[0]), "rank 0 ran to its end without replica 1"
    waited = world.after[0][head]
    assert waited is not None and isinstance(world.lists[0][waited], Exchange)
    pending = [text for text, name in world.unmatched((0, 0, 0)) if name is None]
    assert pending and all("all-to-all" in t and "replica 1" in t for t in pending), pending


def test_all_to_alls_out_of_step_order_are_refused():
    """A rank's all-to-alls issued in another order than its lowered compute steps: the proof
    names the all-to-all and the later action."""
    lowered = _chimera()
    experts = _experts(lowered)
    ops = list(experts.ops[1])
    late = next(i for i, op in enumerate(ops) if op.action != ops[0].action
                and op.action.kind == FORWARD)
    moved = [ops[late]] + ops[:late] + ops[late + 1:]
    with pytest.raises(ScheduleError, match=rf"rank 1: all-to-all {ops[0].short()} is issued "
                                            rf"after those of a later action"):
        validate_lowered(lowered, experts=ExpertComm({**experts.ops, 1: moved}, 2))

