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
4. *Pairs* (MoE overlap): every paired action is two neighbours of one rank's list, pairs do not
   overlap, and the halves are independent (:func:`~.actions.independent`); the deadlock check
   runs a pair only when both its inputs are there.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from megatron_chimera.errors import ScheduleError
from megatron_chimera.schedules.actions import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    Action,
    Schedule,
    independent,
    input_of,
)
from megatron_chimera.schedules.device_sync_check import (
    CollectivePlan,
    ExpertComm,
    check_sync_anywhere,
    plan_gradient_collectives,
)
from megatron_chimera.schedules.expert_ops import ExpertOp, check_expert_order
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


def check_pairs(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` unless every paired action is two neighbours of one rank's
    list, no action is in two pairs, and the halves are independent (the rule:
    :func:`~.actions.independent`)."""
    s = schedule
    if not s.pairs:
        return
    if len(s.pairs) != s.num_ranks:
        raise ScheduleError(f"pairs has {len(s.pairs)} lists for {s.num_ranks} ranks")
    for rank, starts in enumerate(s.pairs):
        actions = s.actions[rank]
        previous = -2
        for i in starts:
            if not 0 <= i < len(actions) - 1:
                raise ScheduleError(f"rank {rank}: pair index {i} is outside its list of "
                                    f"{len(actions)} actions (a pair is actions i and i+1)")
            if i <= previous + 1:
                raise ScheduleError(f"rank {rank}: pairs at indices {previous} and {i} overlap "
                                    f"or are not sorted")
            previous = i
            why = independent(actions[i], actions[i + 1], s.sequence_slices)
            if why is not None:
                raise ScheduleError(f"dependent pair at {_where(rank, i, actions[i])}: {why}")


def _check_deadlock(schedule: Schedule) -> None:
    """Execute the lists in order with blocking receives and buffered sends (a paired action
    waits for both inputs)."""
    s = schedule
    starts = s.pair_starts()
    heads = run_in_order(s.actions, s.num_stages, pairs=starts)
    if stalled(s.actions, heads):
        located = {a: (r, i) for r, acts in enumerate(s.actions) for i, a in enumerate(acts)}
        blocked = []
        for rank, rank_actions in enumerate(s.actions):
            if heads[rank] < len(rank_actions):
                a = rank_actions[heads[rank]]
                dep = dependency(s, a)
                if heads[rank] in starts[rank] and (
                        dep is None or located[dep][1] < heads[located[dep][0]]):
                    a = rank_actions[heads[rank] + 1]  # the pair waits for its second half
                    dep = dependency(s, a)
                dep_rank, dep_index = located[dep]
                blocked.append(
                    f"{_where(rank, heads[rank], a)} waits for {dep.short()} "
                    f"(rank {dep_rank}, index {dep_index})"
                )
        raise ScheduleError("deadlock with blocking receives: " + "; ".join(blocked))


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` is well formed, complete, in slice order
    (sequence-sliced schedules) and deadlock free."""
    _check_shape(schedule)
    _check_actions(schedule)
    _check_complete(schedule)
    check_pairs(schedule)
    _check_slice_order(schedule)
    _check_deadlock(schedule)


def _check_slice_order(schedule: Schedule) -> None:
    """Sequence slices run in slice order on every stage (:mod:`.slices`)."""
    from megatron_chimera.schedules.slices import slice_order_errors  # (slices builds on chimera)

    errors = slice_order_errors(schedule)
    if errors:
        raise ScheduleError("; ".join(errors[:3]) + (f" (+{len(errors) - 3} more)"
                                                     if len(errors) > 3 else ""))


# ----------------------------------------------------------------------------- lowered schedules
def _check_messages(lowered: LoweredSchedule) -> None:
    """Every message is sent right after its producer and received before its consumer, once;
    between two ranks the receiver posts its receives in the sender's send order."""
    s = lowered.schedule
    starts = lowered.pair_starts()
    for rank, ops in enumerate(lowered.lists):
        posted: set[Message] = set()
        last_step: list[Action] = []  # the last compute step: one action, or a pair's two
        computed = 0
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
                elif not any(produced_message(s, a) == m for a in last_step):
                    raise ScheduleError(f"rank {rank}, index {index}: {op.short()} does not "
                                        f"follow the action (or pair) that produces it")
                continue
            if computed - 1 in starts[rank]:
                if not isinstance(ops[index - 1], Action):
                    raise ScheduleError(f"rank {rank}, index {index}: an operation between the "
                                        f"halves of the pair ending with {op.short()}")
                last_step.append(op)
            else:
                last_step = [op]
            computed += 1
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


def validate_lowered(lowered: LoweredSchedule, ranks: Sequence[int] | None = None,
                     overlap_grad_reduce: bool = True,
                     gradient_collectives: bool = True,
                     expert_ops: Mapping[int, Sequence[ExpertOp]] | None = None,
                     expert_groups: Sequence[Sequence[int]] = (),
                     experts: ExpertComm | None = None) -> CollectivePlan | None:
    """Raise :class:`ScheduleError` unless the lowered lists keep NCCL's rules: the compute
    lists are the schedule's, every message is sent after its producer and received before its
    consumer, per pair in one order (tags ignored), every direction is connected (warmed up in
    one global order), and a device-wide sync on any rank at any point cannot hang -- on a
    pending send or receive (checked for ``ranks``, default all: a rank of a job checks its own
    list), or, in training, on a gradient collective of the stage-replica or embedding groups:
    then it returns the collectives' plan for ``overlap_grad_reduce``
    (:func:`.device_sync_check.plan_gradient_collectives`, every rank checked: each reaches the same
    plan), which defers to the end of the iteration the collectives that could hang a sync.
    Without ``gradient_collectives`` (a runner that reduces no gradients) only the
    point-to-point part is checked, for ``ranks``, and None returned. ``expert_ops`` (per
    rank of the world, :func:`.expert_ops.expert_ops`) and ``expert_groups``: every
    expert-parallel group's members issue the same all-to-alls in one order
    (:func:`.expert_ops.check_expert_order`). ``experts`` (per pipeline rank its lowered
    all-to-alls, and EP): the device-sync proof and the collectives' plan include them, over
    EP modelled data-parallel replicas (:mod:`.device_sync_check`)."""
    if expert_ops is not None:
        check_expert_order(expert_ops, expert_groups)
    for rank, actions in enumerate(lowered.compute_lists()):
        expected = iteration_actions(lowered.schedule, rank, lowered.forward_only)
        if actions != expected:
            raise ScheduleError(f"rank {rank}: the lowered compute order differs from the "
                                f"schedule's")
    _check_messages(lowered)
    replicas = experts.size if experts is not None else 1
    if lowered.forward_only or not gradient_collectives:
        check_sync_anywhere(lowered, ranks, None, replicas, 1, experts)
        return None
    return plan_gradient_collectives(lowered, overlap_grad_reduce, data_parallel=replicas,
                                     experts=experts)
