"""The validator accepts every generated schedule and rejects each kind of hand-broken one."""

import copy

import pytest

from megatron_chimera.schedules import Action, Schedule, build_schedule
from megatron_chimera.schedules.validate import ScheduleError, validate

GENERATED = [
    ("gpipe", 4, 6, {}),
    ("1f1b", 4, 6, {}),
    ("1f1b", 4, 2, {}),
    ("interleaved", 4, 8, {"virtual_pipeline_size": 2}),
    ("interleaved", 2, 6, {"virtual_pipeline_size": 3}),
    ("chimera", 4, 4, {}),
    ("chimera", 8, 32, {}),
    ("chimera", 8, 16, {"concat": "direct"}),
    ("chimera", 8, 16, {"concat": "forward-doubling"}),
    ("chimera", 8, 16, {"pipes": 4}),
]


@pytest.mark.parametrize("name,D,N,options", GENERATED)
def test_generated_schedules_are_valid(name, D, N, options):
    validate(build_schedule(name, D, N, **options))


def _chimera():
    return copy.deepcopy(build_schedule("chimera", 4, 4))


def test_rejects_missing_action():
    sched = _chimera()
    dropped = sched.actions[2].pop(3)
    with pytest.raises(ScheduleError, match=f"missing action {dropped.short()}.*rank 2"):
        validate(sched)


def test_rejects_duplicated_action():
    sched = _chimera()
    sched.actions[1].append(sched.actions[1][0])
    with pytest.raises(ScheduleError, match="duplicated action F0.1.0.*rank 1 index 0.*rank 1"):
        validate(sched)


def test_rejects_action_on_wrong_rank():
    sched = _chimera()
    moved = sched.actions[0].pop(0)  # F of down stage 0, held by rank 0
    sched.actions[3].insert(0, moved)
    with pytest.raises(ScheduleError, match="wrong rank.*held by rank 0.*rank 3, index 0"):
        validate(sched)


def test_rejects_deadlocking_order():
    sched = copy.deepcopy(build_schedule("1f1b", 2, 2))
    # rank 0 waits for the gradient of micro-batch 1 before sending its activation: both block.
    sched.actions[0] = [
        Action("F", 0, 0, 0), Action("B", 0, 0, 1), Action("F", 0, 0, 1), Action("B", 0, 0, 0)
    ]
    with pytest.raises(ScheduleError, match="deadlock.*rank 0, index 1.*waits for B0.1.1"):
        validate(sched)


def test_rejects_backward_before_own_forward_on_last_stage():
    sched = copy.deepcopy(build_schedule("gpipe", 2, 1))
    sched.actions[1].reverse()
    with pytest.raises(ScheduleError, match="deadlock.*rank 1, index 0"):
        validate(sched)


def test_rejects_microbatch_of_other_pipe():
    sched = _chimera()
    a = sched.actions[0][0]
    sched.actions[0][0] = Action(a.kind, a.pipe, a.stage, 3)  # micro-batch 3 belongs to pipe 1
    with pytest.raises(ScheduleError, match="micro-batch 3 belongs to pipe 1, not 0"):
        validate(sched)


def test_rejects_weight_action_without_split_backward():
    sched = copy.deepcopy(build_schedule("1f1b", 2, 2))
    sched.actions[0].append(Action("W", 0, 0, 0))
    with pytest.raises(ScheduleError, match="W action in a schedule without split backward"):
        validate(sched)


def _split_1f1b():
    base = build_schedule("1f1b", 2, 2)
    actions = []
    for rank_actions in base.actions:
        order = []
        for a in rank_actions:
            order.append(a)
            if a.kind == "B":
                order.append(Action("W", a.pipe, a.stage, a.microbatch))
        actions.append(order)
    return Schedule(
        name="1f1b-split", num_ranks=2, num_stages=2, num_pipes=1, num_microbatches=2,
        placement=[[0, 1]], actions=actions, split_backward=True,
    )


def test_split_backward_needs_each_weight_once_after_its_backward():
    sched = _split_1f1b()
    validate(sched)
    missing = copy.deepcopy(sched)
    missing.actions[1] = [a for a in missing.actions[1] if a != Action("W", 0, 1, 1)]
    with pytest.raises(ScheduleError, match="missing action W0.1.1"):
        validate(missing)
    early = copy.deepcopy(sched)
    w = Action("W", 0, 0, 0)
    early.actions[0].remove(w)
    early.actions[0].insert(0, w)
    with pytest.raises(ScheduleError, match="W before its B.*rank 0, index 0"):
        validate(early)


def test_rejects_bad_placement_and_shape():
    sched = _chimera()
    sched.placement[1][2] = 7
    with pytest.raises(ScheduleError, match="pipe 1 stage 2 on invalid rank 7"):
        validate(sched)
    sched = _chimera()
    sched.actions.pop()
    with pytest.raises(ScheduleError, match="3 action lists for 4 ranks"):
        validate(sched)
