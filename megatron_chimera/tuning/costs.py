"""Analytic per-stage costs of GPT-2 and BERT: the model to cost, its stage pieces, parameters,
forward FLOPs and message sizes.

FLOPs come from :mod:`megatron_chimera.model.flops` (the one FLOP count), parameter counts and
the partition from :mod:`megatron_chimera.model.partition` (exact for the model classes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_chimera.config import ModelConfig
from megatron_chimera.model import flops
from megatron_chimera.model.family import ModelFamily, get_family
from megatron_chimera.model.partition import partition_layers
from megatron_chimera.model.partition import stage_parameters as partition_stage_parameters


@dataclass(frozen=True)
class ModelSpec:
    """A model to cost: its configuration and its family (GPT-2 or BERT, or their names)."""

    config: ModelConfig
    family: ModelFamily | str = "gpt2"

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
    """Stage pieces as the runtime builds them (``partition_layers`` with ``--partition-method``:
    ``uniform`` or ``parameters``, which balances embedding and head parameters too)."""
    return pieces_of(partition_layers(spec.config.num_layers, num_stages, method,
                                      config=spec.config, family=spec.family))


def stage_parameters(spec: ModelSpec, pieces: Sequence[StagePiece]) -> list[int]:
    """Parameters of one replica of every stage (tied-embedding copy on the last stage)."""
    return partition_stage_parameters(spec.config, spec.family, [p.layer_range for p in pieces])


def stage_forward_flops(spec: ModelSpec, piece: StagePiece,
                        micro_batch: int) -> tuple[float, float]:
    """(weight-matmul FLOPs, other FLOPs) of one stage's forward on one micro-batch."""
    return flops.stage_forward_flops(spec.config, spec.family, piece.num_layers,
                                     piece.post_process, micro_batch)


def activation_message_bytes(spec: ModelSpec, micro_batch: int) -> int:
    """Bytes of one activation (or gradient) message between stages: ``[s, b, h]``."""
    cfg = spec.config
    return cfg.seq_length * micro_batch * cfg.hidden_size * spec.dtype_bytes
