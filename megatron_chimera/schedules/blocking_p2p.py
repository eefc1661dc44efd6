"""The timeline of a schedule run with Megatron-LM's *blocking* pipeline exchanges.

Megatron-LM's 1F1B and interleaved schedules (``schedules.py`` with ``batch_p2p_comm``, the
default without ``--overlap-p2p-comm``) move activations and gradients in exchanges: one
``batch_isend_irecv`` of the sends of what the rank just computed and the receives of what it
computes next, waited on and followed by ``torch.cuda.synchronize()`` (``batch_p2p_sync``,
default on: "to protect against race condition when using batch_isend_irecv"). So the host,
and with it the device, stops at every exchange until all of its transfers are through, and a
transfer starts only when both ends have posted it (NCCL point-to-point is a rendezvous).

The model here: a rank's list is cut into *segments*, each followed by one exchange. In
1F1B every action is a segment (``send_forward_recv_backward`` after an F,
``send_backward_recv_forward`` after a B). With ``paired`` (Megatron's interleaved schedule) an
F directly followed by a B is one segment: its steady state computes the F and the B, then
runs one ``send_forward_backward_recv_forward_backward``, so the F's output leaves only after
the B. Exchange ``k`` of a rank posts when its segment ``k`` ends (exchange -1, before the first
segment, at 0); it sends the segment's outputs to other ranks and receives the next segment's
inputs. Each transfer takes its link's message time from the later of its two exchanges'
posts; the exchange completes when its last transfer does, and the next segment starts then
(plus the cost model's ``action_overhead`` per action). Async runtimes (ours, the zero-bubble
runtime's lazily waited ``batch_isend_irecv``) are :func:`~.simulate.simulate`'s default.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from megatron_chimera.schedules.actions import (
    BACKWARD,
    FORWARD,
    Action,
    Schedule,
    input_of,
    output_to,
)
from megatron_chimera.schedules.validate import ScheduleError

P2P_EXCHANGES = ("async", "blocking", "blocking-paired")


def segments(actions: Sequence[Action], paired: bool) -> list[list[Action]]:
    """A rank's actions cut at its exchanges (module doc): one action each, or with ``paired``
    an F directly followed by a B together."""
    out: list[list[Action]] = []
    i = 0
    while i < len(actions):
        size = 2 if (paired and actions[i].kind == FORWARD and i + 1 < len(actions)
                     and actions[i + 1].kind == BACKWARD) else 1
        out.append(list(actions[i:i + size]))
        i += size
    return out


def blocking_timeline(schedule: Schedule, compute: dict[str, list[float]],
                      message: Callable[[int, int], float], action_overhead: float,
                      paired: bool) -> list[tuple[int, Action, float, float]]:
    """(rank, action, start, end) of every action of ``schedule`` run with blocking exchanges:
    ``compute[kind][stage]`` the action times, ``message(sender, receiver)`` a transfer's,
    ``action_overhead`` host seconds before each action, ``paired`` Megatron's interleaved
    F+B segments. ScheduleError when the exchanges deadlock."""
    stages = schedule.num_stages
    cut = [segments(actions, paired) for actions in schedule.actions]
    where = {a: (rank, k) for rank, segs in enumerate(cut)
             for k, seg in enumerate(segs) for a in seg}
    posted: dict[tuple[int, int], float] = {}
    done: dict[tuple[int, int], float] = {}
    events: list[tuple[int, Action, float, float]] = []

    @functools.cache  # a rank blocked on a partner asks again on the next pass
    def transfers(rank: int, k: int) -> list[tuple[tuple[int, int], int, int]]:
        """(partner exchange, sender, receiver) of every message of exchange k on rank."""
        ops = []
        for a in cut[rank][k] if k >= 0 else []:
            consumer = output_to(a, stages)
            if consumer is not None and where[consumer][0] != rank:
                peer, at = where[consumer]
                ops.append(((peer, at - 1), rank, peer))
        for a in cut[rank][k + 1] if k + 1 < len(cut[rank]) else []:
            producer = input_of(a, stages)
            if producer is not None and where[producer][0] != rank:
                ops.append((where[producer], where[producer][0], rank))
        return ops

    def post(rank: int, k: int) -> None:
        """Run segment k of rank (its previous exchange done) and post exchange k."""
        t = done[(rank, k - 1)]
        for a in cut[rank][k]:
            start = t + action_overhead
            t = start + compute[a.kind][a.stage]
            events.append((rank, a, start, t))
        posted[(rank, k)] = t

    heads = [-1] * len(cut)
    for rank in range(len(cut)):
        posted[(rank, -1)] = 0.0
    progress = True
    while progress:
        progress = False
        for rank, segs in enumerate(cut):
            while heads[rank] < len(segs):
                k = heads[rank]
                if (rank, k) not in posted:
                    post(rank, k)
                ops = transfers(rank, k)
                if any(partner not in posted for partner, _, _ in ops):
                    break
                done[(rank, k)] = max([posted[(rank, k)]] + [
                    max(posted[(rank, k)], posted[partner]) + message(src, dst)
                    for partner, src, dst in ops])
                heads[rank] = k + 1
                progress = True
    if any(head < len(segs) for head, segs in zip(heads, cut, strict=True)):
        raise ScheduleError("simulation stalled: the blocking exchanges deadlock")
    return events
