"""Check a schedule before anything runs it.

``validate(schedule)`` proves three things and raises :class:`ScheduleError` naming the rank, list
index and action at fault otherwise:

1. *Well formed*: placement covers every (pipe, stage) with a valid rank; every action has a known
   kind, a valid pipe/stage, runs on the rank holding that replica, and its micro-batch belongs
   to its pipe. W actions appear only in split-backward schedules.
2. *Complete*: every micro-batch of every pipe has exactly one F and one B at every stage (and one
   W when the backward is split, after its B in the same rank's list).
3. *Deadlock free*: executing the per-rank lists in order, each rank blocking on the receive its
   next action needs while sends are buffered (the executor posts non-blocking sends and blocks
   only on the receive of its next action), every action eventually runs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from megatron_chimera.schedules.actions import BACKWARD, FORWARD, WEIGHT, Action, Schedule, input_of
from megatron_chimera.schedules.lowering import (
    RECV,
    SEND,
    Comm,
    LoweredSchedule,
    Message,
    iteration_actions,
    needed_message,
    produced_message,
)
from megatron_chimera.schedules.walk import run_in_order, stalled


class ScheduleError(ValueError):
    """A schedule that is malformed, incomplete or would deadlock."""


def dependency(schedule: Schedule, action: Action) -> Action | None:
    """The action whose output ``action`` consumes (:func:`~.actions.input_of`)."""
    return input_of(action, schedule.num_stages)


def _where(rank: int, index: int, action: Action) -> str:
    return f"rank {rank}, index {index}, action {action.short()} ({action})"


def _check_shape(schedule: Schedule) -> None:
    s = schedule
    if s.num_ranks < 1 or s.num_stages < 1 or s.num_pipes < 1 or s.num_microbatches < 1:
        raise ScheduleError(f"sizes must be positive: {s.describe()}")
    if len(s.actions) != s.num_ranks:
        raise ScheduleError(f"{len(s.actions)} action lists for {s.num_ranks} ranks")
    if s.num_microbatches % s.num_pipes:
        raise ScheduleError(
            f"{s.num_microbatches} micro-batches cannot be split evenly over {s.num_pipes} pipes"
        )
    if len(s.placement) != s.num_pipes:
        raise ScheduleError(f"placement has {len(s.placement)} pipes, expected {s.num_pipes}")
    for pipe, ranks in enumerate(s.placement):
        if len(ranks) != s.num_stages:
            raise ScheduleError(
                f"placement of pipe {pipe} has {len(ranks)} stages, expected {s.num_stages}"
            )
        for stage, rank in enumerate(ranks):
            if not 0 <= rank < s.num_ranks:
                raise ScheduleError(f"placement: pipe {pipe} stage {stage} on invalid rank {rank}")


def _check_actions(schedule: Schedule) -> None:
    s = schedule
    for rank, rank_actions in enumerate(s.actions):
        for index, a in enumerate(rank_actions):
            where = _where(rank, index, a)
            if a.kind == WEIGHT and not s.split_backward:
                raise ScheduleError(f"W action in a schedule without split backward at {where}")
            if not 0 <= a.pipe < s.num_pipes:
                raise ScheduleError(f"pipe out of range 0..{s.num_pipes - 1} at {where}")
            if not 0 <= a.stage < s.num_stages:
                raise ScheduleError(f"stage out of range 0..{s.num_stages - 1} at {where}")
            if not 0 <= a.microbatch < s.num_microbatches:
                raise ScheduleError(
                    f"micro-batch out of range 0..{s.num_microbatches - 1} at {where}"
                )
            if s.pipe_of_microbatch(a.microbatch) != a.pipe:
                owner = s.pipe_of_microbatch(a.microbatch)
                raise ScheduleError(
                    f"micro-batch {a.microbatch} belongs to pipe {owner}, not {a.pipe}, at {where}"
                )
            holder = s.rank_of(a.pipe, a.stage)
            if holder != rank:
                raise ScheduleError(
                    f"wrong rank: pipe {a.pipe} stage {a.stage} is held by rank {holder}, "
                    f"but scheduled at {where}"
                )


def _check_complete(schedule: Schedule) -> None:
    s = schedule
    kinds = (FORWARD, BACKWARD, WEIGHT) if s.split_backward else (FORWARD, BACKWARD)
    seen: Counter[Action] = Counter()
    first_at: dict[Action, tuple[int, int]] = {}
    for rank, rank_actions in enumerate(s.actions):
        for index, a in enumerate(rank_actions):
            seen[a] += 1
            if seen[a] == 2:
                r0, i0 = first_at[a]
                raise ScheduleError(
                    f"duplicated action {a.short()} ({a}): at rank {r0} index {i0} "
                    f"and at rank {rank} index {index}"
                )
            first_at[a] = (rank, index)
    for pipe in range(s.num_pipes):
        for mb in s.microbatches_of_pipe(pipe):
            for stage in range(s.num_stages):
                for kind in kinds:
                    a = Action(kind, pipe, stage, mb)
                    if a not in seen:
                        raise ScheduleError(
                            f"missing action {a.short()} ({a}); it belongs on rank "
                            f"{s.rank_of(pipe, stage)}"
                        )
    if s.split_backward:
        for rank, rank_actions in enumerate(s.actions):
            for index, a in enumerate(rank_actions):
                if a.kind == WEIGHT:
                    b = Action(BACKWARD, a.pipe, a.stage, a.microbatch)
                    if first_at[b] > (rank, index):
                        raise ScheduleError(f"W before its B in the same rank's list at "
                                            f"{_where(rank, index, a)}")


def _check_deadlock(schedule: Schedule) -> None:
    """Execute the lists in order with blocking receives and buffered sends."""
    s = schedule
    heads = run_in_order(s.actions, s.num_stages)
    if stalled(s.actions, heads):
        located = {a: (r, i) for r, acts in enumerate(s.actions) for i, a in enumerate(acts)}
        blocked = []
        for rank, rank_actions in enumerate(s.actions):
            if heads[rank] < len(rank_actions):
                a = rank_actions[heads[rank]]
                dep = dependency(s, a)
                dep_rank, dep_index = located[dep]
                blocked.append(
                    f"{_where(rank, heads[rank], a)} waits for {dep.short()} "
                    f"(rank {dep_rank}, index {dep_index})"
                )
        raise ScheduleError("deadlock with blocking receives: " + "; ".join(blocked))


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` is well formed, complete, deadlock free."""
    _check_shape(schedule)
    _check_actions(schedule)
    _check_complete(schedule)
    _check_deadlock(schedule)


# ----------------------------------------------------------------------------- lowered schedules
def _check_messages(lowered: LoweredSchedule) -> None:
    """Every message is sent right after its producer and received before its consumer, once;
    between two ranks the receiver posts its receives in the sender's send order."""
    s = lowered.schedule
    for rank, ops in enumerate(lowered.lists):
        posted: set[Message] = set()
        last_compute: Action | None = None
        for index, op in enumerate(ops):
            if isinstance(op, Comm):
                m = op.message
                if (m.src if op.op == SEND else m.dst) != rank:
                    raise ScheduleError(f"rank {rank}, index {index}: {op.short()} belongs to "
                                        f"rank {m.src if op.op == SEND else m.dst}")
                if op.op == RECV:
                    if m in posted:
                        raise ScheduleError(f"rank {rank}: {op.short()} posted twice")
                    posted.add(m)
                elif last_compute is None or produced_message(s, last_compute) != m:
                    raise ScheduleError(f"rank {rank}, index {index}: {op.short()} does not "
                                        f"follow the action that produces it")
                continue
            last_compute = op
            needed = needed_message(s, op)
            if needed is not None and needed.src != rank and needed not in posted:
                raise ScheduleError(f"rank {rank}, index {index}: {op.short()} runs before the "
                                    f"RECV of its input {needed.short()}")
    sends: dict[tuple[int, int], list[Message]] = {}
    recvs: dict[tuple[int, int], list[Message]] = {}
    for ops in lowered.lists:
        for op in ops:
            if isinstance(op, Comm):
                table = sends if op.op == SEND else recvs
                table.setdefault((op.message.src, op.message.dst), []).append(op.message)
    for channel in sorted(set(sends) | set(recvs)):
        sent, received = sends.get(channel, []), recvs.get(channel, [])
        if sent != received:
            first = next((i for i, (a, b) in enumerate(zip(sent, received)) if a != b),
                         min(len(sent), len(received)))
            got = received[first].short() if first < len(received) else "nothing"
            want = sent[first].short() if first < len(sent) else "nothing"
            raise ScheduleError(
                f"rank {channel[1]} receives from rank {channel[0]} in another order than it "
                f"sends: receive {first} is {got}, send {first} is {want} (NCCL ignores tags and "
                f"matches the messages of a pair in issue order)")
    missing = set(sends) - set(lowered.connections)
    if missing:
        raise ScheduleError(f"directions {sorted(missing)} carry messages but are not connected")


class _Execution:
    """The lowered lists under NCCL's host semantics: posting a send or receive never blocks
    (connections are set up beforehand); a compute action waits until the SEND of each input
    it receives has been posted."""

    def __init__(self, lowered: LoweredSchedule) -> None:
        self.lists = lowered.lists
        self.where: dict[tuple[str, Message], tuple[int, int]] = {}
        for rank, ops in enumerate(self.lists):
            for index, op in enumerate(ops):
                if isinstance(op, Comm):
                    self.where[(op.op, op.message)] = (rank, index)
        s = lowered.schedule
        # per rank and index: the (rank, index) of the SEND a compute action waits for
        self.waits: list[list[tuple[int, int] | None]] = []
        for ops in self.lists:
            row: list[tuple[int, int] | None] = []
            for op in ops:
                needed = None if isinstance(op, Comm) else needed_message(s, op)
                row.append(self.where.get((SEND, needed)) if needed is not None else None)
            self.waits.append(row)

    def runnable(self, heads: list[int], rank: int) -> bool:
        """Whether ``rank``'s next operation can run now."""
        wait = self.waits[rank][heads[rank]]
        return wait is None or heads[wait[0]] > wait[1]

    def advance(self, heads: list[int], frozen: int | None = None) -> None:
        """Run every rank but ``frozen`` as far as it can."""
        progress = True
        while progress:
            progress = False
            for rank, ops in enumerate(self.lists):
                if rank == frozen:
                    continue
                while heads[rank] < len(ops) and self.runnable(heads, rank):
                    heads[rank] += 1
                    progress = True

    def unmatched(self, heads: list[int], rank: int) -> list[str]:
        """``rank``'s posted operations whose counterpart no other rank has posted yet."""
        pending = []
        for op in self.lists[rank][:heads[rank]]:
            if isinstance(op, Comm):
                peer, index = self.where[(RECV if op.op == SEND else SEND, op.message)]
                if heads[peer] <= index:
                    pending.append(f"{op.short()} (rank {peer} stopped at index {heads[peer]})")
        return pending


def _check_sync_anywhere(lowered: LoweredSchedule, ranks: Sequence[int] | None = None) -> None:
    """NCCL: a posted send or receive sits on the device until its peer posts the counterpart,
    and a device-wide sync (the allocator's free-and-retry on OOM, ``empty_cache``) waits for
    it. For each rank and each point of its list, stop the rank there, let the others run, and
    require every operation it posted to be matched -- or that sync would hang."""
    execution = _Execution(lowered)
    heads = [0] * len(lowered.lists)
    execution.advance(heads)
    if any(h < len(ops) for h, ops in zip(heads, lowered.lists)):
        stuck = [f"rank {r} at {lowered.lists[r][h].short()}" for r, h in enumerate(heads)
                 if h < len(lowered.lists[r])]
        raise ScheduleError("the lowered lists deadlock: " + "; ".join(stuck))
    for rank in range(len(lowered.lists)) if ranks is None else ranks:
        heads = [0] * len(lowered.lists)
        ops = lowered.lists[rank]
        while True:
            execution.advance(heads, frozen=rank)
            pending = execution.unmatched(heads, rank)
            if pending:
                at = ops[heads[rank]].short() if heads[rank] < len(ops) else "the end"
                raise ScheduleError(
                    f"a device-wide sync on rank {rank} before {at} (index {heads[rank]}) would "
                    f"hang: posted {', '.join(pending)} need(s) this rank's later work")
            if heads[rank] == len(ops):
                break
            if not execution.runnable(heads, rank):
                raise ScheduleError(f"rank {rank} cannot run {ops[heads[rank]].short()}")
            heads[rank] += 1


def validate_lowered(lowered: LoweredSchedule, ranks: Sequence[int] | None = None) -> None:
    """Raise :class:`ScheduleError` unless the lowered lists keep NCCL's rules: the compute
    lists are the schedule's, every message is sent after its producer and received before its
    consumer, per pair in one order (tags ignored), every direction is connected (warmed up in
    one global order), and a device-wide sync on any rank at any point cannot hang (checked for
    ``ranks``, default all: a rank of a job checks its own list)."""
    for rank, actions in enumerate(lowered.compute_lists()):
        expected = iteration_actions(lowered.schedule, rank, lowered.forward_only)
        if actions != expected:
            raise ScheduleError(f"rank {rank}: the lowered compute order differs from the "
                                f"schedule's")
    _check_messages(lowered)
    _check_sync_anywhere(lowered, ranks)
