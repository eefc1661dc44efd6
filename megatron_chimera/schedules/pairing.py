"""Paired F&B actions for MoE expert parallelism (``--overlap-moe-expert-parallel-comm``).

With cross-node expert parallelism every MoE layer's dispatch and combine all-to-alls cost about
as much as its compute. Running the forward of one micro-batch together with the backward of an
*independent* one (:func:`~.actions.independent`) on the same rank hides each half's all-to-all
behind the other half's compute; the simulator charges such a pair ``max(compute, all-to-all)``
(:mod:`.simulate`). This module proposes the pairs:

* :func:`slot_order`: Chimera's slot formula run over all micro-batches of each pipe; a slot of
  a rank holding a forward of one pipe (or chunk) and a backward of another is a pair. DualPipe
  and DualPipeV are this order on their placements (:mod:`.dualpipe`).
* :func:`pair_adjacent`: pairs neighbouring independent F/B in a fixed order.
* :func:`extra_warmup_pairs`: Megatron's combined 1F1B on a 1F1B or interleaved order: one more
  warm-up forward, then each steady-state forward runs with the backward before it.
* :func:`improve_pairs`: adds pairs of neighbouring independent actions (F&B, and Chimera's
  F&F in the warm-up and B&B in the cool-down) while they help under the costs.
* :func:`pair_weights`: with a split backward, moves a W next to a lone F or B and pairs them
  (the W computes while the lone action's all-to-all is in flight) while that helps.
* :func:`with_overlap`: what the flag does to a built schedule (the registry calls it): the
  fastest of these candidates under the costs, within DualPipe's D + 1 activations per rank.

Torch-free, like the rest of the IR.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from megatron_chimera.schedules.actions import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    Action,
    Schedule,
    independent,
)
from megatron_chimera.schedules.costs import StageCosts
from megatron_chimera.schedules.simulate import peak_activations, simulate
from megatron_chimera.schedules.validate import validate
from megatron_chimera.schedules.walk import run_in_order, stalled

FLAG = "--overlap-moe-expert-parallel-comm"
# DeepSeek-V3's regime: per stage F:B:W = 1:1:1 and every direction's all-to-all = the forward
DEFAULT_EP_COSTS = StageCosts.uniform(1.0, 1.0, 1.0, 1, all_to_all=1.0)
# with_overlap: candidate orders at most this much slower than the fastest also get W pairs
WEIGHT_PAIRING_SLACK = 0.05


def ep_costs(costs: StageCosts | Sequence[float] | None, num_ranks: int,
             num_stages: int) -> StageCosts:
    """``costs`` for a schedule of ``num_stages`` stages on ``num_ranks`` ranks: one-stage costs
    (or ``(F, B, W)``, or None: :data:`DEFAULT_EP_COSTS`) are those of each of D stages of L/D
    layers, split evenly over smaller chunks (interleaved, V); per-stage costs are cut the same
    way. An all-to-all time of 0 when they name none."""
    given = DEFAULT_EP_COSTS if costs is None else costs
    if not isinstance(given, StageCosts):
        given = StageCosts.of(given, 1)
    if given.num_stages == 1:
        given = StageCosts.of(given, num_ranks)
    return given.for_stages(num_stages)


def slot_order(name: str, num_ranks: int, num_stages: int, placement: list[list[int]],
               num_microbatches: int, split_backward: bool,
               meta: dict | None = None, staggered: bool = False) -> Schedule:
    """Chimera's slot formula over all of a pipe's micro-batches, F&B collisions paired.

    In a pipe of S stages, local micro-batch j runs forward at slot ``s + 2j`` and backward at
    slot ``2S - 1 - s + 2j`` on the rank holding stage s (Chimera's basic unit, run over every
    micro-batch instead of units of D). A slot of a rank holding a forward of one pipe or chunk
    and a backward of another (different micro-batches: independent) is a pair. Sorted by slot:
    warm-up forwards, steady-state pairs, cool-down backwards (DualPipe's shape). With a split
    backward each W follows its B, except after the rank's last forward, where the Ws go to the
    end (they fill the cool-down, as ZB-H1's and DualPipe's last steps do).

    ``staggered`` (two pipes): pipe p's micro-batch j takes slot offset ``4j + 2p`` instead of
    ``2j``, the pipes alternating micro-batches; on BitPipe's placement (each rank holds two
    chunks of each pipe) this keeps one F and one B per slot and D + 1 activations."""
    pipes = len(placement)
    per_pipe = num_microbatches // pipes
    keyed: list[list[tuple[tuple[int, int], Action]]] = [[] for _ in range(num_ranks)]
    for p in range(pipes):
        for s in range(num_stages):
            rank = placement[p][s]
            for j in range(per_pipe):
                m = p * per_pipe + j
                offset = 4 * j + 2 * p if staggered else 2 * j
                keyed[rank].append(((s + offset, 0), Action(FORWARD, p, s, m)))
                keyed[rank].append(((2 * num_stages - 1 - s + offset, 1),
                                    Action(BACKWARD, p, s, m)))
    actions, pairs = [], []
    for rank_ops in keyed:
        rank_ops.sort(key=lambda t: t[0])
        order: list[Action] = []
        mine: list[int] = []
        i = 0
        while i < len(rank_ops):
            (slot, _), a = rank_ops[i]
            nxt = rank_ops[i + 1] if i + 1 < len(rank_ops) else None
            if (nxt is not None and nxt[0][0] == slot and a.kind == FORWARD
                    and nxt[1].kind == BACKWARD and nxt[1].microbatch != a.microbatch):
                mine.append(len(order))
                order += [a, nxt[1]]
                i += 2
            else:
                order.append(a)
                i += 1
        actions.append(order)
        pairs.append(mine)
    if split_backward:
        actions, pairs = _with_weights(actions, pairs)
    return Schedule(name=name, num_ranks=num_ranks, num_stages=num_stages, num_pipes=pipes,
                    num_microbatches=num_microbatches, placement=placement, actions=actions,
                    split_backward=split_backward, meta=dict(meta or {}), pairs=pairs)


def _with_weights(actions: list[list[Action]], pairs: list[list[int]]
                  ) -> tuple[list[list[Action]], list[list[int]]]:
    """Insert each B's W after it (after its pair); after the rank's last forward, at the end."""
    out_actions, out_pairs = [], []
    for order, starts in zip(actions, pairs):
        last_forward = max(i for i, a in enumerate(order) if a.kind == FORWARD)
        paired = set(starts)
        new: list[Action] = []
        new_pairs: list[int] = []
        tail: list[Action] = []
        i = 0
        while i < len(order):
            step = order[i:i + 2] if i in paired else order[i:i + 1]
            if i in paired:
                new_pairs.append(len(new))
            new += step
            weights = [Action(WEIGHT, b.pipe, b.stage, b.microbatch)
                       for b in step if b.kind == BACKWARD]
            if i > last_forward:
                tail += weights
            else:
                new += weights
            i += len(step)
        out_actions.append(new + tail)
        out_pairs.append(new_pairs)
    return out_actions, out_pairs


def pair_adjacent(schedule: Schedule, mixed_only: bool = True) -> Schedule:
    """``schedule`` with every pair of neighbouring independent F or B actions (scanning each
    rank's list from the front, a pair's actions taken once) marked as a paired action; only an
    F with a B when ``mixed_only`` (W pairs: :func:`pair_weights`)."""
    pairs = []
    for actions in schedule.actions:
        mine, i = [], 0
        while i < len(actions) - 1:
            a, b = actions[i], actions[i + 1]
            if (_pairable(a, b, schedule.sequence_slices)
                    and (a.kind != b.kind or not mixed_only)):
                mine.append(i)
                i += 2
            else:
                i += 1
        pairs.append(mine)
    return replace(schedule, pairs=pairs)


def _pairable(a: Action, b: Action, sequence_slices: int) -> bool:
    """Whether ``a`` and ``b`` are two F or B actions that may run as a pair (W pairs are
    proposed only by :func:`pair_weights`)."""
    return (WEIGHT not in (a.kind, b.kind)
            and independent(a, b, sequence_slices) is None)


def extra_warmup_pairs(schedule: Schedule) -> Schedule:
    """Megatron's combined 1F1B on a 1F1B or interleaved order (``F.. (F B)* B..``): one more
    warm-up forward, then every steady-state forward runs paired with the backward that came
    before it (``F.. F (F B)* B..``); neighbours that are not independent stay unpaired."""
    lists = []
    for actions in schedule.actions:
        order = list(actions)
        for i in range(1, len(order)):
            # (B, F) in the steady state -> (F, B): each forward one slot earlier
            if order[i].kind == FORWARD and order[i - 1].kind == BACKWARD:
                order[i - 1], order[i] = order[i], order[i - 1]
        lists.append(order)
    return pair_adjacent(replace(schedule, actions=lists, pairs=[]))


def _score(schedule: Schedule, costs: StageCosts,
           layers: int = 0) -> tuple[float, float] | None:
    """(makespan, exposed all-to-all summed over ranks) under ``costs``, each pair costed
    piece by piece over ``layers`` MoE layers per stage when > 0
    (``CostModel.moe_layers_per_stage``); None if it deadlocks."""
    heads = run_in_order(schedule.actions, schedule.num_stages, pairs=schedule.pair_starts())
    if stalled(schedule.actions, heads):
        return None
    result = simulate(schedule, costs.cost_model(schedule.split_backward,
                                                 moe_layers_per_stage=layers))
    return result.makespan, sum(result.exposed_all_to_all)


def improve_pairs(schedule: Schedule, costs: StageCosts, layers: int = 0) -> Schedule:
    """Add pairs of neighbouring independent F or B actions one at a time (ranks in order, each
    list from the front), keeping each that leaves the lists deadlock free and makes the iteration
    no slower and its exposed all-to-all smaller under ``costs``: a pair waits for both inputs,
    so a pair can also delay a pipe or close a cycle (``layers``: as :func:`_score`)."""
    best = _score(schedule, costs, layers)
    if best is None:
        raise ValueError(f"{FLAG}: {schedule.describe()} deadlocks before pairing")
    pairs = [list(p) for p in (schedule.pairs or [[] for _ in range(schedule.num_ranks)])]
    for rank, actions in enumerate(schedule.actions):
        i = 0
        while i < len(actions) - 1:
            taken = set(pairs[rank]) | {j + 1 for j in pairs[rank]}
            if i in taken or i + 1 in taken or not _pairable(actions[i], actions[i + 1],
                                                                 schedule.sequence_slices):
                i += 1
                continue
            trial = sorted(pairs[rank] + [i])
            candidate = replace(schedule, pairs=pairs[:rank] + [trial] + pairs[rank + 1:])
            score = _score(candidate, costs, layers)
            if score is not None and score[0] <= best[0] + 1e-9 and score[1] < best[1] - 1e-9:
                pairs[rank], best = trial, score
                i += 2
            else:
                i += 1
    return replace(schedule, pairs=pairs)


def _steps(actions: Sequence[Action], starts: Sequence[int]) -> list[tuple[Action, ...]]:
    """A rank's list as its steps: a paired action's two halves, or one action."""
    paired, out, i = set(starts), [], 0
    while i < len(actions):
        width = 2 if i in paired else 1
        out.append(tuple(actions[i:i + width]))
        i += width
    return out


def _flatten(steps: Sequence[tuple[Action, ...]]) -> tuple[list[Action], list[int]]:
    """Inverse of :func:`_steps`: the list and its pair starts."""
    actions: list[Action] = []
    starts: list[int] = []
    for step in steps:
        if len(step) == 2:
            starts.append(len(actions))
        actions += step
    return actions, starts


def pair_weights(schedule: Schedule, costs: StageCosts, limit: float,
                 tries: int = 4, layers: int = 0) -> Schedule:
    """With a split backward: pair lone F and B actions with a W (the rank computes the W while
    the lone action's all-to-all is in flight: ``max(C + C_W, A)``, the W for free when
    C + C_W <= A). For each rank in order and each of its lone F or B from the front, the lone
    Ws of that rank whose B ran before it, of other micro-batches (:func:`~.actions.independent`),
    are tried nearest first (at most ``tries``): the W moves next to it and the two become a
    pair, kept when the lists stay deadlock free, every rank's live activations within
    ``limit`` (a W moved later keeps its activation longer) and the iteration no slower with
    less exposed all-to-all under ``costs``. Repeated until nothing more is kept. Chimera-ZB's
    warm-up and cool-down lone actions take the Ws its zero-bubble order deferred
    (``layers``: as :func:`_score`)."""
    if not schedule.split_backward:
        return schedule
    best = _score(schedule, costs, layers)
    if best is None:
        raise ValueError(f"{FLAG}: {schedule.describe()} deadlocks before pairing")
    lists = [list(a) for a in schedule.actions]
    pairs = [list(p) for p in (schedule.pairs or [[] for _ in range(schedule.num_ranks)])]
    changed = True
    while changed:
        changed = False
        for rank in range(schedule.num_ranks):
            steps = _steps(lists[rank], pairs[rank])
            k = 0
            while k < len(steps):
                lone = steps[k][0]
                if len(steps[k]) == 2 or lone.kind == WEIGHT:
                    k += 1
                    continue
                backward_step = {a[1:]: q for q, step in enumerate(steps) for a in step
                                 if a.kind == BACKWARD}
                weights = sorted((q for q, step in enumerate(steps)
                                  if len(step) == 1 and step[0].kind == WEIGHT
                                  and backward_step[step[0][1:]] < k
                                  and independent(lone, step[0],
                                                  schedule.sequence_slices) is None),
                                 key=lambda q: abs(q - k))
                for q in weights[:tries]:
                    trial_steps = steps[:q] + steps[q + 1:]
                    at = k - 1 if q < k else k
                    trial_steps[at] = (lone, steps[q][0])
                    trial_list, trial_pairs = _flatten(trial_steps)
                    trial = replace(schedule, actions=lists[:rank] + [trial_list]
                                    + lists[rank + 1:],
                                    pairs=pairs[:rank] + [trial_pairs] + pairs[rank + 1:])
                    if max(peak_activations(trial)) > limit + 1e-9:
                        continue
                    score = _score(trial, costs, layers)
                    if (score is not None and score[0] <= best[0] + 1e-9
                            and score[1] < best[1] - 1e-9):
                        best, steps = score, trial_steps
                        lists[rank], pairs[rank] = trial_list, trial_pairs
                        changed = True
                        k = at
                        break
                k += 1
    return replace(schedule, actions=lists, pairs=pairs)


def with_overlap(schedule: Schedule, costs: StageCosts | Sequence[float] | None = None,
                 megatron: bool = False, activation_limit: float | None = None,
                 moe_layers_per_stage: int = 0) -> Schedule:
    """``schedule`` with paired actions (what ``--overlap-moe-expert-parallel-comm`` does):
    the fastest (then least exposed) valid candidate under ``costs`` (default
    :data:`DEFAULT_EP_COSTS`) among its own order (unpaired, and with neighbouring F&B
    paired) and either, with ``megatron`` (1F1B, interleaved, ZB-H1), Megatron's extra-warm-up
    pairing of its own order (:func:`extra_warmup_pairs`) or else the slot order of its
    placement (:func:`slot_order`, DualPipe's shape), each improved by :func:`improve_pairs`;
    with a split backward those within :data:`WEIGHT_PAIRING_SLACK` of the fastest also with
    W pairs (:func:`pair_weights`, after improve_pairs and before it).
    A candidate may hold at most max(the schedule's own peak, D + 1) live activations per rank
    (L/D-layer units; D + 1 is DualPipe's), so the overlap never costs more memory than
    DualPipe; ``activation_limit`` (the user's cap) replaces that bound. Never slower than the
    schedule without pairs under ``costs``. ``moe_layers_per_stage`` > 0 scores every candidate
    with each pair costed piece by piece, as the paired runtime runs it
    (``CostModel.moe_layers_per_stage``; the order chosen under max(...) is one of the
    candidates then); 0: max(compute, all-to-all)."""
    layers = moe_layers_per_stage
    costs = ep_costs(costs, schedule.num_ranks, schedule.num_stages)
    candidates = [schedule, pair_adjacent(schedule)]
    if schedule.sequence_slices > 1:
        pass  # sequence slices: its own order only (the slot order knows no slice order)
    elif megatron:
        candidates.append(extra_warmup_pairs(schedule))
    else:
        for staggered in (False, True)[:schedule.num_pipes]:
            candidates.append(slot_order(schedule.name, schedule.num_ranks, schedule.num_stages,
                                         schedule.placement, schedule.num_microbatches,
                                         schedule.split_backward, schedule.meta, staggered))
    # memory: no more live activations than the schedule's own peak or DualPipe's D + 1
    limit = max(max(peak_activations(schedule)), schedule.num_ranks + 1
                if activation_limit is None else activation_limit)
    orders, scored = [], []
    for candidate in candidates:
        if (max(peak_activations(candidate)) > limit + 1e-9
                or _score(candidate, costs, layers) is None):
            continue
        improved = improve_pairs(candidate, costs, layers)
        scored.append((_score(improved, costs, layers), len(scored), improved))
        orders.append(candidate)
    if schedule.split_backward:
        # W pairs on the orders within WEIGHT_PAIRING_SLACK of the fastest (pair_weights
        # simulates once per lone action, and a slow order has many): after improve_pairs,
        # or before it (a lone action then takes a W before improve_pairs pairs it with
        # another lone action)
        fastest = min(scored)[0][0]
        for (makespan, _), i, improved in list(scored):
            if makespan > fastest * (1 + WEIGHT_PAIRING_SLACK):
                continue
            for candidate in (pair_weights(improved, costs, limit, layers=layers),
                              improve_pairs(pair_weights(orders[i], costs, limit,
                                                         layers=layers), costs, layers)):
                scored.append((_score(candidate, costs, layers), len(scored), candidate))
    if layers:
        # the greedy passes above can end in a worse order under the piece-level cost than
        # the one they find under max(...): that one competes too, scored under this cost
        perfect = with_overlap(schedule, costs, megatron, activation_limit)
        scored.append((_score(perfect, costs, layers), len(scored), perfect))
    best = min(scored)[2]
    validate(best)
    return replace(best, meta=dict(schedule.meta, overlap_moe_expert_parallel_comm=True))
