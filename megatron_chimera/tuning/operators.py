"""Compute time of a stage from its operations: every GEMM with its shape, every memory-bound
kernel with the bytes it moves.

**GEMMs** (one tensor-parallel rank, ``m = B s`` tokens, T ranks): QKV ``(m, qkv/T, h)``, the
attention output ``(m, h, heads d/T)``, the MLP's first ``(m, f/T, h)`` (SwiGLU: ``2f/T``) and
second ``(m, h, f/T)``; the attention core ``B heads/T`` batched GEMMs ``(s, s, d)`` (scores) and
``(s, d, s)`` (values); the LM head ``(m, V/T, h)`` (BERT's transform ``(m, h, h)`` too). A
backward runs two GEMMs per forward GEMM: the input gradient ``(m, k, n)`` and the weight
gradient ``(k, n, m)`` (the latter is the W of a split backward); the unfused attention core's
backward four (``dP = dO V^T``, ``dV = P^T dO``, ``dQ = dS K``, ``dK = dS^T Q``), a fused
(flash) core's backward five (the scores are recomputed).

A GEMM's time is a roofline: ``max(FLOPs / (peak x efficiency x shape), bytes / HBM bandwidth)``
plus the device gap of one kernel. ``shape`` is the fraction of the tensor cores a GEMM of that
shape keeps busy (NVIDIA's *Matrix Multiplication Background* guide: tile and wave
quantisation): the library picks the output tile among :data:`TILES`; a tile's partial edges
waste work (``m n / (ceil(m/tm) tm ceil(n/tn) tn)``), the last wave of tiles over the ``num_sms``
multiprocessors runs part-empty (``tiles / (ceil(tiles/SMs) SMs)``), tiles smaller than 128 x 128
re-read their operands too often to feed the tensor cores (relative efficiency: the tile's
operand reuse ``tm tn / (tm + tn)`` over that of 128 x 128, capped at 1), and a short reduction
pays the pipeline fill and the epilogue of each tile (``k / (k + K_FILL)``, :data:`K_FILL` = two
64-deep K steps). The largest tile wins. Nothing here is fitted to a measurement. A profile
without ``num_sms`` is an ideal device (no shape effect).

An FP8 GEMM (``Gemm.dtype``, set by :mod:`megatron_chimera.tuning.precision`) runs at the FP8
peak with one-byte operands. A block-scaled one on tensor cores without block scales
(``fp8-block``: ``--fp8-recipe blockwise`` on Hopper) multiplies every 128-deep partial sum of a
tile by its scales on the CUDA cores (DeepSeek-V3's promotion): ``tm tn`` FP32 FMAs per
``tm tn 128`` tensor-core MACs, i.e. ``peak_fp8 / (128 peak_fp32)`` more time (0.23 on an H100),
not hidden behind the MMAs (an upper bound).

**Memory-bound kernels** take ``bytes / (HBM bandwidth x memory_efficiency)``: layer norms (read,
write; backward read input and gradient, write), the fused bias-dropout-add (read two, write one,
a one-byte mask), the fused bias-GeLU (SwiGLU's gate), the unfused attention core's fused
scale-mask-softmax and attention dropout over ``B heads/T s^2`` scores (read, write; backward
three tensors), the embedding lookup, the vocabulary-parallel cross-entropy over ``m V/T`` fp32
logits (about nine fp32 passes forward, three backward), RoPE. With sequence parallelism the
residual-stream kernels (norms, dropout-add) run on ``m/T`` tokens.

**Recomputation**: full (``--recompute-granularity full``) runs the layer's forward again before
its backward; selective (``--recompute-granularity selective``, Megatron's) runs only the
attention core's forward again (its scores are not stored).

**Optimizer step**: Adam reads every gradient three times (unscale / inf check, norm for clipping,
update) and reads and writes the fp32 main parameter and both moments, and writes the 16-bit
parameter: memory-bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_chimera.config import DTYPE_BYTES, ConfigError, ModelConfig
from megatron_chimera.model.family import ModelFamily
from megatron_chimera.model.memory import bytes_per_parameter
from megatron_chimera.tuning.hardware import HardwareProfile

# output tiles a GEMM library chooses from (rows, columns)
TILES = ((256, 128), (128, 256), (128, 128), (128, 64), (64, 128), (64, 64))
REFERENCE_REUSE = 128 * 128 / (128 + 128)  # operand reuse of a 128 x 128 tile
SCALE_BLOCK_K = 128  # reduction depth of one FP8 scale block (1 x 128 / 128 x 128 recipes)
K_FILL = 128  # reduction depth lost to a tile's pipeline fill and epilogue (two 64-deep steps)
RECOMPUTE_GRANULARITIES = (None, "full", "selective")


@dataclass(frozen=True)
class Gemm:
    """``batch`` independent products of an ``(m, k)`` by a ``(k, n)`` matrix."""

    name: str
    m: int
    n: int
    k: int
    batch: int = 1
    dtype: str | None = None  # operands' precision when not the model's (``fp8``: precision.py)

    @property
    def flops(self) -> float:
        """Multiply-adds times two."""
        return 2.0 * self.m * self.n * self.k * self.batch


@dataclass(frozen=True)
class Streaming:
    """A memory-bound kernel: ``nbytes`` read plus written."""

    name: str
    nbytes: float


@dataclass(frozen=True)
class Ops:
    """The kernels of one pass (forward or backward) of one piece of a stage."""

    gemms: tuple[Gemm, ...] = ()
    streams: tuple[Streaming, ...] = ()
    weight_gemms: tuple[Gemm, ...] = ()  # weight-gradient GEMMs (a split backward's W)

    def __add__(self, other: Ops) -> Ops:
        return Ops(self.gemms + other.gemms, self.streams + other.streams,
                   self.weight_gemms + other.weight_gemms)

    def times(self, count: int) -> Ops:
        """The same kernels ``count`` times."""
        return Ops(self.gemms * count, self.streams * count, self.weight_gemms * count)


def shape_efficiency(hardware: HardwareProfile, gemm: Gemm) -> float:
    """Fraction of the large-GEMM rate a GEMM of this shape reaches (module doc); 1 on a
    profile without ``num_sms`` (an ideal device: FLOPs / (peak x efficiency))."""
    if hardware.num_sms <= 0:
        return 1.0
    depth = gemm.k / (gemm.k + K_FILL)
    best = 0.0
    for tm, tn in TILES:
        rows, cols = math.ceil(gemm.m / tm), math.ceil(gemm.n / tn)
        tiles = rows * cols * gemm.batch
        edges = gemm.m * gemm.n / (rows * tm * cols * tn)
        waves = tiles / (math.ceil(tiles / hardware.num_sms) * hardware.num_sms)
        reuse = min(1.0, tm * tn / (tm + tn) / REFERENCE_REUSE)
        best = max(best, reuse * edges * waves)
    return best * depth


def gemm_seconds(hardware: HardwareProfile, gemm: Gemm, params_dtype: str) -> float:
    """Roofline time of one GEMM (module doc)."""
    if gemm.flops == 0:
        return 0.0
    width = DTYPE_BYTES[params_dtype]
    fp8 = (gemm.dtype or "").startswith("fp8")
    operand = 1 if fp8 else width  # FP8 operands, the output in the model's dtype
    compute = gemm.flops / (hardware.achieved_flops("fp8" if fp8 else gemm.dtype or params_dtype)
                            * shape_efficiency(hardware, gemm))
    if gemm.dtype == "fp8-block":  # block scales promoted on the CUDA cores (module doc)
        compute *= 1 + hardware.peak_tflops_fp8 / (SCALE_BLOCK_K * hardware.peak_tflops_fp32)
    nbytes = gemm.batch * ((gemm.m * gemm.k + gemm.k * gemm.n) * operand + gemm.m * gemm.n * width)
    return max(compute, nbytes / hardware.memory_bytes_per_s()) + hardware.kernel_overhead_s


def streaming_seconds(hardware: HardwareProfile, stream: Streaming) -> float:
    """Bytes over the achievable HBM bandwidth, plus one kernel gap."""
    return stream.nbytes / hardware.memory_bytes_per_s() + hardware.kernel_overhead_s


def ops_seconds(hardware: HardwareProfile, ops: Ops, params_dtype: str) -> tuple[float, float]:
    """(all kernels, the weight-gradient GEMMs among them) in seconds."""
    weight = sum(gemm_seconds(hardware, g, params_dtype) for g in ops.weight_gemms)
    rest = sum(gemm_seconds(hardware, g, params_dtype) for g in ops.gemms)
    rest += sum(streaming_seconds(hardware, s) for s in ops.streams)
    return rest + weight, weight


def _backward_of(gemms: tuple[Gemm, ...]) -> tuple[tuple[Gemm, ...], tuple[Gemm, ...]]:
    """(input-gradient GEMMs, weight-gradient GEMMs) of weight GEMMs."""
    dgrad = tuple(Gemm(f"{g.name}.dgrad", g.m, g.k, g.n, g.batch) for g in gemms)
    wgrad = tuple(Gemm(f"{g.name}.wgrad", g.k, g.n, g.m, g.batch) for g in gemms)
    return dgrad, wgrad


@dataclass(frozen=True)
class LayerShapes:
    """Sizes of one layer on one tensor-parallel rank for one micro-batch."""

    tokens: int  # m = B s
    residual_tokens: int  # m, or m / T under sequence parallelism
    seq: int
    hidden: int
    heads: int  # query heads on this rank
    head_dim: int
    qkv: int  # QKV output columns on this rank
    ffn: int  # MLP hidden columns on this rank
    width: int  # bytes per element
    micro_batch: int


def layer_shapes(config: ModelConfig, micro_batch: int, tensor_parallel: int,
                 sequence_parallel: bool) -> LayerShapes:
    """The per-rank sizes of one layer (T divides heads, groups and the MLP: checked before)."""
    t = tensor_parallel
    tokens = micro_batch * config.seq_length
    return LayerShapes(tokens, tokens // t if sequence_parallel else tokens, config.seq_length,
                       config.hidden_size, config.num_attention_heads // t, config.head_dim,
                       config.qkv_size // t, config.ffn_size // t,
                       DTYPE_BYTES[config.params_dtype], micro_batch)


def attention_core_forward(config: ModelConfig, x: LayerShapes) -> Ops:
    """Scores, softmax, dropout and values of one layer (fused kernel or not)."""
    batch = x.micro_batch * x.heads
    gemms = (Gemm("scores", x.seq, x.seq, x.head_dim, batch),
             Gemm("values", x.seq, x.head_dim, x.seq, batch))
    if config.masked_softmax_fusion:  # fused (flash) attention: no s x s tensor in memory
        return Ops(gemms)
    scores = float(batch) * x.seq * x.seq * x.width
    streams = [Streaming("scale-mask-softmax", 2 * scores)]
    if config.attention_dropout > 0:
        streams.append(Streaming("attention-dropout", 2 * scores + scores / x.width))
    return Ops(gemms, tuple(streams))


def attention_core_backward(config: ModelConfig, x: LayerShapes) -> Ops:
    """The attention core's backward: four GEMMs (five when fused: the scores are recomputed)."""
    batch = x.micro_batch * x.heads
    square = Gemm("dprobs", x.seq, x.seq, x.head_dim, batch)
    thin = Gemm("dvalues", x.seq, x.head_dim, x.seq, batch)
    if config.masked_softmax_fusion:
        return Ops((square, square, thin, thin, thin))
    scores = float(batch) * x.seq * x.seq * x.width
    streams = [Streaming("softmax.backward", 3 * scores)]
    if config.attention_dropout > 0:
        streams.append(Streaming("attention-dropout.backward", 2 * scores + scores / x.width))
    return Ops((square, thin, thin, thin), tuple(streams))


def _weight_gemms(config: ModelConfig, x: LayerShapes) -> tuple[Gemm, ...]:
    mlp_in = 2 * x.ffn if config.swiglu else x.ffn
    return (Gemm("qkv", x.tokens, x.qkv, x.hidden),
            Gemm("dense", x.tokens, x.hidden, x.heads * x.head_dim),
            Gemm("fc1", x.tokens, mlp_in, x.hidden),
            Gemm("fc2", x.tokens, x.hidden, x.ffn))


def _layer_streams(config: ModelConfig, x: LayerShapes, backward: bool) -> tuple[Streaming, ...]:
    """Norms, bias-dropout-adds, activation (and RoPE) of one layer's forward or backward."""
    residual = float(x.residual_tokens) * x.hidden
    mask = 1.0 if config.hidden_dropout > 0 else 0.0
    norm = (3 if backward else 2) * residual * x.width
    dropout_add = residual * ((2 * x.width + mask) if backward else (3 * x.width + mask))
    ffn = float(x.tokens) * x.ffn * x.width
    activation = (5 if backward else 3) * ffn if config.swiglu else (3 if backward else 2) * ffn
    streams = [Streaming("norm", norm), Streaming("norm", norm),
               Streaming("bias-dropout-add", dropout_add),
               Streaming("bias-dropout-add", dropout_add), Streaming("activation", activation)]
    if config.position_embedding_type == "rope":
        streams.append(Streaming("rope", 2.0 * x.tokens * x.qkv * x.width))
    return tuple(streams)


def layer_forward_ops(config: ModelConfig, x: LayerShapes) -> Ops:
    """All kernels of one layer's forward on one rank."""
    return (Ops(_weight_gemms(config, x), _layer_streams(config, x, backward=False))
            + attention_core_forward(config, x))


def layer_backward_ops(config: ModelConfig, x: LayerShapes) -> Ops:
    """All kernels of one layer's backward (no recomputation) on one rank."""
    dgrad, wgrad = _backward_of(_weight_gemms(config, x))
    return (Ops(dgrad, _layer_streams(config, x, backward=True), wgrad)
            + attention_core_backward(config, x))


def embedding_ops(config: ModelConfig, x: LayerShapes) -> tuple[Ops, Ops]:
    """(forward, backward) of the embeddings: lookup, position add, dropout; the backward
    accumulates the looked-up rows into the fp32 gradient."""
    elements = float(x.tokens) * x.hidden
    forward = Streaming("embedding", elements * (5 * x.width + 1))
    backward = Streaming("embedding.backward", elements * (2 * x.width + 1 + 8))
    return Ops(streams=(forward,)), Ops(streams=(backward,))


def head_ops(config: ModelConfig, family: ModelFamily, x: LayerShapes,
             tensor_parallel: int) -> tuple[Ops, Ops]:
    """(forward, backward) of the final norm, the LM head GEMM (and BERT's transform) and the
    vocabulary-parallel cross-entropy on one rank."""
    vocab = config.padded_vocab_size // tensor_parallel
    gemms = [Gemm("logits", x.tokens, vocab, x.hidden)]
    residual = float(x.residual_tokens) * x.hidden
    streams_f = [Streaming("final-norm", 2 * residual * x.width)]
    streams_b = [Streaming("final-norm.backward", 3 * residual * x.width)]
    if family.lm_head_transform:
        gemms.append(Gemm("head-transform", x.tokens, x.hidden, x.hidden))
        full = float(x.tokens) * x.hidden * x.width
        streams_f += [Streaming("head-gelu", 2 * full), Streaming("head-norm", 2 * full)]
        streams_b += [Streaming("head-gelu.backward", 3 * full),
                      Streaming("head-norm.backward", 3 * full)]
    logits = float(x.tokens) * vocab
    streams_f.append(Streaming("cross-entropy", logits * (x.width + 9 * 4)))
    streams_b.append(Streaming("cross-entropy.backward", logits * (3 * 4 + x.width)))
    dgrad, wgrad = _backward_of(tuple(gemms))
    return Ops(tuple(gemms), tuple(streams_f)), Ops(dgrad, tuple(streams_b), wgrad)


def optimizer_bytes_per_parameter(params_dtype: str) -> float:
    """Bytes Adam's step moves per parameter (module doc)."""
    widths = bytes_per_parameter(params_dtype)
    grad = widths["grad"]
    master = 0 if params_dtype == "fp32" else DTYPE_BYTES[params_dtype]  # the 16-bit copy
    return 3 * grad + 2 * 4 + 2 * 8 + master


def check_recompute(granularity: str | None) -> None:
    """ConfigError unless ``granularity`` is None, ``full`` or ``selective``."""
    if granularity not in RECOMPUTE_GRANULARITIES:
        raise ConfigError(f"--recompute-granularity must be 'full' or 'selective', got "
                          f"{granularity!r}")
