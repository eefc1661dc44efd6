"""In-order discrete-event simulation of a schedule under an alpha-beta cost model.

Each rank executes its action list in order. An action starts when its rank is free and its input
has arrived: the action it depends on (:func:`~.actions.input_of`) has finished, plus the
point-to-point message time of that edge (``CostModel.p2p_edges``, e.g. intra- or inter-node)
when that action ran on another rank, plus the host's own work before each compute
(``CostModel.action_overhead``: the runtime's bookkeeping and, after a wait, waking up). Sends
never block.

After a rank's last backward (last W when the backward is split) of a stage, the rank may start
that stage's gradient all-reduce over all replicas of the stage (the stage's replicas in the
schedule times ``data_parallel_size``). All ranks issue their all-reduces in one global order,
descending stage id, on communication channels that overlap compute; an all-reduce starts when
every replica has reached it and a channel of each is free, and costs Rabenseifner's
``2 log2(r) alpha + 2 (r-1)/r bytes beta``. ``CostModel.grad_reduce`` says when a stage's
gradients may go: ``stage`` (eager, as above), ``overlap`` (``--overlap-grad-reduce``: the
stage's ``grad_buckets`` equal buckets become final one after another during its last backward,
each reduced as soon as it is final, in order on one channel) or ``end`` (after the rank's last
compute: nothing hidden). ``CostModel.allreduce_channels`` is how many stage all-reduces one rank
runs at once at full speed: 1 where they share the bandwidth (device-direct, e.g. NCCL over one
NIC); more where one reduction is limited by its own path, not the NIC (gloo: one TCP connection
per peer and process group, ``HardwareProfile.concurrent_collectives``).

MoE all-to-all (``CostModel.all_to_all_cost``, A_s per stage and direction): an unpaired F or B
of stage s pays its compute C plus A_s, exposed (nothing overlaps it). A paired action
(:attr:`~.actions.Schedule.pairs`: halves x of stage s and y of stage t, independent
micro-batches, e.g. an F and a B) starts when the rank is free and *both* inputs are there, pays
the action overhead once and lasts

    T_pair = max(C_x(s) + C_y(t), A_x(s) + A_y(t))

(each half's dispatch and combine run while the other half computes, perfect overlap; a W
carries no all-to-all, so a W beside a lone F or B lasts ``max(C_x + C_W, A_x)``); both outputs
leave at its end. Its exposed all-to-all is ``max(0, A_x + A_y - C_x - C_y)``.
``SimResult.exposed_all_to_all`` sums, per rank, what its unpaired actions and pairs expose.

That is perfect overlap: the limit of many MoE layers per stage when neither half alone needs
longer (its own compute and all-to-all are serial). With ``CostModel.moe_layers_per_stage`` k > 0 a
pair is costed as the paired runtime (``pipeline/overlap.py``) runs it, at piece granularity
(:func:`baton_pair_time`; the one-thread runtime alternates the same way, and runs an F&F
pair -- two drivers -- one half after the other): each half is k MoE layers, an F
``(compute, all-to-all) x 2k`` and a B
the reverse ``(all-to-all, compute) x 2k``, every piece 1/2k of the action's compute or
all-to-all time; the halves take turns (a **baton**: the leading half computes up to its first
all-to-all, issues it and hands over, the other half computes up to its first, and so on; a
half waits for its own all-to-all when the baton comes back), and the rank's all-to-alls share
one link, one after the other. An F&B pair of equal pieces then costs exactly max(...) above;
two backwards cost one piece more (the later half's first all-to-all has nothing to hide
behind). ``CostModel.hand_over_cost`` adds the runtime's host time per hand-over (a switch
between the halves' pieces), as the benchmark measures it
(``pipeline/pair_calibration.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from operator import attrgetter
from typing import Any

from megatron_chimera.schedules.actions import BACKWARD, FORWARD, WEIGHT, Action, Schedule
from megatron_chimera.schedules.blocking_p2p import P2P_EXCHANGES, blocking_timeline
from megatron_chimera.schedules.validate import ScheduleError
from megatron_chimera.schedules.walk import run_in_order, stalled

PerStage = float | Sequence[float]


@dataclass(frozen=True)
class CostModel:
    """Times (any unit, e.g. seconds) of compute and communication for :func:`simulate`.

    ``backward_cost`` is the whole backward of one micro-batch through one stage. When a schedule
    splits the backward, its B (input gradient) costs ``backward_cost - weight_cost`` and its W
    costs ``weight_cost``; ``weight_cost = 0`` means no split. Per-stage values are scalars or
    lists with one entry per stage.
    """

    forward_cost: PerStage = 1.0
    backward_cost: PerStage = 2.0
    weight_cost: PerStage = 0.0
    p2p_alpha: float = 0.0  # latency of one activation / gradient message
    p2p_beta: float = 0.0  # seconds per byte
    # per-edge links: (sender, receiver pipeline rank, alpha, beta); others use the two above
    p2p_edges: tuple[tuple[int, int, float, float], ...] = ()
    activation_bytes: float = 0.0  # bytes of one activation (or its gradient) message
    allreduce_alpha: float = 0.0
    allreduce_beta: float = 0.0  # seconds per byte
    grad_bytes: PerStage = 0.0  # gradient bytes of one stage
    data_parallel_size: int = 1
    grad_reduce: str = "stage"  # when a stage's gradients go: stage | overlap | end (module doc)
    grad_buckets: int = 1  # with grad_reduce "overlap": equal buckets per stage
    allreduce_channels: int = 1  # stage all-reduces one rank runs at once (module doc)
    # host seconds before every compute action (the executor's work between two actions, and
    # the wake-up after a wait): the schedules with more, shorter actions pay it more often
    action_overhead: float = 0.0
    # MoE with expert parallelism: the all-to-alls (dispatch and combine of every MoE layer) of
    # one micro-batch through one stage in one direction; an F and a B (the whole backward when
    # it is not split; never a W) each pay it after their compute, exposed (nothing overlaps it)
    all_to_all_cost: PerStage = 0.0
    # MoE layers per stage, the pieces a paired action's halves alternate in (module docstring):
    # 0 costs a pair as perfect overlap, max(compute, all-to-all); k > 0 as the paired runtime's
    # baton over k layers (baton_pair_time)
    moe_layers_per_stage: int = 0
    # host seconds of one hand-over of a pair's baton between its halves (with
    # moe_layers_per_stage > 0): the paired runtime's switch between its two host threads
    hand_over_cost: float = 0.0
    # variable-length micro-batches (``docs/LONG_SEQUENCES.md``): per micro-batch (per sequence
    # with sequence slices), its (F, B, W) compute relative to the priced micro-batch (F and B
    # price attention by the squared document lengths, W the tokens); empty: all alike
    microbatch_work: tuple[tuple[float, float, float], ...] = ()
    # per micro-batch, its tokens relative to the priced one: the bytes of its messages
    microbatch_tokens: tuple[float, ...] = ()
    # how the runtime moves pipeline messages: async (sends never block; our executor, the
    # zero-bubble runtime) or Megatron-LM's blocking exchanges, one per action or, paired, one
    # per F+B of its interleaved steady state (schedules/blocking_p2p.py)
    p2p_exchange: str = "async"

    def per_stage(self, name: str, num_stages: int) -> list[float]:
        """The field ``name`` as a list of ``num_stages`` floats (scalars broadcast)."""
        value = getattr(self, name)
        if isinstance(value, int | float):
            return [float(value)] * num_stages
        values = [float(v) for v in value]
        if len(values) != num_stages:
            raise ValueError(f"CostModel.{name} has {len(values)} entries for {num_stages} stages")
        return values

    def p2p_time(self, src: int | None = None, dst: int | None = None,
                 tokens: float = 1.0) -> float:
        """Time of one point-to-point message from pipeline rank ``src`` to ``dst`` (its edge's
        link when ``p2p_edges`` lists it, else the default link) of ``tokens`` times the
        priced micro-batch's tokens."""
        for a, b, alpha, beta in self.p2p_edges:
            if (a, b) == (src, dst):
                return alpha + self.activation_bytes * tokens * beta
        return self.p2p_alpha + self.activation_bytes * tokens * self.p2p_beta

    def microbatch_factors(self, num_sequences: int
                           ) -> tuple[list[dict[str, float]], list[float]] | None:
        """Per micro-batch ``{kind: compute factor}`` and message factor (None: all alike);
        ValueError unless there is one entry per micro-batch."""
        if not self.microbatch_work and not self.microbatch_tokens:
            return None
        work = self.microbatch_work or tuple((t, t, t) for t in self.microbatch_tokens)
        tokens = self.microbatch_tokens or tuple(1.0 for _ in work)
        if not len(work) == len(tokens) == num_sequences:
            raise ValueError(f"CostModel.microbatch_work / microbatch_tokens have {len(work)} / "
                             f"{len(tokens)} entries for {num_sequences} micro-batches")
        if any(not (math.isfinite(v) and v >= 0) for w in work for v in (*w, *tokens)):
            raise ValueError("CostModel.microbatch_work / microbatch_tokens must be >= 0")
        return ([{FORWARD: f, BACKWARD: b, WEIGHT: w} for f, b, w in work], list(tokens))

    def allreduce_time(self, replicas: int, nbytes: float) -> float:
        """Rabenseifner all-reduce of ``nbytes`` over ``replicas`` ranks (0 for one replica)."""
        if replicas <= 1:
            return 0.0
        return (
            2 * math.log2(replicas) * self.allreduce_alpha
            + 2 * (replicas - 1) / replicas * nbytes * self.allreduce_beta
        )


@dataclass(frozen=True)
class Event:
    """One simulated compute action."""

    rank: int
    kind: str
    pipe: int
    stage: int
    microbatch: int
    start: float
    end: float


@dataclass(frozen=True)
class AllReduceEvent:
    """One simulated stage gradient all-reduce over the ranks holding that stage."""

    stage: int
    ranks: tuple[int, ...]
    replicas: int
    start: float
    end: float


@dataclass
class SimResult:
    """Timeline and summary figures of one simulated iteration."""

    schedule: str
    events: list[Event]
    allreduces: list[AllReduceEvent]
    makespan: float
    compute_span: float
    busy: list[float]
    bubble_ratio: float
    peak_inflight: list[int]
    weight_copies: list[int]
    grad_sync_end: dict[int, float] = field(default_factory=dict)
    # per rank, all-to-all time not hidden behind compute (MoE; zeros without all-to-all)
    exposed_all_to_all: list[float] = field(default_factory=list)

    def events_of_rank(self, rank: int) -> list[Event]:
        """Events of ``rank`` in execution order."""
        return [e for e in self.events if e.rank == rank]

    @property
    def longest_rank_span(self) -> float:
        """The longest time one rank spends from its first action's start to the end of its
        last action or of its stages' gradient reductions: the period of back-to-back
        iterations when no step boundary synchronises the ranks (each rank starts the next
        iteration as soon as it is done with this one, as the zero-bubble runtime's
        post-validated optimizer step lets it)."""
        first: dict[int, float] = {}
        last: dict[int, float] = {}
        for e in self.events:
            first[e.rank] = min(first.get(e.rank, e.start), e.start)
            last[e.rank] = max(last.get(e.rank, e.end), e.end)
        for a in self.allreduces:
            for rank in a.ranks:
                last[rank] = max(last.get(rank, a.end), a.end)
        return max((last[r] - first.get(r, 0.0) for r in last), default=0.0)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (the ``--json`` format of tools/plot_schedule.py)."""
        return {
            "schedule": self.schedule,
            "makespan": self.makespan,
            "compute_span": self.compute_span,
            "bubble_ratio": self.bubble_ratio,
            "busy": {str(r): b for r, b in enumerate(self.busy)},
            "peak_inflight": {str(r): p for r, p in enumerate(self.peak_inflight)},
            "weight_copies": {str(r): c for r, c in enumerate(self.weight_copies)},
            "grad_sync_end": {str(s): t for s, t in sorted(self.grad_sync_end.items())},
            "events": [asdict(e) for e in self.events],
            "allreduces": [asdict(a) | {"ranks": list(a.ranks)} for a in self.allreduces],
        }


def peak_inflight(schedule: Schedule, stage_bytes: Sequence[int] | None = None) -> list[int]:
    """Per rank, the most (pipe, stage, micro-batch) activations alive at once, in units of M_a.

    An activation lives from the start of its F until the end of its B (of its W when the
    backward is split); with in-order execution this follows from each rank's list alone.
    With ``stage_bytes`` each activation counts its stage's bytes instead of one (the memory
    model's activation peak).
    """
    release = schedule.release_kind
    peaks = []
    for rank_actions in schedule.actions:
        live = peak = 0
        for a in rank_actions:
            if a.kind == FORWARD:
                live += 1 if stage_bytes is None else stage_bytes[a.stage]
                peak = max(peak, live)
            elif a.kind == release:
                live -= 1 if stage_bytes is None else stage_bytes[a.stage]
        peaks.append(peak)
    return peaks


def stage_size(schedule: Schedule) -> float:
    """A stage's layers in units of L/D (1; an interleaved or V chunk 1/v), assuming an even
    partition: the unit of activation memory and weight copies."""
    return schedule.num_ranks / schedule.num_stages


def peak_activations(schedule: Schedule) -> list[float]:
    """Per rank, the peak of live activations in units of one micro-batch's activations on L/D
    layers (1F1B: D on its first rank; a half-size V chunk counts 0.5)."""
    unit = stage_size(schedule)
    return [p * unit for p in peak_inflight(schedule)]


def model_copies(schedule: Schedule) -> list[float]:
    """Per rank, the weights it holds in units of L/D layers (Chimera and BitPipe 2, 1F1B,
    interleaved and ZBV 1)."""
    unit = stage_size(schedule)
    return [c * unit for c in schedule.weight_copies()]


def all_to_all_times(schedule: Schedule, costs: CostModel) -> dict[str, list[float]]:
    """Per kind, per stage, the all-to-all time an action carries (F and B: A_s; W: 0)."""
    n = schedule.num_stages
    a2a = costs.per_stage("all_to_all_cost", n)
    if any(not (math.isfinite(v) and v >= 0) for v in a2a):
        raise ValueError(f"CostModel.all_to_all_cost must be >= 0, got {a2a}")
    return {FORWARD: a2a, BACKWARD: a2a, WEIGHT: [0.0] * n}


def compute_times(schedule: Schedule, costs: CostModel) -> dict[str, list[float]]:
    """Per kind, per stage, the compute time of an action (without its all-to-all)."""
    n = schedule.num_stages
    fwd = costs.per_stage("forward_cost", n)
    bwd = costs.per_stage("backward_cost", n)
    wgt = costs.per_stage("weight_cost", n)
    if not schedule.split_backward:
        return {FORWARD: fwd, BACKWARD: bwd, WEIGHT: [0.0] * n}
    for stage, (b, w) in enumerate(zip(bwd, wgt)):
        if not 0 <= w <= b:
            raise ValueError(
                f"--weight-cost must lie in [0, backward cost]; stage {stage} has "
                f"weight {w} and backward {b}"
            )
    return {FORWARD: fwd, BACKWARD: [b - w for b, w in zip(bwd, wgt)], WEIGHT: wgt}


def pair_leader(kinds: Sequence[str]) -> int:
    """Which half of a pair of action kinds computes first in the paired runtime (the rule of
    ``pipeline.overlap.leading_half``): the backward of an F&B pair (it starts with an
    all-to-all, its combine's gradient), the F or B of a pair with a W, else the first in the
    list."""
    if kinds[0] == WEIGHT or (kinds[0] != kinds[1] and kinds[1] == BACKWARD):
        return 1
    return 0


def action_pieces(kind: str, compute: float, all_to_all: float,
                  layers: int) -> list[tuple[bool, float]]:
    """The pieces ``(is_all_to_all, seconds)`` of an F or B over ``layers`` MoE layers: an F is
    attention, dispatch, experts, combine per layer, a B the reverse, each compute piece
    ``compute / 2 layers`` and each all-to-all ``all_to_all / 2 layers``. A W has no
    all-to-all: 2 x ``layers`` compute pieces of ``compute / 2 layers``, one per weight-gradient
    entry (the attention's and the experts' linear of each layer, as the emulated stages queue
    them); in a pair it hands the baton over after each (:func:`baton_pair_time`)."""
    c, a = compute / (2 * layers), all_to_all / (2 * layers)
    if kind == WEIGHT:
        return [(False, c)] * (2 * layers)
    c, a = compute / (2 * layers), all_to_all / (2 * layers)
    pair = [(False, c), (True, a)] if kind == FORWARD else [(True, a), (False, c)]
    return pair * (2 * layers)


def baton_pair_time(halves: Sequence[Sequence[tuple[bool, float]]], lead: int,
                    hand_over: float = 0.0) -> float:
    """Duration of a pair whose two halves (pieces as :func:`action_pieces` gives them) run as
    the paired runtime runs them: only the baton's holder computes; a half that reaches an
    all-to-all issues it (it starts when the rank's previous all-to-all is through: one link)
    and hands the baton to the other half, unless that one has finished; a half that gets the
    baton back first waits for its own all-to-all; a half without all-to-alls (a W) hands the
    baton over after each of its compute pieces instead (the runtime's hand-over between the
    weight-gradient store's entries); a half ends when its last piece does and then hands the
    baton over for good. The pair ends when both halves have. Each hand-over to
    a half that has not finished costs ``hand_over`` before the receiver may compute (the
    runtime's switch between its two host threads)."""
    ready = [0.0, 0.0]  # when each half's previous piece ends
    following = [0, 0]  # each half's next piece
    ends: list[float | None] = [None, None]
    link = baton = 0.0
    owner = lead
    while ends[0] is None or ends[1] is None:
        h, other = owner, 1 - owner
        t = max(baton, ready[h])
        pieces = halves[h]
        weight = not any(is_all_to_all for is_all_to_all, _ in pieces)
        handed = False
        while following[h] < len(pieces):
            is_all_to_all, seconds = pieces[following[h]]
            following[h] += 1
            if not is_all_to_all:
                t += seconds
                ready[h] = t
                if weight and following[h] < len(pieces) and ends[other] is None:
                    baton, owner, handed = t + hand_over, other, True
                    break
                continue
            link = ready[h] = max(t, link) + seconds
            if ends[other] is None:
                baton, owner, handed = t + hand_over, other, True
                break
            t = ready[h]  # nobody to hand over to: the all-to-all is exposed
        if not handed:
            ends[h] = max(t, ready[h])
            baton, owner = ends[h] + hand_over, other
    return max(ends[0], ends[1])


def _compute_timeline(schedule: Schedule, costs: CostModel) -> tuple[list[Event], list[float]]:
    compute = compute_times(schedule, costs)
    if costs.p2p_exchange != "async":
        return _blocking_events(schedule, costs, compute), [0.0] * schedule.num_ranks
    a2a = all_to_all_times(schedule, costs)
    exposed = [0.0] * schedule.num_ranks
    edges = {(a, b): costs.p2p_time(a, b) for a, b, _, _ in costs.p2p_edges}
    p2p = costs.p2p_time()
    overhead = costs.action_overhead
    layers = costs.moe_layers_per_stage
    if layers < 0:
        raise ValueError(f"CostModel.moe_layers_per_stage must be >= 0, got {layers}")
    finished: dict[Action, tuple[int, float]] = {}
    free = [0.0] * schedule.num_ranks
    events: list[Event] = []

    k = schedule.sequence_slices
    work = schedule.meta.get("slice_work") if k > 1 else None
    per_microbatch = costs.microbatch_factors(schedule.num_microbatches // k)

    def scale(a: Action) -> float:
        """A sequence slice's share of the work (1 without slices), times its micro-batch's
        factor of that kind (variable-length micro-batches)."""
        share = 1.0 if work is None else work[a.microbatch % k]
        return share if per_microbatch is None else (
            share * per_microbatch[0][a.microbatch // k][a.kind])

    def moved(a: Action) -> float:
        """The all-to-all share of ``a``: its slice's, times its micro-batch's tokens."""
        share = 1.0 if work is None else work[a.microbatch % k]
        return share if per_microbatch is None else (
            share * per_microbatch[1][a.microbatch // k])

    def message(src: int, dst: int, a: Action) -> float:
        if per_microbatch is None:
            return edges.get((src, dst), p2p)
        return costs.p2p_time(src, dst, per_microbatch[1][a.microbatch // k])

    def ready(rank: int, dep: Action | None) -> float:
        if dep is None:
            return 0.0
        dep_rank, dep_end = finished[dep]
        return dep_end + (message(dep_rank, rank, dep) if dep_rank != rank else 0.0)

    def run(rank: int, a: Action, dep: Action | None) -> None:
        start = max(free[rank], ready(rank, dep)) + overhead
        comm = a2a[a.kind][a.stage] * moved(a)
        end = start + compute[a.kind][a.stage] * scale(a) + comm
        exposed[rank] += comm
        free[rank] = end
        finished[a] = (rank, end)
        events.append(Event(rank, a.kind, a.pipe, a.stage, a.microbatch, start, end))

    def run_pair(rank: int, first: tuple[Action, Action | None],
                 second: tuple[Action, Action | None]) -> None:
        (a, dep_a), (b, dep_b) = first, second
        start = max(free[rank], ready(rank, dep_a), ready(rank, dep_b)) + overhead
        c_a, c_b = compute[a.kind][a.stage] * scale(a), compute[b.kind][b.stage] * scale(b)
        busy = c_a + c_b
        a2a_a, a2a_b = a2a[a.kind][a.stage] * moved(a), a2a[b.kind][b.stage] * moved(b)
        comm = a2a_a + a2a_b
        if layers and comm > 0 and a.kind == b.kind == FORWARD:
            end = start + busy + comm  # two drivers: the runtime runs them one after the other
        elif layers and comm > 0:
            end = start + baton_pair_time(
                (action_pieces(a.kind, c_a, a2a_a, layers),
                 action_pieces(b.kind, c_b, a2a_b, layers)), pair_leader((a.kind, b.kind)),
                costs.hand_over_cost)
        else:
            end = start + max(busy, comm)
        exposed[rank] += max(0.0, end - start - busy)
        split = start + (end - start) * (c_a / busy if busy else 0.5)
        free[rank] = end
        finished[a] = finished[b] = (rank, end)
        events.append(Event(rank, a.kind, a.pipe, a.stage, a.microbatch, start, split))
        events.append(Event(rank, b.kind, b.pipe, b.stage, b.microbatch, split, end))

    heads = run_in_order(schedule.actions, schedule.num_stages, run, schedule.pair_starts(),
                         run_pair)
    if stalled(schedule.actions, heads):
        raise ScheduleError("simulation stalled: the schedule deadlocks (validate() says where)")
    events.sort(key=attrgetter("rank", "start", "end"))
    return events, exposed


def _blocking_events(schedule: Schedule, costs: CostModel,
                     compute: dict[str, list[float]]) -> list[Event]:
    if costs.p2p_exchange not in P2P_EXCHANGES:
        raise ValueError(f"CostModel.p2p_exchange must be one of {P2P_EXCHANGES}, got "
                         f"{costs.p2p_exchange!r}")
    if (schedule.num_pairs() or schedule.sequence_slices > 1 or costs.microbatch_work
            or costs.microbatch_tokens
            or any(costs.per_stage("all_to_all_cost", schedule.num_stages))):
        raise ValueError("blocking p2p exchanges (Megatron-LM's runtime) price plain schedules "
                         "only: no paired actions, sequence slices, variable-length micro-batches "
                         "or all-to-alls")
    events = [Event(rank, a.kind, a.pipe, a.stage, a.microbatch, start, end)
              for rank, a, start, end in blocking_timeline(
                  schedule, compute, costs.p2p_time, costs.action_overhead,
                  costs.p2p_exchange == "blocking-paired")]
    events.sort(key=attrgetter("rank", "start", "end"))
    return events


GRAD_REDUCE_MODES = ("stage", "overlap", "end")


def _allreduces(
    schedule: Schedule, costs: CostModel, events: list[Event]
) -> list[AllReduceEvent]:
    """Stage all-reduces in descending stage order on each rank's ``allreduce_channels``
    channels, each starting as ``costs.grad_reduce`` allows (module doc)."""
    if costs.grad_reduce not in GRAD_REDUCE_MODES:
        raise ValueError(f"CostModel.grad_reduce must be one of {GRAD_REDUCE_MODES}, got "
                         f"{costs.grad_reduce!r}")
    if costs.allreduce_channels < 1 or costs.grad_buckets < 1:
        raise ValueError("CostModel.allreduce_channels and grad_buckets must be >= 1")
    release = schedule.release_kind
    last: dict[tuple[int, int], Event] = {}  # (rank, stage) -> its last release action
    rank_end: dict[int, float] = {}
    for e in events:
        rank_end[e.rank] = max(rank_end.get(e.rank, 0.0), e.end)
        key = (e.rank, e.stage)
        if e.kind == release and (key not in last or e.end > last[key].end):
            last[key] = e
    buckets = costs.grad_buckets if costs.grad_reduce == "overlap" else 1

    def ready(rank: int, stage: int, bucket: int) -> float:
        if costs.grad_reduce == "end":
            return rank_end[rank]
        e = last[(rank, stage)]
        return e.start + (bucket + 1) / buckets * (e.end - e.start)

    grad_bytes = costs.per_stage("grad_bytes", schedule.num_stages)
    channels = [[0.0] * costs.allreduce_channels for _ in range(schedule.num_ranks)]
    result = []
    for stage in reversed(range(schedule.num_stages)):
        holders = sorted({schedule.rank_of(p, stage) for p in range(schedule.num_pipes)})
        replicas = schedule.num_pipes * costs.data_parallel_size
        slot = {r: min(range(len(channels[r])), key=channels[r].__getitem__) for r in holders}
        each = costs.allreduce_time(replicas, grad_bytes[stage] / buckets)
        first = end = 0.0
        for bucket in range(buckets):
            start = max(max(ready(r, stage, bucket), channels[r][slot[r]]) for r in holders)
            first = start if bucket == 0 else first
            end = start + each
            for r in holders:
                channels[r][slot[r]] = end
        result.append(AllReduceEvent(stage, tuple(holders), replicas, first, end))
    return result


def simulate(schedule: Schedule, costs: CostModel | None = None) -> SimResult:
    """Simulate one iteration of ``schedule`` under ``costs`` (default: F=1, B=2, no comm)."""
    costs = costs or CostModel()
    if costs.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {costs.data_parallel_size}")
    events, exposed = _compute_timeline(schedule, costs)
    allreduces = _allreduces(schedule, costs, events)
    compute_span = max((e.end for e in events), default=0.0)
    makespan = max([compute_span] + [a.end for a in allreduces])
    busy = [0.0] * schedule.num_ranks
    for e in events:
        busy[e.rank] += e.end - e.start
    idle = sum(compute_span - b for b in busy)
    bubble = idle / (schedule.num_ranks * compute_span) if compute_span > 0 else 0.0
    return SimResult(
        schedule=schedule.describe(),
        events=events,
        allreduces=allreduces,
        makespan=makespan,
        compute_span=compute_span,
        busy=busy,
        bubble_ratio=bubble,
        peak_inflight=peak_inflight(schedule),
        weight_copies=schedule.weight_copies(),
        grad_sync_end={a.stage: a.end for a in allreduces},
        exposed_all_to_all=exposed,
    )
