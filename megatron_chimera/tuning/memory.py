"""Peak device memory of every pipeline rank for a schedule, a partition and a micro-batch size.

Per-stage figures (weights, gradients, optimizer state, activation bytes per micro-batch with and
without recomputation, the recomputation working set) come from
:func:`megatron_chimera.model.memory.estimate_stage_memory`. This module adds what depends on the
schedule:

* one weight copy per distinct stage a rank holds (``Schedule.stages_of_rank``);
* the activation peak, by walking the rank's action list: a forward adds its stage's bytes of
  one micro-batch, the backward (the W when the backward is split) releases them -- the
  schedule's peak in-flight micro-batches weighted by the bytes of the stages they sit on;
* the flat bucket each stage's gradient all-reduce copies its gradients into
  (``pipeline/grad_sync.py``); with eager sync it can coexist with the activations of the
  rank's other stages, so it is counted on top of the weights.

Total = weights + buckets + max(activations (+ recompute working set), optimizer-step transient).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_chimera.model.memory import StageMemory, estimate_stage_memory
from megatron_chimera.schedules.actions import Schedule
from megatron_chimera.schedules.simulate import peak_inflight
from megatron_chimera.tuning.costs import ModelSpec, StagePiece


@dataclass(frozen=True)
class RankMemory:
    """Peak memory of one rank (bytes), split by kind."""

    rank: int
    stages: tuple[int, ...]
    weight_bytes: int  # parameters, gradients, optimizer state of the stages held
    bucket_bytes: int  # gradient all-reduce buckets
    activation_bytes: int  # in-flight activations at their peak (+ recompute working set)
    transient_bytes: int  # fp32 main gradients during the optimizer step (16-bit models)

    @property
    def total_bytes(self) -> int:
        """Peak bytes of this rank."""
        return (self.weight_bytes + self.bucket_bytes
                + max(self.activation_bytes, self.transient_bytes))


def peak_activation_bytes(schedule: Schedule, stage_bytes: Sequence[int]) -> list[int]:
    """Per rank, the most activation bytes alive at once when running its list in order."""
    return peak_inflight(schedule, stage_bytes)


def stage_memory(spec: ModelSpec, partition: Sequence[StagePiece], micro_batch: int,
                 device_type: str = "cuda", tensor_parallel: int = 1,
                 sequence_parallel: bool = False) -> list[StageMemory]:
    """Per-stage estimates of :mod:`megatron_chimera.model.memory` for this partition (one
    tensor-parallel rank's shard)."""
    return estimate_stage_memory(spec.config, spec.family,
                                 [p.layer_range for p in partition], micro_batch,
                                 device_type=device_type, tensor_parallel=tensor_parallel,
                                 sequence_parallel=sequence_parallel)


def rank_memory(spec: ModelSpec, schedule: Schedule, partition: Sequence[StagePiece],
                micro_batch: int, recompute: bool, device_type: str = "cuda",
                tensor_parallel: int = 1, sequence_parallel: bool = False) -> list[RankMemory]:
    """Peak memory of every pipeline rank of ``schedule`` (one entry per rank; with tensor
    parallelism, of each of its T ranks)."""
    if len(partition) != schedule.num_stages:
        raise ValueError(f"partition has {len(partition)} stages, schedule {schedule.num_stages}")
    stages = stage_memory(spec, partition, micro_batch, device_type, tensor_parallel,
                          sequence_parallel)
    per_mb = [m.activation_bytes_recompute if recompute else m.activation_bytes for m in stages]
    peaks = peak_activation_bytes(schedule, per_mb)
    result = []
    for rank in range(schedule.num_ranks):
        held = schedule.stages_of_rank(rank)
        working = max((stages[s].recompute_working_bytes for s in held), default=0)
        result.append(RankMemory(
            rank=rank, stages=tuple(held),
            weight_bytes=sum(stages[s].weight_bytes for s in held),
            bucket_bytes=sum(stages[s].grad_bytes for s in held),
            activation_bytes=peaks[rank] + (working if recompute else 0),
            transient_bytes=sum(stages[s].main_grad_bytes for s in held)))
    return result
