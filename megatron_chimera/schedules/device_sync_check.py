"""Device-wide syncs against pending operations: point-to-point and gradient collectives, over
the W data-parallel replicas and T tensor ranks of a pipeline.

NCCL keeps a posted operation on the device until it is matched: a send or receive until its
peer posted the counterpart, a collective until every member of its group posted it. A
device-wide sync (the allocator's free-and-retry on OOM, ``empty_cache``, ``synchronize``) on one
rank waits for all of them. So for each rank and each point of its list, stop the rank there,
let every other rank run as far as it can, and require everything the stopped rank posted to be
matched -- or that sync would hang.

The world is modelled explicitly: rank ``(w, t, r)`` (data-parallel replica, tensor rank,
pipeline rank) runs pipeline rank ``r``'s lowered list; its messages go to ``(w, t, peer)``; its
compute actions contain the tensor-parallel collectives, so the T ranks ``(w, *, r)`` run each
action together (none finishes it while one of them is stopped before it). Its gradient
collectives (:func:`gradient_collectives`) stand where the runtime's synchronizer issues them:
after the rank's last backward (or W) of a stage and its sends, or during that action with
overlapped reduction; in descending stage order, the tied embedding last. A collective is
matched once every member of its group -- over all replicas, one tensor rank -- posted it. The
distributed optimizer issues reduce-scatters at the same points instead of all-reduces (and
gathers parameters after the step, outside the iteration), so it needs no model of its own.
Posting never blocks: connections and communicators exist before the first iteration.

The expert all-to-alls (:mod:`.expert_ops`; ``experts``: per pipeline rank its lowered ops and
the expert-parallel size EP) are posts of their own: a compute step (an action, or a pair's two)
that issues some starts once its inputs are there (both halves' for a pair), then posts its
all-to-alls in issue order; each waits for the previous all-to-all of its action to be matched
(every member of the EP group -- EP consecutive local ranks ``w x T + t`` of one pipeline rank
-- posted it: the piece that issues it consumes that one's result), and so does the action's
end for its last one. The T tensor ranks post each together (the pieces between them hold the
tensor-parallel collectives).

A collective that could hang a sync where the synchronizer would issue it is not an error of the
schedule: :func:`plan_gradient_collectives` moves it (and what follows it in the order) to the
end of the iteration, where a rank waits for no one; the runtime issues it there.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from megatron_chimera.errors import ScheduleError
from megatron_chimera.schedules.actions import Action, Schedule
from megatron_chimera.schedules.expert_ops import ExpertOp
from megatron_chimera.schedules.lowering import RECV, SEND, Comm, LoweredSchedule, needed_message


class Collective(NamedTuple):
    """A gradient collective of one iteration: its name and the pipeline ranks of its group
    (in every data-parallel replica, of one tensor rank)."""

    name: str
    members: tuple[int, ...]

    def short(self) -> str:
        """Label for messages, e.g. ``reduce(stage 3)``."""
        return f"reduce({self.name})"


class Planned(NamedTuple):
    """Where a rank issues a collective: right before its compute action ``index`` (``index`` =
    the list's length: at its end), or -- ``inside`` -- during that action, once it started."""

    index: int
    collective: Collective
    inside: bool = False


class Started(NamedTuple):
    """The start of a compute action (its input arrived) in a rank's list: collectives issued
    during the action stand between it and the action itself."""

    action: Action

    def short(self) -> str:
        """Label for messages."""
        return f"{self.action.short()} (started)"


class Posted(NamedTuple):
    """A collective in a rank's list, posted where it stands."""

    collective: Collective

    def short(self) -> str:
        """Label for messages."""
        return self.collective.short()


class Exchange(NamedTuple):
    """An expert all-to-all posted in a rank's list (every member of its EP group posts it at
    the same point: they run the same list)."""

    op: ExpertOp

    def short(self) -> str:
        """Label for messages, e.g. ``all-to-all F0.1.3:dispatch``."""
        return f"all-to-all {self.op.short()}"


class ExpertComm(NamedTuple):
    """The expert all-to-alls of the modelled world: per pipeline rank its lowered ops in issue
    order (:func:`.expert_ops.expert_ops`; a rank missing: none) and the expert-parallel size."""

    ops: Mapping[int, Sequence[ExpertOp]]
    size: int


def _exchange_steps(actions: Sequence[Action], starts: frozenset[int],
                    ops: Sequence[ExpertOp], rank: int) -> dict[int, list[ExpertOp]]:
    """``rank``'s all-to-alls by the compute step that issues them (its first index)."""
    index = {a: i for i, a in enumerate(actions)}
    steps: dict[int, list[ExpertOp]] = {}
    last = -1
    for op in ops:
        i = index.get(op.action)
        if i is None:
            raise ScheduleError(f"rank {rank}: all-to-all {op.short()} belongs to no action of "
                                f"its lowered list")
        if i - 1 in starts:
            i -= 1  # a pair's second half: the pair's step
        if i < last:
            raise ScheduleError(f"rank {rank}: all-to-all {op.short()} is issued after those of "
                                f"a later action ({actions[last].short()})")
        last = i
        steps.setdefault(i, []).append(op)
    return steps


class CollectiveHang(ScheduleError):
    """A device-wide sync would wait on gradient collectives only (no send or receive):
    ``collectives`` names them (``stage s``, ``embedding``). Issuing them at the end of the
    iteration resolves it (:func:`plan_gradient_collectives`)."""

    def __init__(self, message: str, collectives: frozenset[str]) -> None:
        super().__init__(message)
        self.collectives = collectives


class CollectivePlan(NamedTuple):
    """Where every rank issues its gradient collectives (:func:`gradient_collectives`), and
    which of them wait for the end of the iteration so that no device-wide sync can hang."""

    plans: list[list[Planned]]
    deferred: frozenset[str]


def gradient_collectives(schedule: Schedule, tied_embedding: bool = True,
                         overlap_grad_reduce: bool = True,
                         deferred: frozenset[str] = frozenset()) -> list[list[Planned]]:
    """Per pipeline rank, where it issues each gradient collective, in issue order.

    A stage's reduction is issued once the rank's last backward (W when split) of that stage
    is over and its sends are posted -- or, with ``overlap_grad_reduce``, bucket by bucket
    during that action (modelled as soon as it started: the action's own allocations may sync
    the device). Stages go in descending order (one waits for every higher one of the rank);
    with ``tied_embedding`` and the first and last stage on different ranks, the embedding's
    reduction follows once every final action of the rank is over (it is issued between
    actions only). The collectives named in ``deferred`` (``stage s``, ``embedding``) are issued
    at the end of the rank's list, on every rank, after all the others (in the same order); the
    others do not wait for them.
    """
    last = schedule.num_stages - 1
    holders = {s: tuple(sorted({schedule.rank_of(p, s) for p in range(schedule.num_pipes)}))
               for s in range(schedule.num_stages)}
    embedding = tuple(sorted(set(holders[0]) | set(holders[last])))
    plans = []
    for rank in range(schedule.num_ranks):
        final: dict[int, int] = {}
        for index, action in enumerate(schedule.actions[rank]):
            if action.kind == schedule.release_kind:
                final[action.stage] = index
        end = len(schedule.actions[rank])
        plan: list[Planned] = []
        late: list[Planned] = []  # the deferred ones, issued after every other
        for stage in sorted(final, reverse=True):
            collective = Collective(f"stage {stage}", holders[stage])
            if collective.name in deferred:
                late.append(Planned(end, collective))
                continue
            at = (Planned(final[stage], collective, True) if overlap_grad_reduce
                  else Planned(final[stage] + 1, collective))
            if plan and (plan[-1].index, plan[-1].inside) > (at.index, at.inside):
                at = plan[-1]._replace(collective=at.collective)  # waits for the one before
            plan.append(at)
        if tied_embedding and final and holders[0] != holders[last] and (
                0 in final or last in final):
            collective = Collective("embedding", embedding)
            if collective.name in deferred:
                late.append(Planned(end, collective))
            else:
                at = max([max(final.values()) + 1] + [p.index for p in plan[-1:]])
                plan.append(Planned(at, collective))
        plans.append(plan + late)
    return plans


def plan_gradient_collectives(lowered: LoweredSchedule, overlap_grad_reduce: bool = True,
                              tied_embedding: bool = True, data_parallel: int = 1,
                              tensor_parallel: int = 1,
                              experts: ExpertComm | None = None) -> CollectivePlan:
    """The gradient collectives of ``lowered`` placed so that a device-wide sync on any rank at
    any point cannot hang: each issued as early as :func:`gradient_collectives` puts it, unless
    one of its group could then wait for another member's later work -- such collectives are
    issued at the end of the iteration instead, on every rank (found by the check of every
    rank, so every rank of a job reaches the same plan), with the expert all-to-alls of
    ``experts`` in the lists. Raises :class:`ScheduleError` when point-to-point (and the
    all-to-alls) alone would hang."""
    deferred: frozenset[str] = frozenset()
    while True:
        plans = gradient_collectives(lowered.schedule, tied_embedding, overlap_grad_reduce,
                                     deferred)
        try:
            check_sync_anywhere(lowered, None, plans, data_parallel, tensor_parallel, experts)
        except CollectiveHang as hang:
            if hang.collectives <= deferred:  # cannot be: at the end a rank waits for no one
                raise
            deferred |= hang.collectives
            continue
        return CollectivePlan(plans, deferred)


class _World:
    """Every rank's list (communication, compute, collectives and all-to-alls) and their
    progress."""

    def __init__(self, lowered: LoweredSchedule,
                 collectives: Sequence[Sequence[Planned]],
                 data_parallel: int, tensor_parallel: int,
                 experts: ExpertComm | None = None) -> None:
        schedule = lowered.schedule
        self.replicas = [(w, t) for w in range(data_parallel) for t in range(tensor_parallel)]
        self.data_parallel, self.tensor_parallel = data_parallel, tensor_parallel
        size = experts.size if experts is not None else 1
        if size < 1 or (data_parallel * tensor_parallel) % size:
            raise ValueError(f"expert-parallel size {size} does not divide the "
                             f"{data_parallel} x {tensor_parallel} modelled ranks of a pipeline "
                             f"rank")
        # (w, t) -> its expert-parallel group (consecutive local ranks w x T + t)
        self.expert_group = {
            (w, t): [divmod(i, tensor_parallel) for i in range(
                (w * tensor_parallel + t) // size * size,
                (w * tensor_parallel + t) // size * size + size)]
            for w, t in self.replicas}
        computes, starts = lowered.compute_lists(), lowered.pair_starts()
        self.lists: list[list] = []
        for rank, ops in enumerate(lowered.lists):
            before: dict[int, list[Posted]] = {}
            inside: dict[int, list[Posted]] = {}
            for planned in collectives[rank] if collectives else ():
                table = inside if planned.inside else before
                table.setdefault(planned.index, []).append(Posted(planned.collective))
            steps = _exchange_steps(computes[rank], starts[rank],
                                    experts.ops.get(rank, ()) if experts else (), rank)
            merged, compute = [], 0
            for op in ops:
                if isinstance(op, Action):
                    merged += before.get(compute, [])
                    if compute in steps:  # both halves start, then the all-to-alls
                        step = 2 if compute in starts[rank] else 1
                        merged += [Started(a) for a in computes[rank][compute:compute + step]]
                        for i in range(compute, compute + step):
                            merged += inside.pop(i, [])
                        merged += [Exchange(e) for e in steps[compute]]
                    elif compute in inside:
                        merged += [Started(op), *inside[compute]]
                    compute += 1
                merged.append(op)
            self.lists.append(merged + before.get(compute, []))
        # per rank and index: the all-to-all (its index) that must be matched first
        self.after: list[list[int | None]] = []
        for ops in self.lists:
            last: dict[Action, int] = {}
            after: list[int | None] = []
            for index, op in enumerate(ops):
                if isinstance(op, Exchange):
                    after.append(last.get(op.op.action))
                    last[op.op.action] = index
                else:
                    after.append(last.get(op) if isinstance(op, Action) else None)
            self.after.append(after)
        self.where: dict[tuple, int] = {}  # (SEND/RECV, message) or collective -> (rank, index)
        self.rank_of: dict[tuple, int] = {}
        for rank, ops in enumerate(self.lists):
            for index, op in enumerate(ops):
                key = (op.op, op.message) if isinstance(op, Comm) else (
                    (rank, op.collective) if isinstance(op, Posted) else None)
                if key is not None:
                    self.where[key], self.rank_of[key] = index, rank
        # per rank and index: (peer rank, index) of the SEND a compute action waits for
        self.waits = [[self._send_of(schedule, op) for op in ops] for ops in self.lists]
        self.heads = {(w, t, r): 0 for w, t in self.replicas for r in range(len(self.lists))}
        self.dependents = self._dependents()

    def _dependents(self) -> dict[tuple[int, int, int], list[tuple[int, int, int]]]:
        """Per rank ``(w, t, r)``: the other ranks whose next step reads its head -- the
        pipeline ranks waiting for its sends (and ``r``) in the replicas that read replica
        ``(w, t)``'s heads (its tensor group, the expert groups containing it); only those can
        become able to step when it advances (:meth:`advance`)."""
        readers: list[set[int]] = [{r} for r in range(len(self.lists))]
        for r, waits in enumerate(self.waits):
            for wait in waits:
                if wait is not None:
                    readers[wait[0]].add(r)
        replica_readers = {key: set() for key in self.replicas}
        for v, u in self.replicas:
            for x, y in self.replicas:
                if x == v or any((v, u) in self.expert_group[(x, z)]
                                 for z in range(self.tensor_parallel)):
                    replica_readers[(v, u)].add((x, y))
        return {(w, t, r): [(v, u, q) for v, u in sorted(replica_readers[(w, t)])
                            for q in sorted(readers[r]) if (v, u, q) != (w, t, r)]
                for w, t, r in self.heads}

    def _send_of(self, schedule: Schedule, op) -> tuple[int, int] | None:
        if isinstance(op, Started):
            op = op.action
        elif not isinstance(op, Action):
            return None
        needed = needed_message(schedule, op)
        key = (SEND, needed)
        return (self.rank_of[key], self.where[key]) if needed is not None and key in self.where \
            else None

    def reset(self) -> None:
        """Every rank back at the start of the iteration."""
        for key in self.heads:
            self.heads[key] = 0

    def _ready(self, w: int, t: int, r: int) -> bool:
        """The next operation's input arrived and the all-to-all it consumes is matched."""
        head = self.heads[(w, t, r)]
        wait = self.waits[r][head]
        if wait is not None and self.heads[(w, t, wait[0])] <= wait[1]:
            return False
        exchange = self.after[r][head]
        return exchange is None or all(self.heads[(v, u, r)] > exchange
                                       for v, u in self.expert_group[(w, t)])

    def _step(self, w: int, t: int, r: int, frozen: tuple[int, int, int] | None) -> bool:
        """Run ``(w, t, r)``'s next operation if it can; a compute action (or an all-to-all)
        runs on all T tensor ranks of ``(w, r)`` at once, and only when every one of them
        can."""
        head = self.heads[(w, t, r)]
        if head >= len(self.lists[r]) or (w, t, r) == frozen:
            return False
        op = self.lists[r][head]
        if isinstance(op, Started) and not self._ready(w, t, r):
            return False
        if not isinstance(op, (Action, Exchange)):
            self.heads[(w, t, r)] += 1
            return True
        group = [(w, u, r) for u in range(self.tensor_parallel)]
        if any(g == frozen or self.heads[g] != head or not self._ready(*g) for g in group):
            return False
        for g in group:
            self.heads[g] += 1
        return True

    def advance(self, frozen: tuple[int, int, int] | None = None,
                moved: Sequence[tuple[int, int, int]] | None = None) -> None:
        """Run every rank but ``frozen`` as far as it can. ``moved``: the ranks that advanced
        since the last call with this ``frozen`` (no other did): only the ranks reading their
        heads are examined first (the others could not step then and still cannot)."""
        if moved is None:
            queue = deque(self.heads)
        else:
            queue = deque(dict.fromkeys(d for m in moved for d in self.dependents[m]))
        queued = set(queue)
        while queue:  # a rank that steps puts the ranks reading its head back in the queue
            key = queue.popleft()
            queued.discard(key)
            if not self._step(*key, frozen):
                continue
            while self._step(*key, frozen):
                pass
            for other in self.dependents[key]:
                if other not in queued:
                    queued.add(other)
                    queue.append(other)

    def unmatched(self, rank: tuple[int, int, int],
                  start: int = 0) -> list[tuple[str, str | None]]:
        """What ``rank`` posted (from its index ``start`` on) that some peer or group member
        has not posted yet: (label, the collective's name or None for a send or receive)."""
        w, t, r = rank
        pending = []
        for index, op in enumerate(self.lists[r][start:self.heads[rank]], start):
            if isinstance(op, Exchange):
                late = [(v, u) for v, u in self.expert_group[(w, t)]
                        if self.heads[(v, u, r)] <= index]
                if late:
                    v, u = late[0]
                    pending.append((f"{op.short()} (replica {v}, tensor rank {u} of pipeline "
                                    f"rank {r} stopped at index {self.heads[(v, u, r)]})", None))
            elif isinstance(op, Comm):
                key = (RECV if op.op == SEND else SEND, op.message)
                peer, at = self.rank_of[key], self.where[key]
                if self.heads[(w, t, peer)] <= at:
                    pending.append((f"{op.short()} (rank {peer} stopped at index "
                                    f"{self.heads[(w, t, peer)]})", None))
            elif isinstance(op, Posted):
                late = [(v, m) for v in range(self.data_parallel) for m in op.collective.members
                        if self.heads[(v, t, m)] <= self.where[(m, op.collective)]]
                if late:
                    v, m = late[0]
                    pending.append((f"{op.short()} (rank {m} of replica {v} stopped at "
                                    f"index {self.heads[(v, t, m)]} before posting it)",
                                    op.collective.name))
        return pending


def check_sync_anywhere(lowered: LoweredSchedule, ranks: Sequence[int] | None = None,
                        collectives: Sequence[Sequence[Planned]] | None = None,
                        data_parallel: int = 1, tensor_parallel: int = 1,
                        experts: ExpertComm | None = None) -> None:
    """Raise :class:`ScheduleError` unless the lists run to the end and a device-wide sync
    on any of ``ranks`` (pipeline ranks, default all; replica 0, tensor rank 0 -- the others run
    the same lists) at any point cannot hang, with the given gradient ``collectives``
    (:func:`gradient_collectives`; None: point-to-point only) and the expert all-to-alls of
    ``experts`` (EP must divide the modelled ``data_parallel`` x ``tensor_parallel`` ranks)."""
    world = _World(lowered, collectives or (), data_parallel, tensor_parallel, experts)
    world.advance()
    stuck = [f"rank {r} at {world.lists[r][h].short()}" for (w, t, r), h in world.heads.items()
             if h < len(world.lists[r]) and (w, t) == (0, 0)]
    if stuck:
        raise ScheduleError("the lowered lists deadlock: " + "; ".join(stuck))
    for r in range(len(world.lists)) if ranks is None else ranks:
        world.reset()
        me, ops = (0, 0, r), world.lists[r]
        moved: list[tuple[int, int, int]] | None = None  # the first advance examines every rank
        matched = 0  # me's posts before this index are matched (and stay so: heads only grow)
        while True:
            world.advance(frozen=me, moved=moved)
            pending = world.unmatched(me, matched)
            if pending:
                head = world.heads[me]
                at = ops[head].short() if head < len(ops) else "the end"
                message = (f"a device-wide sync on rank {r} before {at} (index {head}) would "
                           f"hang: posted {', '.join(text for text, _ in pending)} need(s) this "
                           f"rank's later work")
                names = frozenset(name for _, name in pending)
                if None in names:
                    raise ScheduleError(message)
                raise CollectiveHang(message, names)
            if world.heads[me] == len(ops):
                break
            matched = world.heads[me]
            if not world._step(*me, frozen=None):
                raise ScheduleError(f"rank {r} cannot run {ops[world.heads[me]].short()}")
            moved = [(0, t, r) for t in range(world.tensor_parallel)]  # me's tensor group
