"""1F1B (PipeDream-Flush / DAPPLE): warm-up forwards, steady one-forward-one-backward."""

from __future__ import annotations

from .actions import BACKWARD, FORWARD, Action, Schedule


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Schedule:
    """Rank r runs min(D-r-1, N) warm-up forwards, then alternates F and B, then drains.

    At most D-r micro-batches are in flight on rank r, so activation memory is bounded by D x M_a.
    """
    if num_ranks < 1:
        raise ValueError(f"--pipeline-model-parallel-size must be >= 1, got {num_ranks}")
    if num_microbatches < 1:
        raise ValueError(f"--num-microbatches must be >= 1, got {num_microbatches}")
    actions = []
    for rank in range(num_ranks):
        warmup = min(num_ranks - rank - 1, num_microbatches)
        order = [Action(FORWARD, 0, rank, m) for m in range(warmup)]
        next_backward = 0
        for m in range(warmup, num_microbatches):
            order.append(Action(FORWARD, 0, rank, m))
            order.append(Action(BACKWARD, 0, rank, next_backward))
            next_backward += 1
        order += [Action(BACKWARD, 0, rank, m) for m in range(next_backward, num_microbatches)]
        actions.append(order)
    return Schedule(
        name="1f1b",
        num_ranks=num_ranks,
        num_stages=num_ranks,
        num_pipes=1,
        num_microbatches=num_microbatches,
        placement=[list(range(num_ranks))],
        actions=actions,
    )
