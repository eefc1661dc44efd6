"""GPipe: every micro-batch forward through the pipe, then every backward (one pipe, D stages)."""

from __future__ import annotations

from megatron_chimera.schedules.actions import BACKWARD, FORWARD, Action, Schedule, single_pipe


def gpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    """All N forwards, then all N backwards in the same micro-batch order, on each of D ranks."""

    def rank_order(rank: int) -> list[Action]:
        return [Action(FORWARD, 0, rank, m) for m in range(num_microbatches)] + [
            Action(BACKWARD, 0, rank, m) for m in range(num_microbatches)
        ]

    return single_pipe("gpipe", num_ranks, num_microbatches, rank_order)
