"""Schedule data types: JSON round trip and derived views."""

from megatron_chimera.schedules import Action, Schedule, build_schedule


def test_json_round_trip_preserves_everything():
    sched = build_schedule("1f1b", 4, 6)
    back = Schedule.from_json(sched.to_json())
    assert back == sched
    assert isinstance(back.actions[0][0], Action)


def test_1f1b_orders_and_views():
    sched = build_schedule("1f1b", 4, 6)
    # rank 0 warms up with D-1 = 3 forwards, the last rank alternates from the start
    assert [a.short() for a in sched.actions[0][:4]] == ["F0.0.0", "F0.0.1", "F0.0.2", "F0.0.3"]
    assert [a.kind for a in sched.actions[3][:4]] == ["F", "B", "F", "B"]
    assert sched.replicas_of_rank(2) == [(0, 2)]
    assert sched.prev_rank(0, 0) is None and sched.next_rank(0, 3) is None
    assert sched.weight_copies() == [1, 1, 1, 1]
    for rank_actions in sched.actions:
        assert len(rank_actions) == 12


def test_derived_dependencies_are_plain_actions():
    """input_of / output_to / consumers build their Actions without the kind check (issue 17's
    speed-up); they must be indistinguishable from checked ones, since the lowering derives
    every message from them (one dependency rule)."""
    from megatron_chimera.schedules.actions import consumers, input_of, output_to
    from megatron_chimera.schedules.lowering import lower
    from megatron_chimera.schedules.validate import validate_lowered

    schedule = build_schedule("chimera-zb", 4, 8)
    for actions in schedule.actions:
        for action in actions:
            derived = [input_of(action, 4), output_to(action, 4),
                       *consumers(action, 4, schedule.split_backward)]
            for other in filter(None, derived):
                assert type(other) is Action
                assert other == Action(*other) and hash(other) == hash(Action(*other))
    validate_lowered(lower(schedule))
