"""Mixture-of-experts pricing for the performance model: the MoE layer's kernels, its token
traffic over the expert-parallel group and the memory of the dispatched tokens.

An MoE layer (``--num-experts E``, ``--moe-layer-freq``) replaces the dense MLP by (per rank,
``m`` local tokens: ``B s``, or ``B s / T`` under sequence parallelism, which MoE needs with T > 1;
``EP`` expert-parallel ranks, each holding ``E / EP`` experts):

* the **router** GEMM ``(m, E, h)`` and its softmax / top-k over ``m E`` fp32 scores;
* the **experts**: balanced routing sends ``m k / E`` of a rank's ``m k`` assignments to every
  expert (``k`` = ``--moe-router-topk``); with ``--moe-expert-capacity-factor f`` an expert keeps
  at most ``ceil(m k / E x f)`` of a source rank's tokens (Megatron's rule, no padding), so
  balanced routing drops only when ``f < 1``. Each local expert sees ``EP x`` that many rows from
  the EP ranks: GEMMs ``(rows, fe, h)`` (SwiGLU ``2 fe``) and ``(rows, h, fe)``; with
  ``--moe-grouped-gemm`` one batched GEMM over the ``E / EP`` experts (one kernel, its tiles in
  one wave count), otherwise one GEMM per expert (a kernel gap each, each its own waves);
* the **shared expert** (``--moe-shared-expert-intermediate-size fs``): a dense tensor-parallel
  MLP over every token (``fs / T`` columns), its optional gate a memory-bound pass;
* **permutation**: the ``alltoall`` dispatcher gathers every routed row (read ``m h``, write
  ``m k h``), regroups the received rows by expert (read and write), and the combine reverses
  both and sums the weighted rows; memory-bound, priced by bytes. The backward moves the same.

**Expert-parallel traffic** (EP > 1). ``alltoall``: one all-to-all of the routed rows for the
dispatch and one for the combine, each rank sending ``rows x h x bytes x (EP-1)/EP`` in ``EP-1``
messages (plus one all-to-all of the per-expert counts: latency only); the backward sends their
gradients, the same bytes. These are the stage's :attr:`CostModel.all_to_all_cost` (per
micro-batch and direction), which a pair of ``--overlap-moe-expert-parallel-comm`` hides as the
simulator models it (docs/CHIMERA_EP.md, "Costs and the simulator"). ``allgather`` (Megatron's
default): an all-gather of the ``m h`` tokens (and the ``m E`` fp32 scores and routing map) and a
reduce-scatter of the outputs, backward the reverse: synchronous, so priced into the stage's
compute, never hidden. The EP group is ``EP`` consecutive ranks of a pipeline rank (``layout``:
expert ranks are folded out of its T x CP x W ranks), intra-node when they fit a node.

**Memory**: experts' parameters, gradients and optimizer state are ``E / EP`` per rank
(``model/partition.py``); the dispatched rows add, per MoE layer and micro-batch, the expert
GEMMs' saved inputs (``rows x (2 h + 2 fe)``, SwiGLU ``2 h + 3 fe``), the shared expert's and the
router's scores, in place of the dense MLP's (:func:`moe_extra_activation_bytes`).
"""

from __future__ import annotations

import math

from megatron_chimera.config import DTYPE_BYTES, ConfigError, ModelConfig
from megatron_chimera.model.partition import expert_parameters
from megatron_chimera.tuning.analytic_costs import StagePiece, ring_collective_seconds
from megatron_chimera.tuning.hardware import HardwareProfile, LinkProfile
from megatron_chimera.tuning.operators import Gemm, LayerShapes, Ops, Streaming, _backward_of

DENSE_MLP_KERNELS = ("fc1", "fc2", "activation")  # the dense MLP's kernels an MoE layer drops


def moe_layer_count(config: ModelConfig, piece: StagePiece) -> int:
    """MoE layers in ``piece`` (``--moe-layer-freq``)."""
    if not config.moe.enabled:
        return 0
    start, end = piece.layer_range
    return sum(config.moe.moe_layers(config.num_layers)[start:end])


def check_expert_parallel(config: ModelConfig, expert_parallel: int, ranks: int) -> None:
    """ConfigError when EP does not divide the experts or the ``ranks`` (T x CP x W) it is
    folded out of, or when EP > 1 without experts."""
    if expert_parallel < 1:
        raise ConfigError(f"--expert-model-parallel-size must be positive, got {expert_parallel}")
    if expert_parallel > 1 and not config.moe.enabled:
        raise ConfigError(f"--expert-model-parallel-size {expert_parallel} needs --num-experts")
    if config.moe.enabled and config.moe.num_experts % expert_parallel:
        raise ConfigError(f"--num-experts {config.moe.num_experts} is not divisible by "
                          f"--expert-model-parallel-size {expert_parallel}")
    if ranks % expert_parallel:
        raise ConfigError(f"--expert-model-parallel-size {expert_parallel} does not divide "
                          f"tensor x context x data-parallel size {ranks} (expert-parallel "
                          f"ranks are folded out of one pipeline rank's ranks)")


def rows_per_source(config: ModelConfig, tokens: int) -> float:
    """Rows one expert takes from one rank's ``tokens`` under balanced routing: ``tokens k / E``,
    at most ``ceil(tokens k / E x f)`` with a capacity factor ``f``."""
    moe = config.moe
    balanced = tokens * moe.moe_router_topk / moe.num_experts
    if moe.moe_expert_capacity_factor is None:
        return balanced
    return min(balanced, math.ceil(balanced * moe.moe_expert_capacity_factor))


def routed_rows(config: ModelConfig, tokens: int) -> float:
    """Rows a rank dispatches (and, balanced, receives): ``E x`` :func:`rows_per_source`."""
    return config.moe.num_experts * rows_per_source(config, tokens)


def _expert_gemms(config: ModelConfig, x: LayerShapes, expert_parallel: int) -> tuple[Gemm, ...]:
    moe = config.moe
    local = moe.num_experts // expert_parallel
    rows = max(1, round(expert_parallel * rows_per_source(config, x.residual_tokens)))
    fe = moe.moe_ffn_hidden_size or config.ffn_size
    fc1 = 2 * fe if config.swiglu else fe
    if moe.moe_grouped_gemm:
        return (Gemm("experts.fc1", rows, fc1, x.hidden, local),
                Gemm("experts.fc2", rows, x.hidden, fe, local))
    return (Gemm("experts.fc1", rows, fc1, x.hidden),
            Gemm("experts.fc2", rows, x.hidden, fe)) * local


def _shared_gemms(config: ModelConfig, x: LayerShapes, tensor_parallel: int) -> tuple[Gemm, ...]:
    fs = config.moe.moe_shared_expert_intermediate_size
    if not fs:
        return ()
    cols = fs // tensor_parallel
    return (Gemm("shared.fc1", x.tokens, 2 * cols if config.swiglu else cols, x.hidden),
            Gemm("shared.fc2", x.tokens, x.hidden, cols))


def _moe_streams(config: ModelConfig, x: LayerShapes, expert_parallel: int,
                 tensor_parallel: int, backward: bool) -> tuple[Streaming, ...]:
    moe = config.moe
    m, h, w = x.residual_tokens, x.hidden, x.width
    rows = routed_rows(config, m)  # rows this rank sends = rows its experts receive (balanced)
    fe = moe.moe_ffn_hidden_size or config.ffn_size
    scores = float(m) * moe.num_experts * 4
    act = float(rows) * fe * w
    streams = [Streaming("router.softmax-topk", (3 if backward else 2) * scores),
               Streaming("permute", (m + rows) * h * w),
               Streaming("unpermute", (rows + m) * h * w + rows * 4),
               Streaming("experts.activation",
                         ((5 if backward else 3) if config.swiglu else (3 if backward else 2))
                         * act)]
    if expert_parallel > 1 and moe.moe_token_dispatcher_type == "alltoall":
        streams += [Streaming("regroup", 2.0 * rows * h * w),
                    Streaming("regroup-back", 2.0 * rows * h * w)]
    fs = moe.moe_shared_expert_intermediate_size
    if fs:
        shared = float(x.tokens) * (fs // tensor_parallel) * w
        streams.append(Streaming("shared.activation",
                                 ((5 if backward else 3) if config.swiglu
                                  else (3 if backward else 2)) * shared))
        if moe.moe_shared_expert_gate:
            streams.append(Streaming("shared.gate", 3.0 * m * h * w))
    return tuple(streams)


def moe_mlp_ops(config: ModelConfig, x: LayerShapes, expert_parallel: int,
                tensor_parallel: int) -> tuple[Ops, Ops]:
    """(forward, backward) kernels of one MoE layer's MLP part on one rank (module doc)."""
    gemms = ((Gemm("router", x.residual_tokens, config.moe.num_experts, x.hidden),)
             + _expert_gemms(config, x, expert_parallel)
             + _shared_gemms(config, x, tensor_parallel))
    dgrad, wgrad = _backward_of(gemms)
    forward = Ops(gemms, _moe_streams(config, x, expert_parallel, tensor_parallel, False))
    backward = Ops(dgrad, _moe_streams(config, x, expert_parallel, tensor_parallel, True),
                   wgrad)
    return forward, backward


def without_dense_mlp(ops: Ops) -> Ops:
    """``ops`` of a dense layer less its MLP (fc1, fc2 and their gradients, the activation)."""

    def keep(name: str) -> bool:
        return name.split(".")[0] not in DENSE_MLP_KERNELS

    return Ops(tuple(g for g in ops.gemms if keep(g.name)),
               tuple(s for s in ops.streams if keep(s.name)),
               tuple(g for g in ops.weight_gemms if keep(g.name)))


def all_to_all_bytes(config: ModelConfig, tokens: int, expert_parallel: int) -> float:
    """Bytes one rank sends in one token all-to-all (dispatch or combine) of one MoE layer:
    ``rows x h x bytes x (EP - 1) / EP``, ``rows`` = :func:`routed_rows` (``tokens x k``
    dropless)."""
    if expert_parallel <= 1:
        return 0.0
    return (routed_rows(config, tokens) * config.hidden_size * config.dtype_bytes
            * (expert_parallel - 1) / expert_parallel)


def all_to_all_seconds(config: ModelConfig, tokens: int, expert_parallel: int,
                       link: LinkProfile) -> float:
    """One direction of one MoE layer with the ``alltoall`` dispatcher: the counts all-to-all
    (latency), dispatch and combine, each ``EP - 1`` messages on ``link``."""
    if expert_parallel <= 1:
        return 0.0
    nbytes = all_to_all_bytes(config, tokens, expert_parallel)
    messages = expert_parallel - 1
    return 3 * messages * link.alpha_s + 2 * nbytes * link.beta_s_per_byte


def allgather_dispatch_seconds(config: ModelConfig, tokens: int, expert_parallel: int,
                               link: LinkProfile) -> float:
    """One direction of one MoE layer with the ``allgather`` dispatcher: the all-gather of the
    tokens (and of the fp32 scores and the routing map) and the reduce-scatter of the outputs
    (the backward runs their reverses, the same bytes)."""
    if expert_parallel <= 1:
        return 0.0
    ep, moe = expert_parallel, config.moe
    tokens_bytes = float(ep * tokens * config.hidden_size * config.dtype_bytes)
    routing_bytes = float(ep * tokens * moe.num_experts * (4 + 1))
    return (2 * ring_collective_seconds(tokens_bytes, ep, link)
            + ring_collective_seconds(routing_bytes, ep, link))


def expert_parallel_seconds(config: ModelConfig, piece: StagePiece, tokens: int,
                            expert_parallel: int, link: LinkProfile) -> tuple[float, float]:
    """(all-to-all, synchronous collectives) seconds of one micro-batch through ``piece`` in one
    direction: the ``alltoall`` dispatcher's all-to-alls (the stage's A_s) or the ``allgather``
    dispatcher's collectives (on the compute's critical path)."""
    layers = moe_layer_count(config, piece)
    if not layers or expert_parallel <= 1:
        return 0.0, 0.0
    if config.moe.moe_token_dispatcher_type == "alltoall":
        return layers * all_to_all_seconds(config, tokens, expert_parallel, link), 0.0
    return 0.0, layers * allgather_dispatch_seconds(config, tokens, expert_parallel, link)


def plan_expert_parallel_seconds(config: ModelConfig, hardware: HardwareProfile,
                                 micro_batch: int, tensor_parallel: int, context_parallel: int,
                                 expert_parallel: int, sequence_parallel: bool,
                                 piece: StagePiece, p2p_link: LinkProfile | None = None
                                 ) -> tuple[float, float]:
    """:func:`expert_parallel_seconds` of one rank of a layout: its ``B s / CP`` tokens (``/ T``
    under sequence parallelism) on the link of EP consecutive ranks (``layout``: expert ranks
    are the innermost fold of a pipeline rank's ranks), one message at a time for the
    all-to-alls, as a collective for the ``allgather`` dispatcher; ``p2p_link`` overrides."""
    if expert_parallel == 1:
        return 0.0, 0.0
    tokens = micro_batch * config.seq_length // context_parallel
    tokens //= tensor_parallel if sequence_parallel else 1
    group = hardware.link_for(range(expert_parallel))
    if config.moe.moe_token_dispatcher_type == "allgather":
        link = p2p_link or hardware.collective_link(group, expert_parallel)
    else:
        link = p2p_link or hardware.message_link(group)
    return expert_parallel_seconds(config, piece, tokens, expert_parallel, link)


def moe_extra_activation_bytes(config: ModelConfig, piece: StagePiece, micro_batch: int,
                               tensor_parallel: int, sequence_parallel: bool,
                               recompute: str | None) -> int:
    """Bytes the MoE layers of ``piece`` save for backward per micro-batch beyond what their
    dense MLPs would (``config`` holds this rank's sequence length; may be negative when the
    experts are narrower). Full recomputation keeps only the layer input: nothing more."""
    layers = moe_layer_count(config, piece)
    if not layers or recompute == "full":
        return 0
    moe, w, h = config.moe, DTYPE_BYTES[config.params_dtype], config.hidden_size
    t = tensor_parallel
    tokens = micro_batch * config.seq_length
    local = tokens // t if sequence_parallel and t > 1 else tokens
    per_ffn = 3 if config.swiglu else 2  # SwiGLU: [gate | up] and the product
    fe = moe.moe_ffn_hidden_size or config.ffn_size
    rows = routed_rows(config, local)
    moe_bytes = rows * (2 * h + per_ffn * fe) * w + local * moe.num_experts * 4
    if moe.moe_shared_expert_intermediate_size:
        moe_bytes += tokens * per_ffn * moe.moe_shared_expert_intermediate_size * w / t
    dense = tokens * per_ffn * config.ffn_size * w / t
    return round(layers * (moe_bytes - dense))


def expert_gradient_bytes_saved(config: ModelConfig, piece: StagePiece, expert_parallel: int,
                                grad_width: int) -> float:
    """Gradient bytes of the experts of ``piece`` that EP removes from one rank's buffers:
    ``(1 - 1 / EP)`` of them."""
    if expert_parallel <= 1 or not config.moe.enabled:
        return 0.0
    start, end = piece.layer_range
    full = expert_parameters(config, start, end, 1)
    return float((full - expert_parameters(config, start, end, expert_parallel)) * grad_width)
