"""Variable-length micro-batches in the performance model: every micro-batch is priced by its own
documents, at a context-parallel size of its own.

A micro-batch of documents of lengths ``L_i`` (``T = sum L_i`` tokens) on one of ``c`` context
ranks (the per-document zigzag, ``model/context_parallel/documents.py``: every document padded
to a multiple of ``2c``, each rank ``1/c`` of every document) costs, per layer,

* the linear layers, norms and the stage's ends on its ``T_pad / c`` tokens (the GEMM shape model
  of :mod:`.operators`: short micro-batches run less efficient GEMMs);
* attention: one varlen kernel over the documents, ``1/c`` of it per rank: the attention core of
  one ``T``-token sequence scaled by ``sum L_i^2 / T^2`` (the pairs the documents hold);
* with ``c > 1``, ring attention's messages: ``c - 1`` key/value blocks of ``T_pad / c`` tokens
  forward (keys and values plus their gradients backward, and the gradients' last hop home),
  each hidden behind the attention of one ring step (``1/c`` of the rank's attention) and
  exposed beyond it.

:func:`microbatch_stage_times` gives those seconds; :func:`microbatch_factors` turns a list of
micro-batches into the simulator's per-micro-batch factors (:attr:`CostModel.microbatch_work`)
relative to the micro-batch the stage costs were priced for; :class:`MixPerformanceModel` is the
autotuner's performance model for a real length mix. Torch-free.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

from megatron_chimera.config import ModelConfig
from megatron_chimera.tuning.analytic_costs import ModelSpec, StagePiece
from megatron_chimera.tuning.hardware import HardwareProfile, LinkProfile
from megatron_chimera.tuning.operators import (
    DTYPE_BYTES,
    attention_core_backward,
    attention_core_forward,
    layer_shapes,
    ops_seconds,
)
from megatron_chimera.tuning.perf_model import AnalyticCompute, PerformanceModel, StageTimes
from megatron_chimera.tuning.training_plan import TrainingPlan


def _with_seq(config: ModelConfig, seq: int) -> ModelConfig:
    return dataclasses.replace(config, seq_length=seq,
                               max_position_embeddings=max(seq, config.max_positions))


@functools.lru_cache(maxsize=65536)
def attention_seconds(config: ModelConfig, hardware: HardwareProfile,
                      length: int) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's attention core over one document."""
    cfg = _with_seq(config, length)
    shapes = layer_shapes(cfg, 1, 1, False)
    forward = ops_seconds(hardware, attention_core_forward(cfg, shapes), cfg.params_dtype)[0]
    backward = ops_seconds(hardware, attention_core_backward(cfg, shapes), cfg.params_dtype)[0]
    return forward, backward


def padded_tokens(lengths: Sequence[int], context_parallel: int) -> int:
    """Tokens of a micro-batch with every document padded to a multiple of ``2 x CP`` (none at
    CP = 1)."""
    step = 2 * context_parallel if context_parallel > 1 else 1
    return sum(-(-n // step) * step for n in lengths)


def ring_exposed_seconds(config: ModelConfig, local_tokens: int, context_parallel: int,
                         attention: tuple[float, float],
                         link: LinkProfile) -> tuple[float, float]:
    """(forward, backward) seconds per layer of ring attention's messages that the attention of
    each ring step (``attention``: this rank's, forward and backward) does not hide."""
    if context_parallel == 1:
        return 0.0, 0.0
    kv = (config.qkv_size - config.num_attention_heads * config.head_dim)  # keys + values
    block = float(local_tokens) * kv * DTYPE_BYTES[config.params_dtype]
    steps = context_parallel - 1

    def message(nbytes: float) -> float:
        return link.alpha_s + nbytes * link.beta_s_per_byte

    forward = steps * max(0.0, message(block) - attention[0] / context_parallel)
    backward = (steps * max(0.0, message(2 * block) - attention[1] / context_parallel)
                + message(block))  # the key/value gradients' last hop home
    return forward, backward


def microbatch_stage_times(compute: AnalyticCompute, piece: StagePiece, lengths: Sequence[int],
                           context_parallel: int = 1, link: LinkProfile | None = None,
                           recompute: str | None = None) -> StageTimes:
    """Seconds of one micro-batch of documents of ``lengths`` through ``piece`` on one of its
    ``context_parallel`` ranks (T = 1; ``link``: the context ranks' ring, needed at CP > 1)."""
    if context_parallel > 1 and link is None:
        raise ValueError("microbatch_stage_times: context parallelism needs the ring's link")
    return _microbatch_stage_times(compute, piece, tuple(int(n) for n in lengths),
                                   context_parallel, link, recompute)


@functools.lru_cache(maxsize=65536)
def _microbatch_stage_times(compute: AnalyticCompute, piece: StagePiece, lengths: tuple[int, ...],
                            context_parallel: int, link: LinkProfile | None,
                            recompute: str | None) -> StageTimes:
    cfg, hardware = compute.spec.config, compute.hardware
    cp = context_parallel
    local = -(-padded_tokens(lengths, cp) // cp)
    at_local = AnalyticCompute(ModelSpec(_with_seq(cfg, local), compute.spec.family), hardware)
    base = at_local.rank_stage_times(piece, 1, recompute)
    one_long = attention_seconds(cfg, hardware, local)
    # one varlen kernel over all documents: the whole micro-batch's attention as one sequence,
    # scaled to the (query, key) pairs its documents hold, a 1/CP share of it per rank
    tokens = padded_tokens(lengths, cp)
    pairs = sum(float(n) * n for n in lengths) / (float(tokens) * tokens)
    own = [attention_seconds(cfg, hardware, tokens)[k] * pairs / cp for k in (0, 1)]
    ring = (ring_exposed_seconds(cfg, local, cp, (own[0], own[1]), link)
            if cp > 1 and link is not None else (0.0, 0.0))
    layers = piece.num_layers
    forward = layers * (own[0] - one_long[0] + ring[0])
    backward = layers * (own[1] - one_long[1] + ring[1])
    if recompute == "full":
        backward += forward
    return StageTimes(base.forward + forward, base.backward + backward, base.weight)


def microbatch_factors(compute: AnalyticCompute, pieces: Sequence[StagePiece],
                       microbatches: Sequence[Sequence[int]], priced: Sequence[int],
                       context_parallel: int = 1, link: LinkProfile | None = None,
                       recompute: str | None = None, split_backward: bool = False
                       ) -> tuple[tuple[tuple[float, float, float], ...], tuple[float, ...]]:
    """(:attr:`CostModel.microbatch_work`, :attr:`CostModel.microbatch_tokens`): each
    micro-batch's (F, B, W) seconds summed over ``pieces`` (B: the input-gradient part when
    ``split_backward``, else the whole backward) and its tokens, relative to the ``priced``
    micro-batch's (the document lengths the stage costs were priced for)."""

    def totals(lengths: Sequence[int]) -> tuple[float, float, float]:
        times = [microbatch_stage_times(compute, p, lengths, context_parallel, link, recompute)
                 for p in pieces]
        weight = sum(t.weight for t in times)
        backward = sum(t.backward for t in times) - (weight if split_backward else 0.0)
        return sum(t.forward for t in times), backward, weight

    ref = totals(priced)
    work = tuple(tuple(v / r if r else 0.0 for v, r in zip(totals(m), ref, strict=True))
                 for m in microbatches)
    tokens = tuple(sum(m) / sum(priced) for m in microbatches)
    return work, tokens  # type: ignore[return-value]


def spread_documents(lengths: Sequence[int], num_microbatches: int) -> list[tuple[int, ...]]:
    """Documents spread over ``num_microbatches`` micro-batches, longest first into the one with
    the fewest tokens (deterministic; ties by index): the tuner's packing of a length mix."""
    bins: list[list[int]] = [[] for _ in range(num_microbatches)]
    loads = [0] * num_microbatches
    for n in sorted(lengths, reverse=True):
        i = min(range(num_microbatches), key=lambda j: (loads[j], j))
        bins[i].append(n)
        loads[i] += n
    return [tuple(b) for b in bins]


class MixPerformanceModel(PerformanceModel):
    """The performance model for a real length mix: ``documents`` (token lengths of one global
    batch) are dealt round-robin to the ``W`` replicas and replica 0's spread over its ``N``
    micro-batches (:func:`spread_documents`); the simulator prices each by its own documents
    (:func:`microbatch_factors`) at the layout's CP, relative to ``B`` sequences of
    ``--seq-length`` (what the stage costs price). Analytic compute only."""

    def __init__(self, spec: ModelSpec, hardware: HardwareProfile, documents: Sequence[int],
                 **kwargs) -> None:
        super().__init__(spec, hardware, **kwargs)
        if not documents or min(documents) < 1:
            raise ValueError("MixPerformanceModel: documents must be positive token counts")
        self.documents = tuple(int(n) for n in documents)

    def microbatches(self, layout: TrainingPlan) -> list[tuple[int, ...]]:
        """Replica 0's micro-batches (document lengths) under ``layout``."""
        return spread_documents(self.documents[0::layout.W], layout.N)

    def cost_model(self, layout: TrainingPlan):  # noqa: D102 (the base's, per micro-batch)
        base = super().cost_model(layout)
        if not isinstance(self.compute, AnalyticCompute):
            raise ValueError("MixPerformanceModel prices micro-batches analytically only")
        link = self.context_parallel_link(layout) if layout.CP > 1 else None
        seq = self.spec.config.seq_length
        work, tokens = microbatch_factors(
            self.compute, self.partition(layout), self.microbatches(layout),
            (seq,) * layout.B, layout.CP, link, layout.recompute_mode,
            self.schedule(layout).split_backward)
        return dataclasses.replace(base, microbatch_work=work, microbatch_tokens=tokens)
