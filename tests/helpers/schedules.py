"""Schedule transformations used by several tests (torch-free)."""

from __future__ import annotations

from collections import deque

from megatron_chimera.schedules.actions import BACKWARD, WEIGHT, Action, Schedule


def with_weight_actions(schedule: Schedule, delay: int) -> Schedule:
    """Split every B: its W runs ``delay`` actions later on the same rank (or at the end)."""
    if schedule.split_backward:
        raise ValueError("schedule already has W actions")
    actions = []
    for rank_actions in schedule.actions:
        out: list[Action] = []
        pending: deque[tuple[int, Action]] = deque()
        for i, action in enumerate(rank_actions):
            out.append(action)
            if action.kind == BACKWARD:
                pending.append((i + delay, Action(WEIGHT, action.pipe, action.stage,
                                                  action.microbatch)))
            while pending and pending[0][0] <= i:
                out.append(pending.popleft()[1])
        out.extend(w for _, w in pending)
        actions.append(out)
    return Schedule(schedule.name + "-split", schedule.num_ranks, schedule.num_stages,
                    schedule.num_pipes, schedule.num_microbatches, schedule.placement, actions,
                    split_backward=True, meta=dict(schedule.meta))
