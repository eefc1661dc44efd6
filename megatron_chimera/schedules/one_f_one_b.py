"""1F1B (PipeDream-Flush / DAPPLE): warm-up forwards, steady one-forward-one-backward."""

from __future__ import annotations

from megatron_chimera.schedules.actions import BACKWARD, FORWARD, Action, Schedule, single_pipe


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Schedule:
    """Rank r runs min(D-r-1, N) warm-up forwards, then alternates F and B, then drains.

    At most D-r micro-batches are in flight on rank r, so activation memory is bounded by D x M_a.
    """

    def rank_order(rank: int) -> list[Action]:
        warmup = min(num_ranks - rank - 1, num_microbatches)
        order = [Action(FORWARD, 0, rank, m) for m in range(warmup)]
        next_backward = 0
        for m in range(warmup, num_microbatches):
            order.append(Action(FORWARD, 0, rank, m))
            order.append(Action(BACKWARD, 0, rank, next_backward))
            next_backward += 1
        order += [Action(BACKWARD, 0, rank, m) for m in range(next_backward, num_microbatches)]
        return order

    return single_pipe("1f1b", num_ranks, num_microbatches, rank_order)
