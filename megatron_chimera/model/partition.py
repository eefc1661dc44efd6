"""Assign transformer layers to pipeline stages, and count parameters analytically.

``partition_layers`` splits ``num_layers`` into ``num_stages`` contiguous ``(start, end)`` ranges:
``uniform`` (equal layer counts), ``parameters`` (balanced parameter count) or ``time`` (balanced
measured time), the last two counting the embedding on the first stage and the LM head on the
last. With ``rank_stages`` (the stages each pipeline rank holds: two replicas per rank for
Chimera), ``time`` balances the ranks' total time instead of the stages' (then, among the splits
with the least loaded busiest rank, the stages'). The parameter counts here are exact for
:mod:`megatron_chimera.model` (tested against the real classes), also per tensor-parallel rank
(``tensor_parallel`` = T: the split matrices, column biases and vocabulary rows divided by T,
LayerNorms, row-parallel biases, position embeddings, pooler and the heads' dense layers whole).
The partition itself always uses the T = 1 counts, so it does not depend on T.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from megatron_chimera.config import PARTITION_METHODS, ConfigError, ModelConfig
from megatron_chimera.model.bert import bert_num_tokentypes
from megatron_chimera.model.family import GPT2, ModelFamily


# --------------------------------------------------------------------------- parameter counts
def norm_parameters(config: ModelConfig) -> int:
    """Parameters of one layer norm: weight and bias (LayerNorm) or weight only (RMSNorm)."""
    return config.hidden_size * (1 if config.normalization == "RMSNorm" else 2)


def layer_parameters(config: ModelConfig, tensor_parallel: int = 1, layer: int | None = None,
                     expert_parallel: int = 1) -> int:
    """Parameters of one transformer layer (on one of ``tensor_parallel`` ranks): QKV (query
    heads plus a key and value head per query group), dense, the MLP's linears (SwiGLU's fused
    gate and up), their biases unless disabled, two norms. ``layer`` (0-based) an MoE layer
    (``--moe-layer-freq``): the MLP is the router, this rank's ``experts / expert_parallel``
    experts and the shared expert instead (None: a dense layer)."""
    h, f, t = config.hidden_size, config.ffn_size, tensor_parallel
    bias = int(config.add_bias_linear)
    gated = 2 if config.swiglu else 1
    qkv = h * config.qkv_size + config.qkv_size * int(config.has_qkv_bias)
    dense = config.num_attention_heads * config.head_dim * h
    moe = config.moe
    if layer is not None and moe.moe_layers(config.num_layers)[layer]:
        shared = moe.moe_shared_expert_intermediate_size or 0
        mlp = gated * shared * (h + bias) + shared * h  # the shared expert (tensor-split)
        fe = moe.moe_ffn_hidden_size or f
        experts = moe.num_experts // expert_parallel * (gated * fe * (h + bias) + fe * h
                                                        + bias * h)
        gate = h * int(shared > 0 and moe.moe_shared_expert_gate)  # replicated [1, h]
        return ((qkv + dense + mlp) // t + moe.num_experts * h + gate + experts
                + (1 + int(shared > 0)) * bias * h + 2 * norm_parameters(config))
    mlp = gated * f * (h + bias) + f * h
    split = qkv + dense + mlp  # column-parallel with their biases, row-parallel weights
    return split // t + 2 * bias * h + 2 * norm_parameters(config)  # + row biases, norms


def expert_parameters(config: ModelConfig, start: int, end: int, expert_parallel: int = 1) -> int:
    """Parameters of the experts one rank holds in layers ``start .. end - 1`` (reduced and
    sharded over the experts' own replicas, not the stage's)."""
    moe = config.moe
    if not moe.enabled:
        return 0
    h, bias = config.hidden_size, int(config.add_bias_linear)
    gated = 2 if config.swiglu else 1
    fe = moe.moe_ffn_hidden_size or config.ffn_size
    per_expert = gated * fe * (h + bias) + fe * h + bias * h
    layers = sum(moe.moe_layers(config.num_layers)[start:end])
    return layers * moe.num_experts // expert_parallel * per_expert


def layers_parameters(config: ModelConfig, start: int, end: int, tensor_parallel: int = 1,
                      expert_parallel: int = 1) -> int:
    """Parameters of layers ``start .. end - 1`` (dense and MoE layers alike)."""
    if not config.moe.enabled:
        return (end - start) * layer_parameters(config, tensor_parallel)
    return sum(layer_parameters(config, tensor_parallel, i, expert_parallel)
               for i in range(start, end))


def _vocab_rows(config: ModelConfig, tensor_parallel: int) -> int:
    """Rows of the vocabulary-parallel tensors on one rank (Megatron's padding for T)."""
    return config.tensor_parallel_vocab_size(tensor_parallel) // tensor_parallel


def embedding_parameters(config: ModelConfig, family: ModelFamily,
                         tensor_parallel: int = 1) -> int:
    """Word (padded vocabulary, this rank's rows), position and (BERT) token-type embeddings."""
    h = config.hidden_size
    positions = config.max_positions if config.learned_positions else 0
    count = (_vocab_rows(config, tensor_parallel) + positions) * h
    if family.sentence_heads:
        count += bert_num_tokentypes(config) * h
    return count


def head_parameters(config: ModelConfig, family: ModelFamily, num_stages: int = 1,
                    tensor_parallel: int = 1) -> int:
    """Parameters of the last stage beyond its layers: final layer norm, output layer or tied
    embedding copy (only when the last stage is not the first), BERT's pooler and heads."""
    h, v = config.hidden_size, _vocab_rows(config, tensor_parallel)
    count = norm_parameters(config)  # final layer norm
    tied = family.always_tied or not config.untie_embeddings_and_output_weights
    if not tied:
        count += v * h
    elif num_stages > 1:
        count += v * h  # the last stage's copy of the tied word embedding
    if family.lm_head_transform:
        count += (h * h + h) + 2 * h + v  # lm_head: dense, layernorm, bias
    if family.sentence_heads and config.bert_binary_head:
        count += (h * h + h) + (2 * h + 2)  # pooler, binary head
    return count


def count_parameters(config: ModelConfig, family: ModelFamily = GPT2) -> int:
    """Parameters of the whole (single-stage) model; the tied embedding counted once."""
    return (embedding_parameters(config, family) + layers_parameters(config, 0, config.num_layers)
            + head_parameters(config, family, num_stages=1))


def stage_parameters(config: ModelConfig, family: ModelFamily,
                     partition: Sequence[tuple[int, int]], tensor_parallel: int = 1) -> list[int]:
    """Parameters held by each stage slice of ``partition`` (the tied copy on the last stage),
    on one of ``tensor_parallel`` ranks."""
    counts = [layers_parameters(config, start, end, tensor_parallel) for start, end in partition]
    counts[0] += embedding_parameters(config, family, tensor_parallel)
    counts[-1] += head_parameters(config, family, len(partition), tensor_parallel)
    return counts


# --------------------------------------------------------------------------- partitioning
def partition_layers(num_layers: int, num_stages: int, method: str = "uniform", *,
                     config: ModelConfig | None = None, family: ModelFamily = GPT2,
                     layer_times: Sequence[float] | None = None, embedding_time: float = 0.0,
                     head_time: float = 0.0,
                     rank_stages: Sequence[Sequence[int]] | None = None) -> list[tuple[int, int]]:
    """Contiguous ``(start, end)`` layer ranges, one per stage, each at least one layer.

    ``parameters`` needs ``config`` (and the model ``family``); ``time`` needs ``layer_times``
    (one per layer, e.g. measured forward+backward seconds) and the embedding / head times, and
    balances the ranks of ``rank_stages`` (one list of held stages per rank) when given.
    """
    if method not in PARTITION_METHODS:
        raise ConfigError(f"partition method must be one of {PARTITION_METHODS}, got {method!r}")
    if num_stages < 1 or num_layers < num_stages:
        raise ConfigError(f"--num-layers {num_layers} must be >= the number of pipeline stages "
                          f"{num_stages} (>= 1)")
    if method == "uniform":
        base, extra = divmod(num_layers, num_stages)
        sizes = [base + (1 if s < extra else 0) for s in range(num_stages)]
        bounds = [sum(sizes[:s]) for s in range(num_stages + 1)]
        return [(bounds[s], bounds[s + 1]) for s in range(num_stages)]
    if method == "parameters":
        if config is None:
            raise ValueError("partition method 'parameters' needs the model config")
        if config.num_layers != num_layers:
            raise ValueError(f"num_layers {num_layers} != config.num_layers {config.num_layers}")
        costs = [float(layer_parameters(config, layer=i)) for i in range(num_layers)]
        first = float(embedding_parameters(config, family))
        last = float(head_parameters(config, family, num_stages))
    else:
        if layer_times is None or len(layer_times) != num_layers:
            raise ValueError("partition method 'time' needs one measured time per layer")
        costs = [float(t) for t in layer_times]
        first, last = float(embedding_time), float(head_time)
        if rank_stages is not None:
            return balanced_rank_partition(costs, num_stages, rank_stages, first, last)
    return balanced_partition(costs, num_stages, first_extra=first, last_extra=last)


def balanced_partition(costs: Sequence[float], num_stages: int, first_extra: float = 0.0,
                       last_extra: float = 0.0) -> list[tuple[int, int]]:
    """Contiguous split minimising the largest stage cost (dynamic programme, exact); the first
    stage also pays ``first_extra`` and the last ``last_extra``. Ties go to the earliest cut."""
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot split {n} layers into {num_stages} non-empty stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def stage_cost(stage: int, start: int, end: int) -> float:
        cost = prefix[end] - prefix[start]
        if stage == 0:
            cost += first_extra
        if stage == num_stages - 1:
            cost += last_extra
        return cost

    inf = float("inf")
    # best[k][i]: minimal max cost placing layers [0, i) on stages 0..k-1; cut[k][i] its last cut
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], stage_cost(k - 1, j, i))
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds, i = [n], n
    for k in range(num_stages, 0, -1):
        i = cut[k][i]
        bounds.append(i)
    bounds.reverse()
    return [(bounds[s], bounds[s + 1]) for s in range(num_stages)]


def stage_groups(rank_stages: Sequence[Sequence[int]], num_stages: int) -> list[tuple[int, ...]]:
    """The distinct sets of stages the ranks hold; they must partition the stages (true of every
    placement here: one stage per rank, or Chimera's replicas)."""
    groups = sorted({tuple(sorted(set(stages))) for stages in rank_stages})
    held = sorted(s for g in groups for s in g)
    if held != list(range(num_stages)):
        raise ValueError(f"the ranks' stage sets {groups} do not partition the {num_stages} "
                         f"stages")
    return groups


def _stage_extras(num_stages: int, first_extra: float, last_extra: float) -> list[float]:
    extras = [0.0] * num_stages
    extras[0] += first_extra
    extras[-1] += last_extra
    return extras


def _loads(bounds: Sequence[int], prefix: Sequence[float], extras: Sequence[float],
           groups: Sequence[Sequence[int]]) -> tuple[float, float, list[float]]:
    stage = [prefix[bounds[s + 1]] - prefix[bounds[s]] + extras[s] for s in range(len(extras))]
    group = [sum(stage[s] for s in g) for g in groups]
    return max(group), max(stage), sorted(group, reverse=True)


def balanced_rank_partition(costs: Sequence[float], num_stages: int,
                            rank_stages: Sequence[Sequence[int]], first_extra: float = 0.0,
                            last_extra: float = 0.0) -> list[tuple[int, int]]:
    """Contiguous split minimising the busiest rank's time (the sum over the stages it holds),
    then the largest stage time; the first stage also pays ``first_extra``, the last
    ``last_extra``.

    Exact when every layer costs the same (the transformer's case): water-filling, one layer at
    a time to the least loaded group of stages (a rank's stage set), gives the least busiest-rank
    time; a bisection over the largest stage time then finds the least one that water-filling
    under both limits still fits. Otherwise that split, by mean layer cost, is improved by
    moving single cut points while the (busiest rank, largest stage) pair drops.
    """
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot split {n} layers into {num_stages} non-empty stages")
    groups = stage_groups(rank_stages, num_stages)
    extras = _stage_extras(num_stages, first_extra, last_extra)
    unit = sum(costs) / n
    busiest = _fill(n, unit, extras, groups, math.inf, math.inf)[1]
    # the smallest largest-stage time that still fits under the busiest rank's time
    candidates = sorted({c * unit + extras[s] for s in range(num_stages) for c in range(1, n + 1)})
    low, high = 0, len(candidates) - 1
    while low < high:
        mid = (low + high) // 2
        if _fill(n, unit, extras, groups, busiest, candidates[mid])[0] is None:
            low = mid + 1
        else:
            high = mid
    counts = _fill(n, unit, extras, groups, busiest, candidates[low])[0]
    assert counts is not None
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    if len(set(costs)) > 1:
        bounds = _improve_cuts(bounds, costs, extras, groups)
    return [(bounds[s], bounds[s + 1]) for s in range(num_stages)]


def _fill(num_layers: int, unit: float, extras: Sequence[float], groups: Sequence[Sequence[int]],
          group_cap: float, stage_cap: float) -> tuple[list[int] | None, float]:
    """Layer counts by water-filling: one stage each, then every next layer to the least loaded
    group with room (group time <= ``group_cap``), within it to its least loaded stage with room
    (stage time <= ``stage_cap``). Returns (counts or None if they do not fit, busiest group)."""
    slack = 1e-9 * max(unit, 1e-300) * num_layers
    counts = [1] * len(extras)

    def stage_time(i: int, extra_layers: int = 0) -> float:
        return (counts[i] + extra_layers) * unit + extras[i]

    if any(stage_time(i) > stage_cap + slack for i in range(len(extras))):
        return None, math.inf
    load = [sum(stage_time(i) for i in g) for g in groups]
    for _ in range(num_layers - len(extras)):
        best = None
        for k, g in enumerate(groups):
            if load[k] + unit > group_cap + slack:
                continue
            room = [i for i in g if stage_time(i, 1) <= stage_cap + slack]
            if room and (best is None or load[k] < load[best[0]]):
                best = (k, min(room, key=lambda i: (stage_time(i), i)))
        if best is None:
            return None, math.inf
        counts[best[1]] += 1
        load[best[0]] += unit
    return counts, max(load)


def _improve_cuts(bounds: list[int], costs: Sequence[float], extras: Sequence[float],
                  groups: Sequence[Sequence[int]]) -> list[int]:
    """Move one inner cut point by one layer at a time while (busiest group, largest stage,
    sorted group loads) decreases."""
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    best = _loads(bounds, prefix, extras, groups)
    improved = True
    while improved:
        improved = False
        for i in range(1, len(bounds) - 1):
            for step in (-1, 1):
                cut = bounds[i] + step
                if not bounds[i - 1] < cut < bounds[i + 1]:
                    continue
                trial = bounds[:i] + [cut] + bounds[i + 1:]
                value = _loads(trial, prefix, extras, groups)
                if value < best:
                    bounds, best, improved = trial, value, True
    return bounds
