"""GPipe: every micro-batch forward through the pipe, then every backward (one pipe, D stages)."""

from __future__ import annotations

from .actions import BACKWARD, FORWARD, Action, Schedule


def gpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    """All N forwards, then all N backwards in the same micro-batch order, on each of D ranks."""
    if num_ranks < 1:
        raise ValueError(f"--pipeline-model-parallel-size must be >= 1, got {num_ranks}")
    if num_microbatches < 1:
        raise ValueError(f"--num-microbatches must be >= 1, got {num_microbatches}")
    actions = [
        [Action(FORWARD, 0, rank, m) for m in range(num_microbatches)]
        + [Action(BACKWARD, 0, rank, m) for m in range(num_microbatches)]
        for rank in range(num_ranks)
    ]
    return Schedule(
        name="gpipe",
        num_ranks=num_ranks,
        num_stages=num_ranks,
        num_pipes=1,
        num_microbatches=num_microbatches,
        placement=[list(range(num_ranks))],
        actions=actions,
    )
