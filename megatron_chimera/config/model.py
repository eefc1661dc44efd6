"""The model's configuration: shape, regularisation, initialisation, precision, kernels,
recomputation and today's decoder architecture (Megatron's flags, declared on their fields)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from megatron_chimera.config.flag import flag, positive, probability
from megatron_chimera.config.moe import MoEConfig
from megatron_chimera.layout import ParallelLayout, pad_vocab_size

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}  # bytes per element of each --params-dtype

# GeLU forms: "megatron" = tanh approximation in the MLP (Megatron's fused bias-GeLU) and exact erf
# GeLU in BERT's LM head (Megatron-LM's default); "tanh" = tanh approximation everywhere (Megatron's
# --openai-gelu, Hugging Face's gelu_new); "erf" = exact erf GeLU everywhere (Hugging Face's gelu).
GELU_VARIANTS = ("megatron", "tanh", "erf")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")  # --normalization (Megatron's spelling)
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")  # --position-embedding-type
RECOMPUTE_GRANULARITIES = ("full", "selective")  # --recompute-granularity (None: off)
RECOMPUTE_METHODS = ("uniform", "block")  # --recompute-method
# --document-attention: the per-document attention kernel with --reset-attention-mask
DOCUMENT_ATTENTIONS = ("auto", "varlen", "flex", "loop", "mask")
CP_COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")  # --cp-comm-type (model/context_parallel)

GPT = "gpt2"  # the family of the flags only GPT models read
BERT = "bert"


@dataclass(frozen=True)
class ModelConfig:
    """Transformer shape, regularisation, initialisation, precision and recomputation settings.

    The shape flags are required on the command line; their defaults here build a tiny model for
    library code and tests."""

    FLAG_GROUP: ClassVar[str] = "network size"

    num_layers: int = flag(2, "--num-layers", help="number of transformer layers",
                           required=True, check=positive)
    hidden_size: int = flag(64, "--hidden-size", help="transformer hidden size h",
                            required=True, check=positive)
    ffn_hidden_size: int | None = flag(
        None, "--ffn-hidden-size", type=int, check=positive, model=True,
        help="MLP hidden size (default 4h; with --swiglu 8h/3 rounded down to a multiple of 64)")
    num_attention_heads: int = flag(4, "--num-attention-heads", required=True, check=positive,
                                    help="attention heads (h must be divisible by them)")
    seq_length: int = flag(32, "--seq-length", help="tokens per sample", required=True,
                           check=positive)
    max_position_embeddings: int | None = flag(
        None, "--max-position-embeddings", type=int, check=positive,
        help="learned position embeddings (default --seq-length)")
    vocab_size: int = 128  # tokenizer vocabulary (unpadded; --vocab-size or the tokenizer's)
    make_vocab_size_divisible_by: int = flag(128, "--make-vocab-size-divisible-by",
                                             check=positive, model=True,
                                             help="pad the vocabulary to a multiple of this")
    hidden_dropout: float = flag(0.1, "--hidden-dropout", check=probability, model=True,
                                 help="dropout after the embedding and on each residual branch")
    attention_dropout: float = flag(0.1, "--attention-dropout", check=probability, model=True,
                                    help="dropout on the attention probabilities")
    init_method_std: float = flag(
        0.02, "--init-method-std",
        help="std of the normal weight initialisation (output layers scaled by 1/sqrt(2L))")
    layernorm_epsilon: float = flag(
        1e-5, "--layernorm-epsilon", model=True,
        help="epsilon of the layer norms (LayerNorm or RMSNorm; Megatron's older name of "
             "--norm-epsilon)")
    untie_embeddings_and_output_weights: bool = flag(
        False, "--untie-embeddings-and-output-weights", family=GPT, model=True,
        help="GPT: separate output layer instead of the tied word embedding")
    attention_softmax_in_fp32: bool = flag(
        False, "--attention-softmax-in-fp32",
        help="unfused attention: softmax in fp32 (the fused kernels already accumulate in fp32; "
             "warned once there)")
    apply_query_key_layer_scaling: bool = flag(
        False, "--apply-query-key-layer-scaling",
        help="unfused attention: scale scores by 1/layer and back in the fp32 softmax (a no-op "
             "on the fused path; warned once)")
    bert_binary_head: bool = flag(True, "--bert-no-binary-head", family=BERT, model=True,
                                  help="BERT: no sentence-order head (and no token types)")
    # fused attention (scaled_dot_product_attention) and GeLU kernels; False: unfused reference ops
    masked_softmax_fusion: bool = flag(
        True, "--no-masked-softmax-fusion", model=True,
        help="attention as matmul, masked softmax, dropout, matmul instead of "
             "scaled_dot_product_attention")
    bias_gelu_fusion: bool = flag(
        True, "--no-bias-gelu-fusion",
        help="GeLU as its tanh formula in separate ops instead of one kernel")
    bias_dropout_fusion: bool = flag(
        True, "--no-bias-dropout-fusion",
        help="output projections return their bias and residual + dropout(x + bias) runs as "
             "separate ops (bias gradient then computed in B, not W)")
    use_flash_attn: bool = flag(
        False, "--use-flash-attn",
        help="CUDA: restrict scaled_dot_product_attention to its flash / memory-efficient "
             "kernels and fail naming the reason when neither applies (CPU: warned once, no "
             "effect)")
    document_attention: str = flag(
        "auto", "--document-attention", choices=DOCUMENT_ATTENTIONS, family=GPT,
        help="GPT --reset-attention-mask kernel: varlen (flash, CUDA 16-bit, no attention "
             "dropout), flex (flex_attention, CUDA), loop (SDPA per document), mask "
             "(block-diagonal mask); auto picks")
    # Megatron-core's TransformerConfig.cp_comm_type: one type, or one per layer
    cp_comm_type: str | tuple[str, ...] = flag(
        "p2p", "--cp-comm-type", nargs="+", metavar="TYPE", family=GPT,
        help="how attention reaches across the --context-parallel-size ranks: p2p (ring "
             "attention, key/value blocks rotate), a2a (all-to-all between sequence and heads; "
             "CP divides the key/value heads per tensor rank), allgather (keys/values "
             "all-gathered), a2a+p2p (all-to-all inside groups of adjacent ranks, a ring across "
             "them: --hierarchical-context-parallel-sizes); one value for every layer, or one "
             "per layer (--num-layers values, layer 1 first)")
    gelu: str = flag("megatron", "--gelu", choices=GELU_VARIANTS, model=True,
                     help="megatron: tanh approximation in the MLP, exact in BERT's LM head; "
                          "tanh / erf: that form everywhere (Hugging Face's gelu_new / gelu)")
    recompute_granularity: str | None = flag(
        None, "--recompute-granularity", choices=RECOMPUTE_GRANULARITIES,
        help="activation recomputation: selective (the attention core; skipped where a CUDA "
             "flash kernel keeps no scores) or full")
    # today's decoders (Megatron's flags): normalisation, gated MLP, attention and positions
    normalization: str = flag("LayerNorm", "--normalization", choices=NORMALIZATIONS,
                              family=GPT, decoder=True,
                              help="the layer norms: LayerNorm or RMSNorm (weight only)")
    swiglu: bool = flag(
        False, "--swiglu", family=GPT, decoder=True,
        help="GPT: SwiGLU MLP, silu(x W_gate) * (x W_up) from one fused [gate; up] projection "
             "(each tensor rank holds matching halves)")
    kv_channels: int | None = flag(
        None, "--kv-channels", type=int, check=positive, family=GPT, decoder=True,
        help="channels per attention head (default hidden size / attention heads)")
    num_query_groups: int | None = flag(
        None, "--num-query-groups", type=int, check=positive, family=GPT, decoder=True,
        needs=("--group-query-attention",),
        help="GPT: key/value heads with --group-query-attention (default 1); must divide the "
             "attention heads, T must divide it")
    add_bias_linear: bool = flag(
        True, "--disable-bias-linear", family=GPT, decoder=True,
        help="GPT: no biases in the transformer's linear layers (QKV, dense, MLP)")
    add_qkv_bias: bool = flag(False, "--add-qkv-bias", family=GPT, decoder=True,
                              help="GPT: a QKV bias even with --disable-bias-linear (Qwen2)")
    position_embedding_type: str = flag(
        "learned_absolute", "--position-embedding-type", choices=POSITION_EMBEDDING_TYPES,
        family=GPT, decoder=True,
        help="GPT: learned_absolute (learned table), rope (rotary, in the attention; positions "
             "follow --reset-position-ids) or none")
    rotary_base: int = flag(10000, "--rotary-base", family=GPT, decoder=True,
                            help="RoPE: base of the rotation frequencies")
    rotary_percent: float = flag(1.0, "--rotary-percent", family=GPT, decoder=True,
                                 help="RoPE: fraction of each head's channels rotated")
    use_rope_scaling: bool = flag(
        False, "--use-rope-scaling", family=GPT, decoder=True,
        help="RoPE: Llama 3.1's frequency scaling (low/high frequency factors 1 and 4, original "
             "context 8192)")
    rope_scaling_factor: float = flag(8.0, "--rope-scaling-factor", family=GPT, decoder=True,
                                      help="RoPE: the factor of --use-rope-scaling")
    recompute_method: str | None = flag(
        None, "--recompute-method", choices=RECOMPUTE_METHODS,
        help="full recomputation: uniform (groups of layers) or block (first layers)")
    recompute_num_layers: int | None = flag(
        None, "--recompute-num-layers", type=int, check=positive,
        help="layers per group (uniform) or recomputed layers per stage (block)")
    # --sequence-parallel: LayerNorm / dropout regions split along the sequence over the
    # tensor-parallel ranks (a no-op with --tensor-model-parallel-size 1)
    sequence_parallel: bool = flag(
        False, "--sequence-parallel", group="distributed", after="--tensor-model-parallel-size",
        help="with T > 1: LayerNorm / dropout regions split along the sequence over the "
             "tensor-parallel ranks; pipeline messages are [s/T, b, h]")
    async_tensor_model_parallel_allreduce: bool = flag(
        True, "--no-async-tensor-model-parallel-allreduce", group="distributed",
        help="T > 1: sum a column-parallel layer's input gradient synchronously after its "
             "backward instead of asynchronously, overlapped with its weight gradient")
    # precision of the parameters and activations: "fp32", "fp16" or "bf16" (--fp16 / --bf16)
    params_dtype: str = "fp32"
    num_tokentypes: int = 0  # BERT's token types (2 with the binary head)
    # None: use NVIDIA Apex kernels when importable; False: torch-native kernels (--no-apex)
    use_apex: bool | None = None
    moe: MoEConfig = MoEConfig()  # mixture of experts (its own flag section; default: dense)

    @property
    def ffn_size(self) -> int:
        """Hidden size of the MLP (``--ffn-hidden-size``; default 4h, or with ``--swiglu``
        Megatron's 2/3 of it rounded down to a multiple of 64)."""
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        if self.swiglu:
            return int(4 * self.hidden_size * 2 / 3 / 64) * 64
        return 4 * self.hidden_size

    def layer_cp_comm_type(self, layer_number: int) -> str:
        """``--cp-comm-type`` of the 1-based global layer ``layer_number`` (Megatron: a list
        gives layer ``i`` its ``i-1``-th entry, one value serves every layer)."""
        if isinstance(self.cp_comm_type, str):
            return self.cp_comm_type
        if len(self.cp_comm_type) == 1:
            return self.cp_comm_type[0]
        return self.cp_comm_type[layer_number - 1]

    @property
    def head_dim(self) -> int:
        """Channels per attention head (``--kv-channels``, default hidden / heads)."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        """Key/value heads: ``--num-query-groups`` with grouped-query attention, else one per
        attention head."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def qkv_size(self) -> int:
        """Output features of the fused QKV projection: the query heads plus a key and a value
        head per query group."""
        return (self.num_attention_heads + 2 * self.query_groups) * self.head_dim

    @property
    def has_qkv_bias(self) -> bool:
        """Whether the QKV projection has a bias (``add_bias_linear`` or ``--add-qkv-bias``)."""
        return self.add_bias_linear or self.add_qkv_bias

    @property
    def learned_positions(self) -> bool:
        """Whether the model holds learned absolute position embeddings."""
        return self.position_embedding_type == "learned_absolute"

    @property
    def max_positions(self) -> int:
        """Number of learned position embeddings."""
        return self.max_position_embeddings or self.seq_length

    @property
    def padded_vocab_size(self) -> int:
        """Vocabulary rounded up to ``make_vocab_size_divisible_by``: the layout-independent
        padding checkpoints store (a tensor-parallel run pads further, see
        :meth:`tensor_parallel_vocab_size`)."""
        return pad_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by)

    def tensor_parallel_vocab_size(self, tensor_parallel: int) -> int:
        """Megatron's padded vocabulary with ``tensor_parallel`` ranks: a multiple of
        ``make_vocab_size_divisible_by x T`` (the rows beyond :attr:`padded_vocab_size` are zero
        and never used)."""
        return ParallelLayout(tensor=tensor_parallel).padded_vocab_size(
            self.vocab_size, self.make_vocab_size_divisible_by)

    @property
    def dtype_bytes(self) -> int:
        """Bytes of one parameter / activation element in the model's precision."""
        return DTYPE_BYTES[self.params_dtype]

    @property
    def torch_dtype(self) -> torch.dtype:
        """torch dtype of ``params_dtype``."""
        return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[
            self.params_dtype
        ]
