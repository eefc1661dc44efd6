"""Pre-LayerNorm transformer layers with Megatron's module names, and the stack one stage holds.

Activations are ``[seq, batch, hidden]``. ``layer_number`` is 1-based and *global* (Megatron's
convention), so a stage slice's ``layers.{i}`` (local index) knows which model layer it is.

Tensor parallelism (T = ``parallel_state.get_tensor_model_parallel_world_size()``): the attention
heads and the MLP's inner features are split over the T ranks (column-parallel ``query_key_value``
and ``dense_h_to_4h``, row-parallel ``dense`` and ``dense_4h_to_h``). With
``config.sequence_parallel`` the residual stream, LayerNorms and dropouts between them hold
``[s/T, b, h]`` (all-gather into the column-parallel layers, reduce-scatter out of the
row-parallel ones). Dropout on tensor- or sequence-split data draws per tensor rank: inside a
keyed-dropout stream (training, ``model/dropout_rng.py``) from a side stream keyed by the micro-
batch, the site and the tensor rank (so resume and layouts stay exact), else from the
tensor-parallel RNG stream (``tensor_parallel.get_cuda_rng_tracker().fork()``); other dropouts
draw the same mask on every tensor rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools

import torch
import torch.nn.functional as F
from torch import nn

from megatron_chimera import parallel_state
from megatron_chimera.config import (
    GELU_VARIANTS,
    RECOMPUTE_GRANULARITIES,
    RECOMPUTE_METHODS,
    ConfigError,
    ModelConfig,
)
from megatron_chimera.model.architecture import check_architecture
from megatron_chimera.model.context_parallel import (
    ContextTokens,
    context_parallel_attention,
    context_parallel_size,
    stage_tokens,
)
from megatron_chimera.model.document_attention import DocumentMask, document_attention
from megatron_chimera.model.dropout_rng import (
    current_stream,
    in_stream,
    keyed_site,
    layer_site,
    seed_site,
    with_current_stream,
)
from megatron_chimera.model.fused import (
    FusedBackend,
    LayerNorm,
    RMSNorm,
    attention,
    bias_dropout_add,
    gelu,
    repeat_heads,
    swiglu,
    warn_once,
)
from megatron_chimera.model.moe.layer import MoELayer
from megatron_chimera.model.rotary import RotaryEmbedding, RotaryTables, rotate_sequence_first
from megatron_chimera.model.sequence_slices import SliceTokens
from megatron_chimera.model.utils import init_linear_, layer_key, make_generator, scaled_init_std
from megatron_chimera.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    checkpoint,
    get_cuda_rng_tracker,
)
from megatron_chimera.tensor_parallel.utils import mark_sequence_parallel


def validate_recompute(config: ModelConfig) -> None:
    """The one ``--recompute-*`` rule, checked when the flags are parsed and when a model is
    built: reject inconsistent flags with a message naming the flag."""
    granularity, method = config.recompute_granularity, config.recompute_method
    num_layers = config.recompute_num_layers
    if granularity not in (None, *RECOMPUTE_GRANULARITIES):
        raise ConfigError(
            f"--recompute-granularity must be 'selective' or 'full', got {granularity!r}")
    if granularity == "full" and method is None:
        raise ConfigError("--recompute-granularity full requires --recompute-method")
    if method is not None and granularity != "full":
        raise ConfigError("--recompute-method requires --recompute-granularity full")
    if method is not None and num_layers is None:
        raise ConfigError("--recompute-method requires --recompute-num-layers")
    if num_layers is not None and method is None:
        raise ConfigError("--recompute-num-layers requires --recompute-method")
    if method is not None and method not in RECOMPUTE_METHODS:
        raise ConfigError(
            f"--recompute-method must be 'uniform' or 'block' with "
            f"--recompute-granularity full, got {method!r}")
    if num_layers is not None and num_layers < 1:
        raise ConfigError(
            "--recompute-num-layers must be >= 1 with --recompute-granularity full")


AttentionMask = torch.Tensor | DocumentMask | ContextTokens | SliceTokens | None


def uses_sequence_parallel(config: ModelConfig) -> bool:
    """Whether the model runs sequence parallel: ``--sequence-parallel`` and T > 1."""
    return config.sequence_parallel and parallel_state.get_tensor_model_parallel_world_size() > 1


_NO_CONTEXT = contextlib.nullcontext()  # reusable: entering it does nothing


def tensor_parallel_rng(split: bool, site: str) -> contextlib.AbstractContextManager:
    """A per-tensor-rank stream for dropout site ``site`` on ``split`` (per-rank) data, else the
    default stream (the same mask on every tensor-parallel rank). In a keyed-dropout stream the
    per-rank stream is keyed by (micro-batch, site, tensor rank) -- with one tensor rank nothing
    is split and the layer's own keyed stream serves, without a side stream's cost; outside a
    keyed stream it is the tracker's."""
    if not split:
        return _NO_CONTEXT
    stream = current_stream()
    if stream is None:
        return get_cuda_rng_tracker().fork()
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return _NO_CONTEXT
    rank = parallel_state.get_tensor_model_parallel_rank()
    return keyed_site(stream, f"{site}:tensor-rank:{rank}")


def sequence_parallel_layer_norm(config: ModelConfig, backend: FusedBackend
                                 ) -> LayerNorm | RMSNorm:
    """A norm of the residual stream (``--normalization``: LayerNorm or RMSNorm); its parameters
    are marked ``sequence_parallel`` (partial gradients per rank) when the model runs sequence
    parallel."""
    if config.normalization == "RMSNorm":
        norm = RMSNorm(config.hidden_size, config.layernorm_epsilon, config.torch_dtype)
    else:
        norm = LayerNorm(config.hidden_size, config.layernorm_epsilon, backend,
                         config.torch_dtype)
    mark_sequence_parallel(norm, uses_sequence_parallel(config))
    return norm


class CoreAttention(nn.Module):
    """Scaled (masked) softmax attention of ``[b, heads, s, head_dim]`` queries, keys, values."""

    def __init__(self, config: ModelConfig, layer_number: int, causal: bool) -> None:
        super().__init__()
        self.causal = causal
        self.site = f"{layer_site(layer_number)}:attention"
        self.dropout_p = config.attention_dropout
        self.fused = config.masked_softmax_fusion
        self.softmax_in_fp32 = config.attention_softmax_in_fp32
        self.apply_layer_scaling = config.apply_query_key_layer_scaling
        self.layer_scale = float(layer_number) if config.apply_query_key_layer_scaling else 1.0
        self.use_flash_attn = config.use_flash_attn
        self.document_attention = config.document_attention
        # the heads are split over the tensor ranks (the layout is fixed when the model is built)
        self.tensor_split = parallel_state.get_tensor_model_parallel_world_size() > 1
        self._noticed = False
        self._options = {  # the attention kernel's options, by whether the query is on CUDA
            on_cuda: dict(fused=self.fused, softmax_in_fp32=self.softmax_in_fp32,
                          layer_scale=self.layer_scale, flash_only=self.use_flash_attn and on_cuda)
            for on_cuda in (False, True)}

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                mask: AttentionMask) -> torch.Tensor:
        """Context ``[b, heads, s, head_dim]``; ``mask`` is a bool tensor, True where attention
        is forbidden, or a :class:`DocumentMask` (causal attention within documents). The heads
        are this rank's: attention dropout draws from the tensor-parallel RNG stream."""
        if not self._noticed:
            self._notices(query)
        if (self.training and self.dropout_p > 0
                and (self.tensor_split or current_stream() is None)):
            with tensor_parallel_rng(True, self.site):
                return self._attend(query, key, value, mask)
        # (one tensor rank in a keyed stream: the layer's own stream serves, no context to enter
        # on this per-layer path -- tensor_parallel_rng would return a null one)
        return self._attend(query, key, value, mask)

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                mask: AttentionMask) -> torch.Tensor:
        options = self._options[query.is_cuda]
        if isinstance(mask, DocumentMask):
            if not self.causal:
                raise ValueError("a document mask needs causal (GPT) attention")
            repeats = query.shape[1] // key.shape[1]  # grouped-query heads, repeated
            return document_attention(query, repeat_heads(key, repeats),
                                      repeat_heads(value, repeats), mask, self.dropout_p,
                                      self.training, implementation=self.document_attention,
                                      **options)
        return attention(query, key, value, mask, self.causal, self.dropout_p, self.training,
                         **options)

    def stores_no_scores(self, query: torch.Tensor, mask: AttentionMask) -> bool:
        """Whether this core keeps no ``[s, s]`` scores for its backward: the fused kernel on CUDA
        with plain causal attention (flash / memory-efficient SDPA). Selective recomputation
        then has nothing to save and skips re-running the core."""
        return self.fused and query.is_cuda and mask is None

    def _notices(self, query: torch.Tensor) -> None:
        """Flags that cannot act on this device / path, said once per process (looked at on
        the first forward: a layer's device and dtype do not change in training)."""
        self._noticed = True
        if self.use_flash_attn and not query.is_cuda:
            warn_once("--use-flash-attn has no effect on the CPU: flash and memory-efficient "
                      "attention are CUDA kernels; scaled_dot_product_attention picks its CPU "
                      "kernel (same result)")
        if not self.fused or query.dtype == torch.float32:
            return  # honoured on the unfused path; fp32 scores and softmax are fp32 anyway
        for flag, on in (("--attention-softmax-in-fp32", self.softmax_in_fp32),
                         ("--apply-query-key-layer-scaling", self.apply_layer_scaling)):
            if on:
                warn_once(f"{flag} has no effect on the fused attention path: "
                          "scaled_dot_product_attention's fused kernels compute the scores and "
                          "softmax in fp32 internally (layer scaling only guards an fp16 "
                          "softmax); add --no-masked-softmax-fusion for Megatron's unfused "
                          "softmax, which honours it")


def _tensor_parallel_size(size: int, flag: str) -> int:
    """``size / T`` (the layout's rule); ConfigError naming ``flag`` when T does not divide it."""
    return parallel_state.get_parallel_layout().split(size, flag)


class ParallelAttention(nn.Module):
    """Self-attention: ``query_key_value`` projection (column-parallel: this rank's query groups),
    rotary embedding, core attention, output ``dense`` (row-parallel). With grouped-query
    attention (``--num-query-groups g``) each group of ``heads / g`` query heads shares one key
    and one value head; T divides the groups."""

    def __init__(self, config: ModelConfig, layer_number: int, causal: bool) -> None:
        super().__init__()
        check_architecture(config)
        h, d = config.hidden_size, config.head_dim
        self.num_heads = _tensor_parallel_size(config.num_attention_heads,
                                               "--num-attention-heads")
        self.num_groups = _tensor_parallel_size(config.query_groups, "--num-query-groups")
        self.heads_per_group = config.num_attention_heads // config.query_groups
        self.head_dim = d
        sequence_parallel = uses_sequence_parallel(config)
        self.query_key_value = ColumnParallelLinear(
            h, config.qkv_size, bias=config.has_qkv_bias, gather_output=False,
            sequence_parallel=sequence_parallel, dtype=config.torch_dtype,
            async_allreduce=config.async_tensor_model_parallel_allreduce)
        self.core_attention = CoreAttention(config, layer_number, causal)
        self.dense = RowParallelLinear(
            config.num_attention_heads * d, h, bias=config.add_bias_linear,
            input_is_parallel=True, skip_bias_add=not config.bias_dropout_fusion,
            sequence_parallel=sequence_parallel, dtype=config.torch_dtype)
        self.recompute_core = config.recompute_granularity == "selective"
        self.compile_elementwise = config.bias_dropout_fusion  # RoPE compiled on CUDA
        self.cp_comm_type = config.layer_cp_comm_type(layer_number)
        self.layer_number = layer_number

    def query_key_value_heads(self, qkv: torch.Tensor, rotary: RotaryTables | None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[s, b, groups x (heads/g + 2) x d]`` -> query ``[b, heads, s, d]``, key and value
        ``[b, groups, s, d]`` (this rank's), RoPE applied to query and key."""
        s, b, _ = qkv.shape
        d, per_group = self.head_dim, self.heads_per_group
        if rotary is not None:
            # a group's query heads and its key are neighbours in the buffer: rotated together,
            # [s, b, groups, heads/g + 1, d], in one call
            heads = qkv.view(s, b, self.num_groups, per_group + 2, d)
            query_key = rotate_sequence_first(heads[:, :, :, :per_group + 1], rotary,
                                              fused=self.compile_elementwise and qkv.is_cuda)
            query = query_key[:, :, :, :per_group].reshape(s, b, self.num_heads, d)
            return (query.permute(1, 2, 0, 3), query_key[:, :, :, per_group].permute(1, 2, 0, 3),
                    heads[:, :, :, per_group + 1].permute(1, 2, 0, 3))
        qkv = qkv.view(s, b, self.num_groups, (per_group + 2) * d)
        # (split_with_sizes: Tensor.split's Python wrapper costs as much again; one query head
        # per group is already [s, b, heads, d], so no reshape node in the graph)
        query, key, value = qkv.split_with_sizes([per_group * d, d, d], dim=-1)
        if per_group > 1:
            query = query.reshape(s, b, self.num_heads, d)
        query = query.permute(1, 2, 0, 3)
        return query, key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3)

    def repeat_key_value(self, key: torch.Tensor, value: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[b, groups, t, d]`` repeated for each query head of their group."""
        return repeat_heads(key, self.heads_per_group), repeat_heads(value, self.heads_per_group)

    def forward(self, hidden: torch.Tensor, mask: AttentionMask,
                rotary: RotaryTables | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[s(/T), b, h] -> ([s(/T), b, h], bias)``; QKV laid out per query group as
        ``[q_1 .. q_(heads/g) | k | v]`` (Megatron; ``[q | k | v]`` per head without groups),
        this rank's groups. ``bias`` is the output bias left for bias-dropout-add with
        ``--no-bias-dropout-fusion``, else None (already added)."""
        qkv, _ = self.query_key_value(hidden)
        s, b, _ = qkv.shape
        # grouped-query keys and values stay at their group count: the attention core repeats
        # them per query head only where its kernel cannot share them (fused.attention)
        query, key, value = self.query_key_value_heads(qkv, rotary)
        if isinstance(mask, ContextTokens):  # context parallel: keys/values stay grouped
            # (contiguous: the kernel saves them, and as views of the rotated and the QKV
            # buffers they would keep both whole buffers alive for the backward)
            query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
            group = (parallel_state.get_hierarchical_context_parallel_groups()
                     if self.cp_comm_type == "a2a+p2p"
                     else parallel_state.get_context_parallel_group())
            context = context_parallel_attention(query, key, value, mask, group,
                                                 self.cp_comm_type)
            context = context.permute(2, 0, 1, 3).reshape(s, b, self.num_heads * self.head_dim)
            return self.dense(context)
        if isinstance(mask, SliceTokens):  # one slice of a sequence: cached earlier keys/values
            context = mask.attend(self.layer_number, query, key, value, self.head_dim ** -0.5)
            context = context.permute(2, 0, 1, 3).reshape(s, b, self.num_heads * self.head_dim)
            return self.dense(context)
        if (self.recompute_core and self.training and torch.is_grad_enabled()
                and not self.core_attention.stores_no_scores(query, mask)):
            context = checkpoint(with_current_stream(self.core_attention), query, key, value,
                                 mask)
        else:
            context = self.core_attention(query, key, value, mask)
        context = context.permute(2, 0, 1, 3).reshape(s, b, self.num_heads * self.head_dim)
        return self.dense(context)


class ParallelMLP(nn.Module):
    """``dense_h_to_4h`` (column-parallel) -> GeLU (tanh approximation, or exact with ``--gelu
    erf``) -> ``dense_4h_to_h`` (row-parallel). With ``--swiglu`` ``dense_h_to_4h`` is the fused
    ``[gate; up]`` projection (2 x ffn outputs, partition stride 2: each tensor rank holds the
    matching halves of gate and up) and the activation ``silu(gate) * up``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, f, dtype = config.hidden_size, config.ffn_size, config.torch_dtype
        _tensor_parallel_size(f, "--ffn-hidden-size")
        sequence_parallel = uses_sequence_parallel(config)
        self.swiglu = config.swiglu
        gated = 2 if config.swiglu else 1
        self.dense_h_to_4h = ColumnParallelLinear(
            h, gated * f, bias=config.add_bias_linear, gather_output=False,
            sequence_parallel=sequence_parallel, stride=gated, dtype=dtype,
            async_allreduce=config.async_tensor_model_parallel_allreduce)
        self.dense_4h_to_h = RowParallelLinear(
            f, h, bias=config.add_bias_linear, input_is_parallel=True,
            skip_bias_add=not config.bias_dropout_fusion,
            sequence_parallel=sequence_parallel, dtype=dtype)
        self.fused_gelu = config.bias_gelu_fusion
        self.compile_elementwise = config.bias_dropout_fusion  # SwiGLU compiled on CUDA
        if config.gelu not in GELU_VARIANTS:
            raise ConfigError(f"--gelu must be one of {GELU_VARIANTS}, got {config.gelu!r}")
        self.exact_gelu = config.gelu == "erf"

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[s(/T), b, h] -> ([s(/T), b, h], bias)`` (bias as in
        :meth:`ParallelAttention.forward`)."""
        hidden, _ = self.dense_h_to_4h(hidden)
        if self.swiglu:
            intermediate = swiglu(hidden, fused=self.compile_elementwise and hidden.is_cuda)
        elif self.exact_gelu:
            intermediate = F.gelu(hidden)
        else:
            intermediate = gelu(hidden, fused=self.fused_gelu)
        return self.dense_4h_to_h(intermediate)


def init_mlp(mlp: ParallelMLP, config: ModelConfig, key: str, seed: int) -> None:
    """Initialise a dense MLP outside a layer's own draw sequence (an MoE layer's shared
    expert) from the init key ``key``."""
    generator = make_generator(seed, key)
    init_linear_(mlp.dense_h_to_4h, config.init_method_std, generator)
    init_linear_(mlp.dense_4h_to_h, scaled_init_std(config.init_method_std, config.num_layers),
                 generator)


def moe_layer(config: ModelConfig, layer_number: int, seed: int) -> MoELayer:
    """The MoE layer ``layer_number`` with its shared expert (a dense MLP of
    ``--moe-shared-expert-intermediate-size``, initialised from its own key) when asked."""
    shared = None
    size = config.moe.moe_shared_expert_intermediate_size
    if size:
        shared = ParallelMLP(dataclasses.replace(config, ffn_hidden_size=size))
        init_mlp(shared, config, f"{layer_key(layer_number - 1)}.shared_expert", seed)
    return MoELayer(config, layer_number, seed, shared)


class ParallelTransformerLayer(nn.Module):
    """One pre-LN transformer layer; ``layer_number`` is its 1-based global number."""

    def __init__(self, config: ModelConfig, layer_number: int, causal: bool,
                 backend: FusedBackend, seed: int) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.hidden_dropout = config.hidden_dropout
        self.bias_dropout_fusion = config.bias_dropout_fusion
        self.sequence_parallel = uses_sequence_parallel(config)
        self.input_layernorm = sequence_parallel_layer_norm(config, backend)
        self.self_attention = ParallelAttention(config, layer_number, causal)
        self.post_attention_layernorm = sequence_parallel_layer_norm(config, backend)
        self.is_moe = config.moe.moe_layers(config.num_layers)[layer_number - 1]
        self.mlp = moe_layer(config, layer_number, seed) if self.is_moe else ParallelMLP(config)
        self.site = layer_site(layer_number)  # its keyed-dropout site
        self.residual_sites = (f"{self.site}:attention-residual", f"{self.site}:mlp-residual")
        self._init_weights(config, seed)

    def _init_weights(self, config: ModelConfig, seed: int) -> None:
        generator = make_generator(seed, layer_key(self.layer_number - 1))
        std = config.init_method_std
        out_std = scaled_init_std(std, config.num_layers)
        init_linear_(self.self_attention.query_key_value, std, generator)
        init_linear_(self.self_attention.dense, out_std, generator)
        if not self.is_moe:  # (an MoE layer initialises its router and experts by their keys)
            init_linear_(self.mlp.dense_h_to_4h, std, generator)
            init_linear_(self.mlp.dense_4h_to_h, out_std, generator)

    def forward(self, hidden: torch.Tensor, mask: AttentionMask,
                rotary: RotaryTables | None = None) -> torch.Tensor:
        """``[s(/T), b, h] -> [s(/T), b, h]``: attention and MLP blocks, each with a residual."""
        attention_out, bias = self.self_attention(self.input_layernorm(hidden), mask, rotary)
        hidden = self._bias_dropout_add(attention_out, bias, hidden, self.residual_sites[0])
        tape = self.mlp.backward_tape() if self.is_moe else None
        if tape is not None:  # the backward's pieces: the MoE block after the attention's
            hidden = tape.split(hidden)
        mlp_out, bias = self.mlp(self.post_attention_layernorm(hidden))
        return self._bias_dropout_add(mlp_out, bias, hidden, self.residual_sites[1])

    def _bias_dropout_add(self, out: torch.Tensor, bias: torch.Tensor | None,
                          residual: torch.Tensor, site: str) -> torch.Tensor:
        """``residual + dropout(out + bias)``; on sequence-split data the mask is this tensor
        rank's (:func:`tensor_parallel_rng`)."""
        fused = self.bias_dropout_fusion and out.is_cuda
        if self.sequence_parallel and self.training and self.hidden_dropout > 0:
            with tensor_parallel_rng(True, site):
                return bias_dropout_add(out, bias, residual, self.hidden_dropout, True, fused)
        return bias_dropout_add(out, bias, residual, self.hidden_dropout, self.training, fused)


class ParallelTransformer(nn.Module):
    """The layers ``layer_range = (start, end)`` of the model, plus ``final_layernorm`` on the last
    stage; full activation recomputation (uniform / block) as Megatron."""

    def __init__(self, config: ModelConfig, layer_range: tuple[int, int], post_process: bool,
                 causal: bool, backend: FusedBackend, seed: int) -> None:
        super().__init__()
        validate_recompute(config)
        start, end = layer_range
        if not 0 <= start <= end <= config.num_layers:
            raise ConfigError(
                f"layer range {layer_range} outside the model's --num-layers {config.num_layers}")
        self.layer_range = (start, end)
        self.recompute_granularity = config.recompute_granularity
        self.recompute_method = config.recompute_method
        self.recompute_num_layers = config.recompute_num_layers
        self.layers = nn.ModuleList(
            ParallelTransformerLayer(config, start + i + 1, causal, backend, seed)
            for i in range(end - start))
        self.final_layernorm = (
            sequence_parallel_layer_norm(config, backend) if post_process else None)
        self.rotary = (RotaryEmbedding(config) if config.position_embedding_type == "rope"
                       else None)
        self.sequence_parallel = uses_sequence_parallel(config)
        self.causal = causal
        self.context_parallel = context_parallel_size() > 1
        if self.context_parallel and not causal:
            raise ConfigError("--context-parallel-size > 1 is for causal models (GPT, Llama): "
                              "BERT's bidirectional attention with a padding mask has no "
                              "context-parallel form here")
        if self.context_parallel and self.training_dropout(config):
            raise ConfigError("--context-parallel-size > 1 needs --hidden-dropout 0 and "
                              "--attention-dropout 0 (each context rank holds other tokens, so "
                              "dropout masks would differ from one process's)")

    @staticmethod
    def training_dropout(config: ModelConfig) -> bool:
        """Whether the model drops anything out in training."""
        return config.hidden_dropout > 0 or config.attention_dropout > 0

    def _run(self, first: int, last: int, stream: int | None, rotary: RotaryTables | None):
        # ``stream`` (the keyed-dropout micro-batch, captured at the forward) and the rotary
        # tables are part of the closure, so a recomputation in the backward reseeds and rotates
        # every layer exactly as the forward.
        def run_layers(hidden: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
            with in_stream(stream), contextlib.ExitStack() as paused:
                for layer in itertools.islice(self.layers, first, last):
                    if layer.is_moe:  # a checkpointed region is one backward piece
                        paused.enter_context(layer.mlp.paused_tape())
                return self._layers(first, last, hidden, mask, stream, rotary)
        return run_layers

    def _layers(self, first: int, last: int, hidden: torch.Tensor, mask: AttentionMask,
                stream: int | None, rotary: RotaryTables | None) -> torch.Tensor:
        # each layer reseeds its keyed dropout site first (``stream`` is the current one)
        # (islice: slicing a ModuleList would build a new one, indexing checks bounds)
        for layer in itertools.islice(self.layers, first, last):
            seed_site(stream, layer.site)
            hidden = layer(hidden, mask, rotary)
        return hidden

    def rotary_tables(self, hidden: torch.Tensor,
                      position_ids: torch.Tensor | None) -> RotaryTables | None:
        """The RoPE tables of this micro-batch (None without RoPE): positions ``0..s-1``, or
        ``position_ids`` ``[b, s]`` when given (``--reset-position-ids``)."""
        if self.rotary is None:
            return None
        seq = self._local_seq_length(hidden)
        return self.rotary.tables(seq, position_ids, hidden.device, hidden.dtype)

    def _local_seq_length(self, hidden: torch.Tensor) -> int:
        """Tokens of this rank's share of the sequence (all of its tensor ranks')."""
        return hidden.shape[0] * (parallel_state.get_tensor_model_parallel_world_size()
                                  if self.sequence_parallel else 1)

    def forward(self, hidden: torch.Tensor, mask: AttentionMask,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Run this stage's layers on ``[s(/T), b, h]``; ``position_ids`` ``[b, s]`` (or None:
        ``0..s-1``) place the rotary embedding."""
        n = len(self.layers)
        stream = current_stream()
        if self.context_parallel:  # this rank's zigzag tokens: their positions and masks
            mask = stage_tokens(mask, self._local_seq_length(hidden), self.causal,
                                hidden.device)
            if position_ids is None:
                position_ids = mask.positions[mask.rank][None].to(hidden.device)
        rotary = self.rotary_tables(hidden, position_ids)
        full = (self.recompute_granularity == "full" and self.training
                and torch.is_grad_enabled())
        if not full:  # (the stream is current already: no closure, no context on this path)
            hidden = self._layers(0, n, hidden, mask, stream, rotary)
        elif self.recompute_method == "uniform":
            for first in range(0, n, self.recompute_num_layers):
                last = min(first + self.recompute_num_layers, n)
                hidden = checkpoint(self._run(first, last, stream, rotary), hidden, mask)
        else:  # block: the first recompute_num_layers layers of this stage, one at a time
            for i in range(n):
                run = self._run(i, i + 1, stream, rotary)
                if i < self.recompute_num_layers:
                    hidden = checkpoint(run, hidden, mask)
                else:
                    hidden = run(hidden, mask)
        if self.final_layernorm is not None:
            hidden = self.final_layernorm(hidden)
        return hidden
