"""ZB-2p (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR'24): one pipe with a split backward
whose ranks hold up to 2D activations (F to W), twice 1F1B's, so that the warm-up and cool-down
bubbles fill with extra forwards and deferred W's.

The order is the one a greedy run on unit costs (F = B = W = 1, free messages) gives: at each step
a rank runs its next B if ready, else its next F if ready and under the cap, else a pending W.
Rank i thus warms up with 2(D-1-i)+1 forwards (the paper's ZB-H2 warm-up) and defers its W's to
the cool-down; with those costs the makespan is the lower bound 3N + D - 1 (no bubble but the
pipeline's fill)."""

from __future__ import annotations

from megatron_chimera.schedules.actions import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    Action,
    Schedule,
    single_pipe,
)


def _greedy_orders(num_ranks: int, num_microbatches: int, cap: int) -> list[list[Action]]:
    """Each rank's order from the unit-cost greedy (module doc)."""
    D, N = num_ranks, num_microbatches
    never = N * 4 + D * 4 + 1
    f_done = [[never] * N for _ in range(D)]
    b_done = [[never] * N for _ in range(D)]
    nf, nb, nw = [0] * D, [0] * D, [0] * D
    orders: list[list[Action]] = [[] for _ in range(D)]
    t = 0
    while any(w < N for w in nw):
        for r in range(D):
            b, f = nb[r], nf[r]
            if b < N and f_done[r][b] <= t and (r == D - 1 or b_done[r + 1][b] <= t):
                orders[r].append(Action(BACKWARD, 0, r, b))
                b_done[r][b] = t + 1
                nb[r] += 1
            elif f < N and f - nw[r] < cap and (r == 0 or f_done[r - 1][f] <= t):
                orders[r].append(Action(FORWARD, 0, r, f))
                f_done[r][f] = t + 1
                nf[r] += 1
            elif nw[r] < nb[r]:
                orders[r].append(Action(WEIGHT, 0, r, nw[r]))
                nw[r] += 1
        t += 1
        if t > never:  # cannot happen with cap >= 1: B's always drain
            raise AssertionError("zb-2p: the greedy order did not finish")
    return orders


def zb_2p(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-2p: split backward, at most 2D live activations per rank (module doc)."""
    if num_ranks < 1 or num_microbatches < 1:
        return single_pipe("zb-2p", num_ranks, num_microbatches, lambda r: [],
                           split_backward=True)  # raises the sizes' error
    orders = _greedy_orders(num_ranks, num_microbatches, 2 * num_ranks)
    return single_pipe("zb-2p", num_ranks, num_microbatches, orders.__getitem__,
                       split_backward=True)
