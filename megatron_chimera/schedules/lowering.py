"""Communication as part of the schedule: lower a compute-only schedule into per-rank lists with
explicit SEND and RECV operations, and a one-time connection warm-up in one global order.

Every message of an iteration follows from the dependency rule (:func:`~.actions.input_of`): the
forward ``F(p, s, m)`` sends its activation to stage ``s+1`` of pipe ``p``, the backward
``B(p, s, m)`` its input gradient to stage ``s-1``. Messages between two stages on one rank are
handed over locally and get no communication operation.

Where the operations go (NCCL's rules, see :func:`~.validate.validate_lowered`):

* ``SEND(m)`` right after the compute action that produces ``m``.
* ``RECV(m)`` before its consumer, ``lookahead`` compute actions early when that is *safe*: never
  before the last action of this rank that the sender's ``SEND(m)`` depends on (computed with
  vector clocks over the in-order walk), so a posted receive can always complete without this
  rank doing anything more -- a device-wide sync (an OOM retry, ``empty_cache``) can never wait
  on it forever. Receives from one sender are posted in the sender's send order: NCCL ignores
  tags and matches the messages of a pair in issue order.
* A paired action (MoE overlap, :attr:`~.actions.Schedule.pairs`) is one step: the receives of
  *both* halves are posted before the pair, and the sends of both halves follow the pair (the
  forward's first), since the halves run interleaved and finish together.
* ``connections``: every (sender, receiver) direction, in one global order (by rank pair). NCCL
  sets a connection up on the first exchange in each direction and blocks the host until the peer
  arrives; the runtime exchanges one tiny message per direction in this order once, before the
  first iteration, so no rank waits for a peer that waits for it.

The IR stays torch-free; the runtime (``pipeline/``) executes the lowered lists as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from megatron_chimera.schedules.actions import (
    BACKWARD,
    FORWARD,
    Action,
    Schedule,
    input_of,
    output_to,
)
from megatron_chimera.schedules.walk import run_in_order

ACTIVATION = 0
GRADIENT = 1
SEND = "SEND"
RECV = "RECV"
DEFAULT_LOOKAHEAD = 2


class Message(NamedTuple):
    """One activation (``stage -> stage+1``) or gradient (``stage+1 -> stage``) transfer."""

    direction: int  # ACTIVATION or GRADIENT
    pipe: int
    microbatch: int
    stage: int  # the lower stage of the edge
    src: int  # pipeline rank of the sender
    dst: int  # pipeline rank of the receiver

    def short(self) -> str:
        """Compact label, e.g. ``a0.2.5`` (activation, pipe 0, edge 2->3, micro-batch 5)."""
        return f"{'ag'[self.direction]}{self.pipe}.{self.stage}.{self.microbatch}"

    def producer(self) -> Action:
        """The action whose output this carries (the inverse of :func:`message_from`): the F of
        the lower stage (activation) or the B of the upper one (gradient)."""
        if self.direction == ACTIVATION:
            return Action(FORWARD, self.pipe, self.stage, self.microbatch)
        return Action(BACKWARD, self.pipe, self.stage + 1, self.microbatch)

    def consumer(self) -> Action:
        """The action that reads this: the F of the upper stage (activation) or the B of the
        lower one (gradient)."""
        if self.direction == ACTIVATION:
            return Action(FORWARD, self.pipe, self.stage + 1, self.microbatch)
        return Action(BACKWARD, self.pipe, self.stage, self.microbatch)

    def tag(self, num_pipes: int, num_microbatches: int) -> int:
        """A tag unique within one iteration (backends that match by tag; NCCL ignores it)."""
        return ((self.stage * num_pipes + self.pipe) * num_microbatches
                + self.microbatch) * 2 + self.direction


class Comm(NamedTuple):
    """A communication operation of a lowered list: ``SEND`` or ``RECV`` of one message."""

    op: str  # SEND or RECV
    message: Message

    @property
    def peer(self) -> int:
        """The pipeline rank at the other end."""
        return self.message.dst if self.op == SEND else self.message.src

    def short(self) -> str:
        """Compact label, e.g. ``RECV a0.2.5<-1``."""
        arrow = "->" if self.op == SEND else "<-"
        return f"{self.op} {self.message.short()}{arrow}{self.peer}"


Op = Action | Comm


def message_from(producer: Action, schedule: Schedule) -> Message:
    """The transfer of ``producer``'s output to the next stage (F) or the previous stage (B)."""
    p, s, m = producer.pipe, producer.stage, producer.microbatch
    if producer.kind == FORWARD:
        return Message(ACTIVATION, p, m, s, schedule.rank_of(p, s), schedule.rank_of(p, s + 1))
    return Message(GRADIENT, p, m, s - 1, schedule.rank_of(p, s), schedule.rank_of(p, s - 1))


def produced_message(schedule: Schedule, action: Action) -> Message | None:
    """The message ``action`` sends when it finishes (None at the pipe ends and for W)."""
    if output_to(action, schedule.num_stages) is None:
        return None
    return message_from(action, schedule)


def needed_message(schedule: Schedule, action: Action) -> Message | None:
    """The message ``action`` must receive before it runs (None when its input is produced on
    its own stage: F of stage 0, B of the last stage, W)."""
    producer = input_of(action, schedule.num_stages)
    if producer is None or producer.stage == action.stage:
        return None
    return message_from(producer, schedule)


def iteration_actions(schedule: Schedule, rank: int, forward_only: bool = False) -> list[Action]:
    """``rank``'s compute actions of one iteration (only the forwards in forward-only mode)."""
    actions = schedule.actions[rank]
    return [a for a in actions if a.kind == FORWARD] if forward_only else list(actions)


@dataclass
class LoweredSchedule:
    """A schedule with its communication: per rank, compute actions and SEND / RECV operations
    in issue order, and the directions to connect once, in one global order."""

    schedule: Schedule
    lists: list[list[Op]]
    connections: list[tuple[int, int]]  # (sender, receiver) pipeline ranks
    forward_only: bool = False
    lookahead: int = DEFAULT_LOOKAHEAD
    meta: dict = field(default_factory=dict)

    def pair_starts(self) -> list[frozenset[int]]:
        """Per rank, the compute indices (into :meth:`compute_lists`) where a paired action
        starts; none in forward-only mode (there are no backwards to pair)."""
        if self.forward_only:
            return [frozenset()] * self.schedule.num_ranks
        return self.schedule.pair_starts()

    def compute_lists(self) -> list[list[Action]]:
        """Per rank, the compute actions only."""
        return [[op for op in ops if isinstance(op, Action)] for ops in self.lists]

    def comms(self, rank: int) -> list[Comm]:
        """``rank``'s communication operations in issue order."""
        return [op for op in self.lists[rank] if isinstance(op, Comm)]

    def describe(self) -> str:
        """One line: the schedule, the mode and the number of messages."""
        sends = sum(1 for ops in self.lists for op in ops
                    if isinstance(op, Comm) and op.op == SEND)
        mode = "forward-only" if self.forward_only else "training"
        return (f"{self.schedule.describe()} lowered ({mode}, lookahead {self.lookahead}): "
                f"{sends} messages, {len(self.connections)} connections")


class _Clocks:
    """Vector clocks of an in-order execution: for every compute action, per rank, the index of
    the last compute action of that rank it depends on (-1: none). Kept in full for actions
    that send to another rank (the receiver merges them) and, per rank, for its neighbours."""

    def __init__(self, schedule: Schedule, lists: Sequence[Sequence[Action]],
                 pairs: Sequence[frozenset[int]] | None = None) -> None:
        num_ranks, num_stages = schedule.num_ranks, schedule.num_stages
        running = [[-1] * num_ranks for _ in range(num_ranks)]
        index = {a: i for actions in lists for i, a in enumerate(actions)}
        self.sent: dict[Action, list[int]] = {}
        # rank -> neighbour -> clock component after each of the rank's compute actions
        self.toward: list[dict[int, list[int]]] = [{} for _ in range(num_ranks)]
        for pipe in schedule.placement:
            for a, b in zip(pipe, pipe[1:]):
                if a != b:
                    self.toward[a].setdefault(b, [])
                    self.toward[b].setdefault(a, [])

        def run(rank: int, action: Action, dep: Action | None) -> None:
            mine = running[rank]
            if dep is not None and dep in self.sent:  # the input arrived from another rank
                mine[:] = [max(x, y) for x, y in zip(mine, self.sent[dep])]
            mine[rank] = index[action]
            for peer, components in self.toward[rank].items():
                components.append(mine[peer])
            nxt = output_to(action, num_stages)
            if nxt is not None and schedule.rank_of(nxt.pipe, nxt.stage) != rank:
                self.sent[action] = list(mine)

        def run_pair(rank: int, first: tuple[Action, Action | None],
                     second: tuple[Action, Action | None]) -> None:
            # both inputs arrive before the pair; both outputs leave after it
            mine = running[rank]
            for _, dep in (first, second):
                if dep is not None and dep in self.sent:
                    mine[:] = [max(x, y) for x, y in zip(mine, self.sent[dep])]
            mine[rank] = index[second[0]]
            for _ in range(2):
                for peer, components in self.toward[rank].items():
                    components.append(mine[peer])
            for action, _ in (first, second):
                nxt = output_to(action, num_stages)
                if nxt is not None and schedule.rank_of(nxt.pipe, nxt.stage) != rank:
                    self.sent[action] = list(mine)

        run_in_order(lists, num_stages, run, pairs, run_pair)

    def latest_post(self, dst: int, src: int, producer_index: int, consumer_index: int) -> int:
        """The last compute index of ``dst`` before which a receive from ``src`` may be posted so
        that ``dst`` gets there without ``src`` running past ``producer_index``: a send posted
        right after the producer can then always complete while ``src`` waits (device sync)."""
        components = self.toward[dst][src]
        lo, hi = 0, consumer_index  # post before compute ``post``: depends on compute post - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if components[mid - 1] <= producer_index:
                lo = mid
            else:
                hi = mid - 1
        return lo


def lower(schedule: Schedule, forward_only: bool = False, lookahead: int = DEFAULT_LOOKAHEAD,
          safe_posting: bool = True) -> LoweredSchedule:
    """Lower ``schedule`` (a validated compute schedule) for training or forward-only runs.

    ``safe_posting=False`` posts every receive ``lookahead`` actions early regardless of NCCL's
    rules (the old executor's behaviour): only for tests that show the checks catch it.
    """
    if lookahead < 0:
        raise ValueError(f"lookahead must be >= 0, got {lookahead}")
    compute = [iteration_actions(schedule, r, forward_only) for r in range(schedule.num_ranks)]
    pairs = [frozenset()] * schedule.num_ranks if forward_only else schedule.pair_starts()
    clocks = _Clocks(schedule, compute, pairs)
    # a pair's halves receive before its first index and send after its second
    position = {a: (r, i - 1 if i - 1 in pairs[r] else i)
                for r, actions in enumerate(compute) for i, a in enumerate(actions)}
    # channel (src, dst) -> [(message, earliest, latest, preferred post index)] in send order
    channels: dict[tuple[int, int], list[tuple[Message, int, int, int]]] = {}
    sends_after: dict[tuple[int, int], list[Message]] = {}
    for src, actions in enumerate(compute):
        for i, action in enumerate(actions):
            if action not in clocks.sent:
                continue
            if i in pairs[src]:
                i += 1  # the pair's forward sends after the pair
            message = message_from(action, schedule)
            dst, k = position[output_to(action, schedule.num_stages)]
            earliest = clocks.sent[action][dst] + 1  # the sender no longer needs this rank
            latest = clocks.latest_post(dst, src, i, k)  # this rank no longer needs the sender
            channels.setdefault((src, dst), []).append((message, earliest, latest, k - lookahead))
            sends_after.setdefault((src, i), []).append(message)
    posts: dict[tuple[int, int], list[Message]] = {}  # (dst, before compute index) -> RECVs
    for (_, dst), entries in sorted(channels.items()):
        upper = [latest if safe_posting else preferred + lookahead
                 for _, _, latest, preferred in entries]
        for j in range(len(upper) - 2, -1, -1):  # FIFO: posted no later than the next message
            upper[j] = min(upper[j], upper[j + 1])
        previous = 0
        for (message, earliest, _, preferred), latest in zip(entries, upper):
            if safe_posting:
                post = min(max(preferred, earliest, previous), latest)
            else:  # consumer-driven prefetch, blind to what the sender needs from this rank
                post = min(max(preferred, previous, 0), latest)
            if post - 1 in pairs[dst]:
                post -= 1  # never between a pair's halves: before the pair
            previous = post
            posts.setdefault((dst, post), []).append(message)
    lists: list[list[Op]] = []
    for rank, actions in enumerate(compute):
        ops: list[Op] = []
        for i, action in enumerate(actions):
            ops += [Comm(RECV, m) for m in posts.get((rank, i), ())]
            ops.append(action)
            ops += [Comm(SEND, m) for m in sends_after.get((rank, i), ())]
        lists.append(ops)
    connections = sorted(channels, key=lambda d: (min(d), max(d), d[0]))
    return LoweredSchedule(schedule, lists, connections, forward_only, lookahead,
                           meta={"safe_posting": safe_posting})


def connection_order(*lowered: LoweredSchedule) -> list[tuple[int, int]]:
    """Every direction of the given lowered schedules once, in the one global order."""
    directions = {d for low in lowered for d in low.connections}
    return sorted(directions, key=lambda d: (min(d), max(d), d[0]))
