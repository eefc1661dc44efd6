"""Known message shapes in the schedule IR: variable-length micro-batches without a handshake.

With packed variable-length micro-batches (``data/packing.py``) every micro-batch has its own
token count. Megatron's ``--variable-seq-lengths`` sends each message's shape in an extra
handshake before the message; here the counts are part of the schedule
(``schedule.meta["microbatch_tokens"][m]``: tokens of the schedule's micro-batch ``m``, a pipeline
unit -- one slice of a sequence under sequence slicing), so every SEND and RECV of a lowered
schedule carries its known size (:func:`shape_lowered`), and :func:`check_shapes` proves what
NCCL needs: each operation moves its own micro-batch's tokens, and between two ranks the i-th
receive posts the size of the i-th send (NCCL matches a pair's messages in issue order, ignoring
tags and sizes: a swapped size is a hang or a corrupted buffer, not an error).

A message's shape is ``[tokens, hidden]`` (THD layout); the hidden size is the same for every
message of a run, so the token count is the part that varies and the part checked here.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

from megatron_chimera.errors import ScheduleError
from megatron_chimera.schedules.actions import Action, Schedule
from megatron_chimera.schedules.lowering import (
    RECV,
    SEND,
    Comm,
    LoweredSchedule,
    Message,
    needed_message,
    produced_message,
)

TOKENS_KEY = "microbatch_tokens"


class ShapedComm(NamedTuple):
    """A SEND or RECV of a lowered list with the token count of the buffer it moves."""

    op: str  # SEND or RECV
    message: Message
    tokens: int

    @property
    def peer(self) -> int:
        """The pipeline rank at the other end."""
        return self.message.dst if self.op == SEND else self.message.src

    def short(self) -> str:
        """Compact label, e.g. ``RECV a0.2.5[384]<-1``."""
        arrow = "->" if self.op == SEND else "<-"
        return f"{self.op} {self.message.short()}[{self.tokens}]{arrow}{self.peer}"


ShapedOp = Action | ShapedComm


def with_tokens(schedule: Schedule, tokens: Sequence[int]) -> Schedule:
    """A copy of ``schedule`` whose micro-batch ``m`` has ``tokens[m]`` tokens (one per
    micro-batch of the schedule, each positive)."""
    counts = [int(t) for t in tokens]
    if len(counts) != schedule.num_microbatches:
        raise ScheduleError(f"{len(counts)} micro-batch token counts for a schedule of "
                            f"{schedule.num_microbatches} micro-batches ({schedule.describe()})")
    bad = next((m for m, t in enumerate(counts) if t < 1), None)
    if bad is not None:
        raise ScheduleError(f"micro-batch {bad} has {counts[bad]} tokens; every micro-batch "
                            f"needs at least one")
    shaped = copy.copy(schedule)
    shaped.meta = {**schedule.meta, TOKENS_KEY: counts}
    return shaped


def microbatch_tokens(schedule: Schedule) -> list[int]:
    """The schedule's per-micro-batch token counts (:func:`with_tokens`)."""
    if TOKENS_KEY not in schedule.meta:
        raise ScheduleError(f"the schedule carries no micro-batch token counts "
                            f"({schedule.describe()}): build it with shapes.with_tokens")
    return list(schedule.meta[TOKENS_KEY])


def shape_lowered(lowered: LoweredSchedule) -> list[list[ShapedOp]]:
    """``lowered``'s per-rank lists with every SEND / RECV carrying its message's tokens."""
    tokens = microbatch_tokens(lowered.schedule)
    return [[ShapedComm(op.op, op.message, tokens[op.message.microbatch])
             if isinstance(op, Comm) else op for op in ops] for ops in lowered.lists]


def _owner(lowered: LoweredSchedule, rank: int, index: int, op: ShapedComm) -> str:
    """The compute action a communication serves: the producer of a SEND (before it), the
    consumer of a RECV (after it)."""
    s = lowered.schedule
    ops = lowered.lists[rank]
    if op.op == SEND:
        found = (a for a in reversed(ops[:index])
                 if isinstance(a, Action) and produced_message(s, a) == op.message)
    else:
        found = (a for a in ops[index + 1:]
                 if isinstance(a, Action) and needed_message(s, a) == op.message)
    action = next(found, None)
    return f"{action.short()} ({action})" if action is not None else "no action"


def check_shapes(lowered: LoweredSchedule, shaped: Sequence[Sequence[ShapedOp]]) -> None:
    """Raise :class:`ScheduleError` unless ``shaped`` is ``lowered``'s lists, every SEND / RECV
    moves its micro-batch's tokens (naming the action it serves otherwise), and between every
    two ranks the receives post, in issue order, the sizes the sends carry."""
    tokens = microbatch_tokens(lowered.schedule)
    if len(shaped) != len(lowered.lists):
        raise ScheduleError(f"{len(shaped)} shaped lists for {len(lowered.lists)} ranks")
    sizes: dict[tuple[str, int, int], list[tuple[ShapedComm, int, int]]] = {}
    for rank, (ops, plain) in enumerate(zip(shaped, lowered.lists)):
        if len(ops) != len(plain):
            raise ScheduleError(f"rank {rank}: {len(ops)} shaped operations for {len(plain)} "
                                f"lowered ones")
        for index, (op, base) in enumerate(zip(ops, plain)):
            if isinstance(op, Action) or isinstance(base, Action):
                if op != base:
                    raise ScheduleError(f"rank {rank}, index {index}: {op.short()} where the "
                                        f"lowered list has {base.short()}")
                continue
            if (op.op, op.message) != tuple(base):
                raise ScheduleError(f"rank {rank}, index {index}: {op.short()} where the "
                                    f"lowered list has {base.short()}")
            want = tokens[op.message.microbatch]
            if op.tokens != want:
                raise ScheduleError(
                    f"rank {rank}, index {index}: {op.short()} moves {op.tokens} tokens but "
                    f"micro-batch {op.message.microbatch} has {want} (for "
                    f"{_owner(lowered, rank, index, op)})")
            m = op.message
            sizes.setdefault((op.op, m.src, m.dst), []).append((op, rank, index))
    channels = {(src, dst) for _, src, dst in sizes}
    for src, dst in sorted(channels):
        sent = sizes.get((SEND, src, dst), [])
        received = sizes.get((RECV, src, dst), [])
        for i, ((send, _, _), (recv, r, index)) in enumerate(zip(sent, received)):
            if send.tokens != recv.tokens:
                raise ScheduleError(
                    f"rank {dst} receive {i} from rank {src} ({recv.short()}, for "
                    f"{_owner(lowered, r, index, recv)}) posts {recv.tokens} tokens but send "
                    f"{i} ({send.short()}) carries {send.tokens}: NCCL matches the messages "
                    f"of a pair in issue order, so the sizes must follow the same order")
        if len(sent) != len(received):
            raise ScheduleError(f"rank {src} sends {len(sent)} messages to rank {dst}, which "
                                f"receives {len(received)}")


def validate_shaped(lowered: LoweredSchedule, **options: bool) -> list[list[ShapedOp]]:
    """:func:`~.validate.validate_lowered` (``options`` passed on), then :func:`check_shapes` of
    the shaped lists, which are returned."""
    from megatron_chimera.schedules.validate import validate_lowered

    validate_lowered(lowered, **options)
    shaped = shape_lowered(lowered)
    check_shapes(lowered, shaped)
    return shaped


def check_sized_lists(lowered: LoweredSchedule, tokens: Sequence[int]) -> None:
    """:func:`check_shapes` of ``lowered`` with one iteration's micro-batch ``tokens`` (the
    executor's check under the NCCL-semantics test mode)."""
    sized = dataclasses.replace(lowered, schedule=with_tokens(lowered.schedule, tokens))
    check_shapes(sized, shape_lowered(sized))
