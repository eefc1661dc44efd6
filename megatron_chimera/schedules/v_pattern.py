"""V-Half's periodic pattern as per-rank orders: a seed of the ``v-half`` search.

The pattern (Qi et al., NeurIPS'24, "Pipeline Parallelism with Controllable Memory") counts time in
slots, one per F, B or W of a half-size chunk. Rank ``i`` of a V pipe over D ranks repeats every
6 slots: F of its first chunk (stage ``i``) at slot ``2i``, F of its second (stage ``2D-1-i``) at
``3D-i-2``, B of the second at ``3D+g+2i-1`` and B of the first at ``6D+g-i-2`` (``g`` = 3 for even
D, else 0), micro-batch ``m`` ``6m`` slots later; W's take the free slots, the second chunk's
first. Every rank then holds about ``D/2 + 1`` activations (units of L/D layers), half of 1F1B.

The pattern alone idles through long warm-up and cool-down gaps. :func:`compress` walks the
actions in slot order and moves each one of the warm-up (until the first micro-batch's last B) and
of the cool-down (after the last micro-batch entered the pipe) to the earliest free slot its inputs
allow, unless that raises the busiest rank's peak. It runs twice, with the W's in place and
without them (W's re-placed into the free slots after), as the paper's squeeze. The result is an
order: the search executes it under the real costs (the simulator) like every other seed.
Torch-free.
"""

from __future__ import annotations

from collections import deque

from megatron_chimera.schedules.actions import BACKWARD, FORWARD, WEIGHT, Action, input_of

PERIOD = 6  # slots per micro-batch and rank: F, B, W of two chunks
Slots = dict[Action, int]


def pattern_slots(num_ranks: int, num_microbatches: int) -> Slots:
    """Slot of every F and B in V-Half's periodic pattern (module docstring)."""
    d = num_ranks
    gap = 3 if d % 2 == 0 else 0
    slots: Slots = {}
    for i in range(d):
        first, second = i, 2 * d - 1 - i
        offsets = ((FORWARD, first, 2 * i), (FORWARD, second, 3 * d - i - 2),
                   (BACKWARD, second, 3 * d + gap + 2 * i - 1),
                   (BACKWARD, first, 6 * d + gap - i - 2))
        for m in range(num_microbatches):
            for kind, stage, offset in offsets:
                slots[Action(kind, 0, stage, m)] = offset + PERIOD * m
    return slots


def _by_rank(slots: Slots, placement: list[int]) -> list[list[Action]]:
    ranks: list[list[Action]] = [[] for _ in range(max(placement) + 1)]
    for a in sorted(slots, key=slots.__getitem__):
        ranks[placement[a.stage]].append(a)
    return ranks


def place_weights(slots: Slots, placement: list[int]) -> Slots:
    """The F/B slots with one W per B in the rank's free slots (FIFO, the V's second chunk
    first), those left over after the rank's last action."""
    out = {a: t for a, t in slots.items() if a.kind != WEIGHT}
    num_stages = len(placement)
    for actions in _by_rank(out, placement):
        pending: tuple[deque, deque] = (deque(), deque())  # second chunk, first chunk
        busy = {out[a] for a in actions}
        t = 0
        for a in actions:
            while t < out[a]:
                queue = pending[0] or pending[1]
                if queue and t not in busy:
                    b = queue.popleft()
                    out[Action(WEIGHT, 0, b.stage, b.microbatch)] = t
                t += 1
            if a.kind == BACKWARD:
                pending[0 if a.stage >= num_stages // 2 else 1].append(a)
            t = out[a] + 1
        for b in (*pending[0], *pending[1]):
            out[Action(WEIGHT, 0, b.stage, b.microbatch)] = t
            t += 1
    return out


def peak_slots(actions: list[Action], slots: Slots, weights_placed: bool) -> int:
    """Most live activations of one rank's slotted actions; without W's, each free slot runs a
    pending W (the B's so far minus the W's run)."""
    at = {slots[a]: a for a in actions}
    live = peak = pending = 0
    for t in range(max(at) + 1 if at else 0):
        a = at.get(t)
        if a is None:
            if not weights_placed and pending:
                pending, live = pending - 1, live - 1
        elif a.kind == FORWARD:
            live += 1
            peak = max(peak, live)
        elif a.kind == WEIGHT:
            live -= 1
        else:
            pending += 1
    return peak


def compress(slots: Slots, placement: list[int], num_microbatches: int,
             weights_placed: bool) -> Slots:
    """Move warm-up and cool-down actions to earlier free slots (module docstring); without
    W's the warm-up stays as it is."""
    out = dict(slots)
    num_stages = len(placement)
    ranks = _by_rank(out, placement)
    limit = max(peak_slots(actions, out, weights_placed) for actions in ranks)
    busy = [{out[a] for a in actions} for actions in ranks]
    first_out = Action(BACKWARD, 0, 0, 0)  # the first micro-batch leaves: warm-up over
    out_yet = entered = False  # entered: the last micro-batch has started somewhere
    for a in sorted(slots, key=lambda x: (slots[x], placement[x.stage])):
        out_yet = out_yet or a == first_out
        if out_yet and not entered:  # the steady state stays as it is
            entered = (a.kind == FORWARD and a.stage < num_stages // 2
                       and a.microbatch == num_microbatches - 1)
            continue
        entered = entered or (a.kind == FORWARD and a.microbatch == num_microbatches - 1)
        if not out_yet and not weights_placed:
            continue
        rank = placement[a.stage]
        deps = [input_of(a, num_stages)]
        if a.microbatch:
            deps.append(Action(a.kind, a.pipe, a.stage, a.microbatch - 1))
        earliest = max((out[d] + 1 for d in deps if d is not None), default=0)
        old = out[a]
        for t in range(earliest, old):
            if t in busy[rank]:
                continue
            out[a] = t
            if peak_slots(ranks[rank], out, weights_placed) <= limit:
                busy[rank].discard(old)
                busy[rank].add(t)
                break
            out[a] = old
    return out


def v_half_order(num_ranks: int, num_microbatches: int, placement: list[int]) -> list[list[Action]]:
    """Per-rank orders of V-Half's compressed pattern on the V ``placement`` (stage -> rank)."""
    slots = place_weights(pattern_slots(num_ranks, num_microbatches), placement)
    slots = compress(slots, placement, num_microbatches, weights_placed=True)
    slots = {a: t for a, t in slots.items() if a.kind != WEIGHT}
    slots = compress(slots, placement, num_microbatches, weights_placed=False)
    return _by_rank(place_weights(slots, placement), placement)
