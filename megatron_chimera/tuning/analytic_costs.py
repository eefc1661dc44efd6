"""Analytic per-stage costs of GPT-2 and BERT: the model to cost, its stage pieces, parameters,
forward FLOPs, message sizes and the tensor-parallel collectives.

FLOPs come from :mod:`megatron_chimera.model.flops` (the one FLOP count), parameter counts and
the partition from :mod:`megatron_chimera.model.partition` (exact for the model classes, also
per tensor-parallel rank).

Tensor parallelism over T ranks (:func:`tensor_parallel_comm_seconds`): per transformer layer the
forward runs two all-reduces of one ``[s, b, h]`` activation (after the row-parallel attention
output and MLP output) and the backward two more (the input gradients of the column-parallel QKV
and first MLP linear); with sequence parallelism each all-reduce becomes an all-gather plus a
reduce-scatter (the same bytes on the wire). The embedding all-reduces its output, the LM head's
input gradient is all-reduced (reduce-scattered), and the vocabulary-parallel cross-entropy
all-reduces three ``[s, b]`` fp32 tensors. A ring collective over T ranks costs
``(T-1) (alpha + n/T beta)`` per all-gather or reduce-scatter, twice that per all-reduce; the
link is the one the T consecutive global ranks share (NVLink inside a node).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_chimera.config import ModelConfig
from megatron_chimera.layout import ParallelLayout
from megatron_chimera.model import flops
from megatron_chimera.model.family import ModelFamily, get_family
from megatron_chimera.model.partition import partition_layers
from megatron_chimera.model.partition import stage_parameters as partition_stage_parameters
from megatron_chimera.model.stage_split import is_layout, layout_partition
from megatron_chimera.tuning.hardware import LinkProfile
from megatron_chimera.tuning.precision import Fp8Config


@dataclass(frozen=True)
class ModelSpec:
    """A model to cost: its configuration, its family (GPT-2 or BERT, or their names) and its
    FP8 recipe, if any (:mod:`megatron_chimera.tuning.precision`)."""

    config: ModelConfig
    family: ModelFamily | str = "gpt2"
    fp8: Fp8Config | None = None

    def __post_init__(self) -> None:
        if isinstance(self.family, str):
            object.__setattr__(self, "family", get_family(self.family))

    @property
    def dtype_bytes(self) -> int:
        """Bytes of one parameter / activation element in the model's precision."""
        return self.config.dtype_bytes


@dataclass(frozen=True)
class StagePiece:
    """The part of the model one pipeline stage holds: a layer range and the two ends."""

    layer_range: tuple[int, int]  # global [start, end)
    pre_process: bool  # holds the embeddings
    post_process: bool  # holds the final norm and the heads

    @property
    def num_layers(self) -> int:
        """Transformer layers in this stage."""
        return self.layer_range[1] - self.layer_range[0]


def pieces_of(ranges: Sequence[tuple[int, int]]) -> list[StagePiece]:
    """Stage pieces of a partition given as layer ranges."""
    return [StagePiece(r, i == 0, i == len(ranges) - 1) for i, r in enumerate(ranges)]


def uniform_partition(num_layers: int, num_stages: int) -> list[StagePiece]:
    """Layers split as evenly as possible over stages (``partition_layers(..., "uniform")``)."""
    return pieces_of(partition_layers(num_layers, num_stages, "uniform"))


def partition_stages(spec: ModelSpec, num_stages: int, method: str = "uniform") -> list[StagePiece]:
    """Stage pieces as the runtime builds them: ``--partition-method`` ``uniform`` or
    ``parameters`` (balancing embedding and head parameters too), or a
    ``--pipeline-model-parallel-layout`` string (uneven stages as given; also stages without a
    transformer layer, which Megatron runs and training here refuses)."""
    if is_layout(method):
        return pieces_of(layout_partition(method, spec.config.num_layers, num_stages,
                                          allow_empty=True))
    return pieces_of(partition_layers(spec.config.num_layers, num_stages, method,
                                      config=spec.config, family=spec.family))


def stage_parameters(spec: ModelSpec, pieces: Sequence[StagePiece],
                     tensor_parallel: int = 1) -> list[int]:
    """Parameters of one replica of every stage (tied-embedding copy on the last stage) on one of
    ``tensor_parallel`` ranks."""
    return partition_stage_parameters(spec.config, spec.family, [p.layer_range for p in pieces],
                                      tensor_parallel)


def stage_forward_flops(spec: ModelSpec, piece: StagePiece,
                        micro_batch: int) -> tuple[float, float]:
    """(weight-matmul FLOPs, other FLOPs) of one stage's forward on one micro-batch."""
    return flops.stage_forward_flops(spec.config, spec.family, piece.num_layers,
                                     piece.post_process, micro_batch)


def activation_message_bytes(spec: ModelSpec, micro_batch: int, tensor_parallel: int = 1,
                             sequence_parallel: bool = False) -> int:
    """Bytes of one activation (or gradient) message between stages: ``[s, b, h]``, or this
    rank's chunk ``[s/T, b, h]`` under sequence parallelism (or Megatron's scatter/gather of
    pipeline messages: pass True for it too)."""
    cfg = spec.config
    full = cfg.seq_length * micro_batch * cfg.hidden_size * spec.dtype_bytes
    return full // tensor_parallel if sequence_parallel else full


def check_tensor_parallel(spec: ModelSpec, tensor_parallel: int, sequence_parallel: bool) -> None:
    """ConfigError when T does not divide the model's sizes (the layout's rule, as the training
    flags' check)."""
    ParallelLayout(tensor=tensor_parallel).check_model(spec.config, sequence_parallel)


def ring_collective_seconds(num_bytes: float, ranks: int, link: LinkProfile,
                            all_reduce: bool = False) -> float:
    """Ring all-gather / reduce-scatter of ``num_bytes`` (the full tensor) over ``ranks`` ranks;
    an all-reduce is both."""
    if ranks <= 1:
        return 0.0
    one = (ranks - 1) * (link.alpha_s + num_bytes / ranks * link.beta_s_per_byte)
    return 2 * one if all_reduce else one


def tensor_parallel_comm_seconds(spec: ModelSpec, piece: StagePiece, micro_batch: int,
                                 tensor_parallel: int, sequence_parallel: bool,
                                 link: LinkProfile, recompute: bool = False
                                 ) -> tuple[float, float]:
    """(forward, backward) seconds of the stage's tensor-parallel collectives for one
    micro-batch (see the module doc); full recomputation repeats the forward's in the backward."""
    t = tensor_parallel
    if t <= 1:
        return 0.0, 0.0
    cfg = spec.config
    tokens = cfg.seq_length * micro_batch
    activation = float(tokens * cfg.hidden_size * spec.dtype_bytes)
    gather = ring_collective_seconds(activation, t, link)
    reduce = ring_collective_seconds(activation, t, link, all_reduce=True)
    # the residual-stream boundary: all-reduce, or all-gather + reduce-scatter under SP
    boundary = 2 * gather if sequence_parallel else reduce
    forward = backward = 2 * piece.num_layers * boundary
    if piece.pre_process:
        forward += reduce  # vocabulary-parallel embedding
        backward += gather if sequence_parallel else 0.0
    if piece.post_process:
        forward += gather if sequence_parallel else 0.0  # the logits' input
        if sequence_parallel and spec.family.sentence_heads:
            forward += gather  # BERT's pooler reads the whole sequence
        forward += 3 * ring_collective_seconds(4.0 * tokens, t, link, all_reduce=True)
        backward += gather if sequence_parallel else reduce
    if recompute:
        backward += forward
    return forward, backward


def pipeline_gather_seconds(spec: ModelSpec, micro_batch: int, tensor_parallel: int,
                            sequence_parallel: bool, link: LinkProfile) -> float:
    """Megatron's scatter/gather of pipeline messages (T > 1, no sequence parallelism): each of
    the T ranks sends ``1/T`` of the ``[s, b, h]`` message over its own link and the receiver
    all-gathers the pieces over the tensor-parallel link. Sequence parallelism needs no gather
    (the stage consumes the scattered chunk)."""
    if tensor_parallel <= 1 or sequence_parallel:
        return 0.0
    full = float(activation_message_bytes(spec, micro_batch))
    return ring_collective_seconds(full, tensor_parallel, link)
