"""Analytic per-stage costs of GPT-2 and BERT: parameters, forward FLOPs and message sizes.

FLOPs count a multiply-add as two FLOPs (Narayanan et al., SC'21): one transformer layer's forward
on ``b`` sequences of length ``s`` costs ``24 b s h^2 + 4 b s^2 h`` with the default MLP of
``4h`` (in general ``8 b s h^2 + 4 b s h f + 4 b s^2 h``), the LM head ``2 b s h V``. The
backward costs twice the forward, of which the weight-gradient half (the matmuls with
parameters) is what a split-backward schedule defers to its W actions; full recomputation adds
one forward to the backward. Parameter counts and the partition come from
:mod:`megatron_chimera.model.partition` (exact for the model classes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_chimera.config import ConfigError, ModelConfig
from megatron_chimera.model.partition import partition_layers
from megatron_chimera.model.partition import stage_parameters as partition_stage_parameters

MODEL_TYPES = ("gpt2", "bert")
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


@dataclass(frozen=True)
class ModelSpec:
    """A model to cost: its configuration and its type (``gpt2`` or ``bert``)."""

    config: ModelConfig
    model: str = "gpt2"

    def __post_init__(self) -> None:
        if self.model not in MODEL_TYPES:
            raise ConfigError(f"--model: unknown model {self.model!r}; choose from {MODEL_TYPES}")

    @property
    def dtype_bytes(self) -> int:
        """Bytes of one parameter / activation element in the model's precision."""
        return DTYPE_BYTES[self.config.params_dtype]

    @property
    def partition_model_type(self) -> str:
        """The model-type name of :mod:`megatron_chimera.model.partition` (``gpt`` / ``bert``)."""
        return "gpt" if self.model == "gpt2" else "bert"


@dataclass(frozen=True)
class StageSlice:
    """The part of the model one pipeline stage holds: a layer range and the two ends."""

    layer_range: tuple[int, int]  # global [start, end)
    pre_process: bool  # holds the embeddings
    post_process: bool  # holds the final norm and the heads

    @property
    def num_layers(self) -> int:
        """Transformer layers in this stage."""
        return self.layer_range[1] - self.layer_range[0]


def uniform_partition(num_layers: int, num_stages: int) -> list[StageSlice]:
    """Layers split as evenly as possible over stages (``partition_layers(..., "uniform")``)."""
    ranges = partition_layers(num_layers, num_stages, "uniform")
    return [StageSlice(r, i == 0, i == num_stages - 1) for i, r in enumerate(ranges)]


def partition_stages(spec: ModelSpec, num_stages: int, method: str = "uniform") -> list[StageSlice]:
    """Stage slices as the runtime builds them (``partition_layers`` with ``--partition-method``:
    ``uniform`` or ``parameters``, which balances embedding and head parameters too)."""
    ranges = partition_layers(spec.config.num_layers, num_stages, method, config=spec.config,
                              model_type=spec.partition_model_type)
    return [StageSlice(r, i == 0, i == num_stages - 1) for i, r in enumerate(ranges)]


# ---------------------------------------------------------------------------- parameters
def stage_parameters(spec: ModelSpec, pieces: Sequence[StageSlice]) -> list[int]:
    """Parameters of one replica of every stage (tied-embedding copy on the last stage), from
    :func:`megatron_chimera.model.partition.stage_parameters`."""
    return partition_stage_parameters(spec.config, spec.partition_model_type,
                                      [p.layer_range for p in pieces])


# ---------------------------------------------------------------------------- FLOPs
def layer_forward_flops(config: ModelConfig, micro_batch: int) -> tuple[float, float]:
    """(matmul-with-weights FLOPs, attention score/value FLOPs) of one layer's forward."""
    b, s, h, f = micro_batch, config.seq_length, config.hidden_size, config.ffn_size
    weights = 2 * b * s * (3 * h * h + h * h + 2 * h * f)
    attention = 4 * b * s * s * h
    return float(weights), float(attention)


def stage_forward_flops(
    spec: ModelSpec, piece: StageSlice, micro_batch: int
) -> tuple[float, float]:
    """(weight-matmul FLOPs, other FLOPs) of one stage's forward on one micro-batch."""
    cfg = spec.config
    weights, attention = layer_forward_flops(cfg, micro_batch)
    weights *= piece.num_layers
    attention *= piece.num_layers
    if piece.post_process:
        tokens = micro_batch * cfg.seq_length
        weights += 2.0 * tokens * cfg.hidden_size * cfg.padded_vocab_size
        if spec.model == "bert":
            weights += 2.0 * tokens * cfg.hidden_size * cfg.hidden_size  # LM head dense
    return weights, attention


def activation_message_bytes(spec: ModelSpec, micro_batch: int) -> int:
    """Bytes of one activation (or gradient) message between stages: ``[s, b, h]``."""
    cfg = spec.config
    return cfg.seq_length * micro_batch * cfg.hidden_size * spec.dtype_bytes
