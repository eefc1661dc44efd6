"""Peak device memory of every pipeline rank for a schedule, a partition and a micro-batch size.

Per-stage figures (weights, gradients, optimizer state, activation bytes per micro-batch with and
without recomputation, the recomputation working set) come from
:func:`megatron_chimera.model.memory.estimate_stage_memory`. This module adds what depends on the
schedule:

* one weight copy per distinct stage a rank holds (``Schedule.stages_of_rank``); the local
  copies of the tied word embedding (a Chimera rank holding the first and the last stage has
  two) share one storage, one gradient buffer and one optimizer state;
* with the distributed optimizer, the optimizer state (and fp32 main gradients) of each stage
  divided among its stage-replica group -- the ranks holding it times ``W`` -- and the tied
  embedding's among the embedding group (every holder of a copy);
* the activation peak, by walking the rank's action list: a forward adds its stage's bytes of
  one micro-batch, the backward (the W when the backward is split) releases them -- the
  schedule's peak in-flight micro-batches weighted by the bytes of the stages they sit on.

Gradients are reduced in place in their buffers (no extra copy). Total = parameters + gradients
+ optimizer state + max(activations (+ recompute working set), optimizer-step transient).

With tensor parallelism (T) every figure is one tensor rank's: the stage figures are its shards
(``tensor_parallel``, ``sequence_parallel``), and the stage-replica and embedding groups the
distributed optimizer shards over join ranks of one tensor rank, so their sizes do not change
with T.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_chimera.model.memory import (
    StageMemory,
    bytes_per_parameter,
    estimate_stage_memory,
    layer_activation_bytes,
)
from megatron_chimera.schedules.actions import Schedule
from megatron_chimera.schedules.lowering import (
    DEFAULT_LOOKAHEAD,
    RECV,
    Comm,
    lower,
)
from megatron_chimera.schedules.simulate import peak_inflight
from megatron_chimera.tuning.analytic_costs import ModelSpec, StagePiece
from megatron_chimera.tuning.precision import (
    FP8_COPIES,
    fp8_activation_saving,
    linear_parameters_per_layer,
)


@dataclass(frozen=True)
class RankMemory:
    """Peak memory of one rank (bytes), split by kind."""

    rank: int
    stages: tuple[int, ...]
    param_bytes: int  # parameters of the stages held (every local copy of the tied embedding)
    grad_bytes: int  # gradient buffers
    optimizer_bytes: int  # fp32 main parameters and moments (this rank's shard when sharded)
    activation_bytes: int  # in-flight activations at their peak (+ recompute working set)
    transient_bytes: int  # fp32 main gradients during the optimizer step (2-byte gradients)

    @property
    def weight_bytes(self) -> int:
        """Parameters, gradients and optimizer state (held for the whole run)."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def total_bytes(self) -> int:
        """Peak bytes of this rank."""
        return self.weight_bytes + max(self.activation_bytes, self.transient_bytes)


def peak_activation_bytes(schedule: Schedule, stage_bytes: Sequence[int]) -> list[int]:
    """Per rank, the most activation bytes alive at once when running its list in order."""
    return peak_inflight(schedule, stage_bytes)


def stage_memory(spec: ModelSpec, partition: Sequence[StagePiece], micro_batch: int,
                 device_type: str = "cuda", tensor_parallel: int = 1,
                 sequence_parallel: bool = False,
                 grad_reduce_in_fp32: bool | None = None,
                 expert_parallel: int = 1) -> list[StageMemory]:
    """Per-stage estimates of :mod:`megatron_chimera.model.memory` for this partition (one
    tensor-parallel rank's shard; ``experts / expert_parallel`` experts per MoE layer)."""
    return estimate_stage_memory(spec.config, spec.family,
                                 [p.layer_range for p in partition], micro_batch,
                                 device_type=device_type, tensor_parallel=tensor_parallel,
                                 sequence_parallel=sequence_parallel,
                                 grad_reduce_in_fp32=grad_reduce_in_fp32,
                                 expert_parallel=expert_parallel)


def attention_core_bytes(spec: ModelSpec, micro_batch: int, device_type: str = "cuda",
                         tensor_parallel: int = 1, sequence_parallel: bool = False) -> int:
    """Bytes of one layer's attention core that selective recomputation does not keep."""
    sp = sequence_parallel and tensor_parallel > 1
    kept = layer_activation_bytes(spec.config, micro_batch, None, device_type, tensor_parallel, sp)
    selective = layer_activation_bytes(spec.config, micro_batch, "selective", device_type,
                                       tensor_parallel, sp)
    return kept - selective


def stage_replicas(schedule: Schedule) -> list[int]:
    """Pipeline ranks holding each stage (its stage-replica group is that times ``W``)."""
    counts = [0] * schedule.num_stages
    for rank in range(schedule.num_ranks):
        for stage in schedule.stages_of_rank(rank):
            counts[stage] += 1
    return counts


def embedding_group_size(schedule: Schedule, data_parallel_size: int = 1) -> int:
    """Ranks holding the first or the last stage (a copy of the tied embedding), times ``W``."""
    ends = {0, schedule.num_stages - 1}
    holders = {r for r in range(schedule.num_ranks) if ends & set(schedule.stages_of_rank(r))}
    return len(holders) * data_parallel_size


def rank_memory(spec: ModelSpec, schedule: Schedule, partition: Sequence[StagePiece],
                micro_batch: int, recompute: bool | str | None, device_type: str = "cuda",
                tensor_parallel: int = 1, sequence_parallel: bool = False,
                data_parallel_size: int = 1, distributed_optimizer: bool = False,
                grad_reduce_in_fp32: bool | None = None,
                expert_parallel: int = 1,
                extra_activation_bytes: Sequence[int] | None = None) -> list[RankMemory]:
    """Peak memory of every pipeline rank of ``schedule`` (one entry per rank; with tensor
    parallelism, of each of its T ranks). ``recompute``: False / None, True / ``"full"``, or
    ``"selective"`` (each layer keeps all but its attention core's ``s x s`` tensors; one
    layer's core is the working set). ``expert_parallel``: each rank holds ``experts / EP``
    experts per MoE layer, sharded by the distributed optimizer over ``replicas x T x
    data_parallel_size / EP`` ranks (``data_parallel_size``: W, times CP with context
    parallelism). ``extra_activation_bytes``: per stage, bytes one micro-batch saves beyond the
    estimate (the MoE layers' dispatched tokens, ``moe_costs.moe_extra_activation_bytes``)."""
    mode = "full" if recompute is True else (recompute or None)
    if len(partition) != schedule.num_stages:
        raise ValueError(f"partition has {len(partition)} stages, schedule {schedule.num_stages}")
    stages = stage_memory(spec, partition, micro_batch, device_type, tensor_parallel,
                          sequence_parallel, grad_reduce_in_fp32, expert_parallel)
    per_param = bytes_per_parameter(spec.config.params_dtype,
                                    grad_reduce_in_fp32=grad_reduce_in_fp32)
    per_mb = [m.activation_bytes_recompute if mode == "full" else m.activation_bytes
              for m in stages]
    core = 0
    if mode == "selective":
        core = attention_core_bytes(spec, micro_batch, device_type, tensor_parallel,
                                    sequence_parallel)
        per_mb = [b - piece.num_layers * core for b, piece in zip(per_mb, partition, strict=True)]
    if extra_activation_bytes is not None:
        per_mb = [b + e for b, e in zip(per_mb, extra_activation_bytes, strict=True)]
    fp8_weights = 0  # FP8 (precision.py): the linears' inputs saved in FP8, two weight copies
    if spec.fp8 is not None:
        saving = fp8_activation_saving(spec.config, micro_batch, tensor_parallel,
                                       sequence_parallel, mode)
        per_mb = [b - piece.num_layers * saving for b, piece in zip(per_mb, partition, strict=True)]
        fp8_weights = FP8_COPIES * linear_parameters_per_layer(spec.config, tensor_parallel)
    peaks = peak_activation_bytes(schedule, per_mb)
    replicas = stage_replicas(schedule)
    embedding_group = embedding_group_size(schedule, data_parallel_size)
    result = []
    for rank in range(schedule.num_ranks):
        held = schedule.stages_of_rank(rank)
        working = max((stages[s].recompute_working_bytes for s in held), default=0)
        if mode == "selective":
            working = core if any(partition[s].num_layers for s in held) else 0
        tied = max((stages[s].tied_parameters for s in held), default=0)  # one per rank
        own = {s: stages[s].parameters - stages[s].tied_parameters for s in held}
        owned = sum(own.values())  # elements whose optimizer state this rank keeps
        if distributed_optimizer:
            experts = {s: stages[s].expert_parameters for s in held}
            expert_group = tensor_parallel * data_parallel_size // expert_parallel
            owned = (sum((n - experts[s]) / (replicas[s] * data_parallel_size)
                         + experts[s] / (replicas[s] * expert_group) for s, n in own.items())
                     + tied / embedding_group)
        else:
            owned += tied
        result.append(RankMemory(
            rank=rank, stages=tuple(held),
            param_bytes=((sum(own.values()) + tied) * per_param["param"]
                         + fp8_weights * sum(partition[s].num_layers for s in held)),
            grad_bytes=(sum(own.values()) + tied) * per_param["grad"],
            optimizer_bytes=round(owned * per_param["optimizer"]),
            activation_bytes=peaks[rank] + (working if mode else 0),
            transient_bytes=round(owned * per_param["main_grad"])))
    return result


def receive_buffers(schedule: Schedule, lookahead: int = DEFAULT_LOOKAHEAD) -> list[int]:
    """Per rank, the most receive buffers alive at once under the lowered lists: a buffer lives
    from its receive's post (up to ``lookahead`` actions early) until the compute after the
    last gradient action of its (pipe, stage, micro-batch) -- a received activation is the
    saved input of the backward. The executor's pooled pipeline buffers, in messages."""
    lowered = lower(schedule, lookahead=lookahead)
    peaks = []
    for ops in lowered.lists:
        held: dict[tuple[int, int, int], int] = {}
        live = releasing = peak = 0
        for op in ops:
            if isinstance(op, Comm):
                if op.op == RECV:
                    key = op.message.consumer()[1:]  # (pipe, stage, micro-batch)
                    held[key] = held.get(key, 0) + 1
                    live += 1
                    peak = max(peak, live)
                continue
            live -= releasing  # freed once the next compute begins
            releasing = 0
            if op.kind == schedule.release_kind:
                releasing = held.pop((op.pipe, op.stage, op.microbatch), 0)
        peaks.append(peak)
    return peaks


def slice_cache_bytes(spec: ModelSpec, partition: Sequence[StagePiece], micro_batch: int,
                      slices: int, tensor_parallel: int = 1) -> list[int]:
    """Per stage, the bytes a sliced unit saves beyond an unsliced micro-batch of its ``s / k``
    tokens (``--pipeline-sequence-slices k``): its attention's keys and values concatenated with
    those of the sequence's earlier slices, up to ``(k - 1) s / k`` tokens of them per layer
    (the last slice's: a bound for every unit). The cached leaves share the earlier slices'
    storage, so they add nothing more. ``spec`` has the whole sequence."""
    if slices == 1:
        return [0] * len(partition)
    cfg = spec.config
    kv = cfg.query_groups * cfg.head_dim // tensor_parallel
    per_layer = 2 * (slices - 1) * (cfg.seq_length // slices) * micro_batch * kv
    return [piece.num_layers * per_layer * spec.dtype_bytes for piece in partition]


def sliced_rank_memory(memory: list[RankMemory], schedule: Schedule,
                       cache_bytes: Sequence[int]) -> list[RankMemory]:
    """``memory`` (priced at one slice's tokens) with the key/value bytes of the live units
    (:func:`slice_cache_bytes`) at their peak."""
    if schedule.sequence_slices == 1:
        return memory
    extra = peak_activation_bytes(schedule, list(cache_bytes))
    return [dataclasses.replace(m, activation_bytes=m.activation_bytes + e)
            for m, e in zip(memory, extra, strict=True)]
