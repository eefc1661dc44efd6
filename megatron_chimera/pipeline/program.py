"""One rank's lowered list compiled once into the steps the executor runs.

Everything the executor would otherwise work out again at every action of every iteration is
decided here, once per mode (training, forward-only), from the lowered list
(:mod:`megatron_chimera.schedules.lowering`):

* per compute action (:class:`Compute`): the message it consumes and the one it produces (and
  whether that stays on this rank), its label, whether the gradients of a stage become final
  with it, and which receive buffers are free once it is over;
* per paired action (``Schedule.pairs``, :class:`Paired`): its two computes as one step, which
  the executor runs with each half's all-to-all overlapping the other half's compute
  (:mod:`.overlap`); the lowering posts both halves' receives before it and both sends after;
* per run of communication operations (:class:`Post`): the consecutive ``SEND`` or ``RECV``
  operations of one step with the same peer, in the lowered order -- one batch.

**Buffer lifetimes.** A received activation is the stage input that its backward reads, and the
weight-gradient store of a split backward may keep it (and the received output gradient) until
``W``; so both buffers of ``(pipe, stage, micro-batch)`` are released after the last action of
that triple on this rank: ``W`` when the backward is split, else ``B``. In forward-only mode
they are released when the iteration ends.

**Batches.** Consecutive operations of one step (between two compute actions), of one kind
and with one peer form one :class:`Post`, in the order the lowering fixed, so the issue order
NCCL matches on is unchanged; the executor hands each batch to the transport in one call
(:meth:`~.transport.Transport.post`), which posts its operations one by one (each consumer
then waits for its own message only).

Torch-free, like the IR it compiles.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from megatron_chimera.schedules.actions import BACKWARD, FORWARD, Action, Schedule
from megatron_chimera.schedules.lowering import (
    Comm,
    LoweredSchedule,
    Message,
    needed_message,
    produced_message,
)

Key = tuple[int, int, int]  # (pipe, stage, micro-batch)


class Compute(NamedTuple):
    """A compute action with everything it needs decided."""

    action: Action
    label: str  # action.short()
    key: Key
    needs: Message | None  # consumed (received, or handed over on this rank)
    produces: Message | None  # sent by the SEND that follows, or handed over locally
    local: bool  # ``produces`` stays on this rank
    final_stage: int | None  # this rank's gradients of that stage are final after this action
    releases: tuple[Message, ...]  # receive buffers free once this action is over

    def short(self) -> str:
        """The action's label, e.g. ``F0.2.5``."""
        return self.label


class Post(NamedTuple):
    """Consecutive ``SEND`` or ``RECV`` operations of one step with one peer (a batch)."""

    op: str  # SEND or RECV
    messages: tuple[Message, ...]
    label: str

    def short(self) -> str:
        """The first operation's label, e.g. ``RECV a0.2.5<-1`` (``+1`` per further one)."""
        return self.label


class Paired(NamedTuple):
    """Two compute actions of one paired F&B action (neighbours of the list), run as one step."""

    first: Compute
    second: Compute
    label: str

    def short(self) -> str:
        """Both labels, e.g. ``F0.2.5&B1.1.3``."""
        return self.label

    @property
    def halves(self) -> tuple[Compute, Compute]:
        """The two computes, in list order."""
        return (self.first, self.second)


Step = Compute | Paired | Post


class Program(NamedTuple):
    """The compiled steps of one rank and mode."""

    steps: tuple[Step, ...]
    forward_only: bool

    def computes(self) -> Iterator[Compute]:
        """The compute steps, in order (a pair's two halves in list order)."""
        for step in self.steps:
            if isinstance(step, Compute):
                yield step
            elif isinstance(step, Paired):
                yield from step.halves


def _key(action: Action) -> Key:
    return (action.pipe, action.stage, action.microbatch)


def _final_gradient_actions(schedule: Schedule, rank: int) -> dict[int, int]:
    """Index of ``rank``'s last B (last W when split) per stage -> that stage."""
    kind = schedule.release_kind
    last: dict[int, int] = {}
    for i, action in enumerate(schedule.actions[rank]):
        if action.kind == kind:
            last[action.stage] = i
    return {i: stage for stage, i in last.items()}


def _releases(schedule: Schedule, rank: int, action: Action, forward_only: bool,
              ) -> tuple[Message, ...]:
    """Received buffers of ``action``'s triple that are free once ``action`` is over."""
    ends = schedule.release_kind
    if forward_only or action.kind != ends:
        return ()
    p, s, m = _key(action)
    consumers = (Action(FORWARD, p, s, m), Action(BACKWARD, p, s, m))
    needed = (needed_message(schedule, a) for a in consumers)
    return tuple(msg for msg in needed if msg is not None and msg.src != rank)


def _batches(comms: list[Comm]) -> Iterator[Post]:
    """Runs of one kind and one peer, in order."""
    run: list[Comm] = []
    for comm in comms + [None]:  # type: ignore[list-item]
        if run and (comm is None or comm.op != run[0].op or comm.peer != run[0].peer):
            more = f" +{len(run) - 1}" if len(run) > 1 else ""
            yield Post(run[0].op, tuple(c.message for c in run), run[0].short() + more)
            run = []
        if comm is not None:
            run.append(comm)


def compile_program(lowered: LoweredSchedule, rank: int) -> Program:
    """The steps of ``rank``'s lowered list."""
    schedule = lowered.schedule
    final = {} if lowered.forward_only else _final_gradient_actions(schedule, rank)
    starts = lowered.pair_starts()[rank]
    steps: list[Step] = []
    comms: list[Comm] = []
    index = 0
    for op in lowered.lists[rank]:
        if isinstance(op, Comm):
            comms.append(op)
            continue
        if index - 1 in starts and comms:
            raise ValueError(f"rank {rank}: communication between the halves of the pair at "
                             f"compute index {index - 1} ({comms[0].short()})")
        steps += _batches(comms)
        comms = []
        produces = produced_message(schedule, op)
        compute = Compute(
            op, op.short(), _key(op), needed_message(schedule, op), produces,
            produces is not None and produces.dst == rank, final.get(index),
            _releases(schedule, rank, op, lowered.forward_only))
        if index - 1 in starts:
            first = steps.pop()
            steps.append(Paired(first, compute, f"{first.label}&{compute.label}"))
        else:
            steps.append(compute)
        index += 1
    steps += _batches(comms)
    return Program(tuple(steps), lowered.forward_only)
