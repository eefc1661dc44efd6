"""Named model configurations (the paper's BERT-48 and 64-layer GPT-2, GPT-2 small and medium,
Llama 3, and the MoE shapes Mixtral-8x7B and a DeepSeek-V3-like one) and
the ``--model`` flags the analysis tools share to pick one or describe a custom model."""

from __future__ import annotations

import argparse
import dataclasses

from megatron_chimera.config import ConfigError, ModelConfig, MoEConfig
from megatron_chimera.model.family import BERT, FAMILIES, GPT2, ModelFamily, get_family
from megatron_chimera.model.partition import count_parameters

# The paper's models (Li & Hoefler, SC'21): BERT-48 and the 64-layer GPT-2 (~1.39 B untied).
PAPER_CONFIGS: dict[str, ModelConfig] = {
    "bert-48": ModelConfig(num_layers=48, hidden_size=1024, num_attention_heads=16,
                           seq_length=128, max_position_embeddings=512, vocab_size=30522,
                           num_tokentypes=2),
    "gpt2-64": ModelConfig(num_layers=64, hidden_size=1280, num_attention_heads=20,
                           seq_length=632, vocab_size=50257,
                           untie_embeddings_and_output_weights=True),
}
# Llama-3.1-shaped decoders (Megatron's flags: RMSNorm, SwiGLU, 8 query groups, no biases, RoPE
# base 500000 with Llama 3.1's scaling, untied head, vocabulary 128256)
_LLAMA3 = dict(seq_length=8192, vocab_size=128256, normalization="RMSNorm", swiglu=True,
               num_query_groups=8, add_bias_linear=False, position_embedding_type="rope",
               rotary_base=500000, use_rope_scaling=True, untie_embeddings_and_output_weights=True,
               hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02)
LLAMA3_8B = ModelConfig(num_layers=32, hidden_size=4096, num_attention_heads=32,
                        ffn_hidden_size=14336, **_LLAMA3)
LLAMA3_70B = ModelConfig(num_layers=80, hidden_size=8192, num_attention_heads=64,
                         ffn_hidden_size=28672, **_LLAMA3)
# Mixtral-8x7B (Mistral AI's config.json): Llama-shaped, every layer 8 SwiGLU experts of 14336,
# top-2 softmax routing, RoPE base 1e6, vocabulary 32000
MIXTRAL_8X7B = ModelConfig(
    num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=14336,
    seq_length=4096, max_position_embeddings=32768, vocab_size=32000, normalization="RMSNorm",
    swiglu=True, num_query_groups=8, add_bias_linear=False, position_embedding_type="rope",
    rotary_base=1000000, untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
    attention_dropout=0.0, init_method_std=0.02,
    moe=MoEConfig(num_experts=8, moe_router_topk=2, moe_aux_loss_coeff=0.02,
                  moe_token_dispatcher_type="alltoall"))
# DeepSeek-V3's shape as far as our layers express it: 61 layers (the first 3 dense, FFN 18432),
# 256 routed experts of 2048 (top-8, sigmoid scores) plus one shared expert of 2048, vocabulary
# 129280. Not DeepSeek-V3 itself: multi-latent attention becomes plain 128-head attention of head
# dimension 128, and the aux-loss-free expert bias, group-limited routing and multi-token
# prediction are left out (so the attention parameters and activations are larger than MLA's).
DEEPSEEK_V3_LIKE = ModelConfig(
    num_layers=61, hidden_size=7168, num_attention_heads=128, kv_channels=128,
    ffn_hidden_size=18432, seq_length=4096, max_position_embeddings=4096, vocab_size=129280,
    normalization="RMSNorm", swiglu=True, add_bias_linear=False, position_embedding_type="rope",
    rotary_base=10000, untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
    attention_dropout=0.0, init_method_std=0.006,
    moe=MoEConfig(num_experts=256, moe_ffn_hidden_size=2048, moe_router_topk=8,
                  moe_router_score_function="sigmoid",
                  moe_router_load_balancing_type="seq_aux_loss",
                  moe_aux_loss_coeff=0.0001, moe_shared_expert_intermediate_size=2048,
                  moe_layer_freq="[0]*3+[1]*58", moe_token_dispatcher_type="alltoall",
                  moe_grouped_gemm=True))
# name -> (family, configuration); "custom" takes its sizes from flags
MODEL_PRESETS: dict[str, tuple[ModelFamily, ModelConfig]] = {
    "gpt2-small": (GPT2, ModelConfig(num_layers=12, hidden_size=768, num_attention_heads=12,
                                     seq_length=1024, vocab_size=50257)),
    "gpt2-medium": (GPT2, ModelConfig(num_layers=24, hidden_size=1024, num_attention_heads=16,
                                      seq_length=1024, vocab_size=50257)),
    "bert-48": (BERT, PAPER_CONFIGS["bert-48"]),
    "gpt2-64": (GPT2, PAPER_CONFIGS["gpt2-64"]),
    "llama3-8b": (GPT2, LLAMA3_8B),
    "llama3-70b": (GPT2, LLAMA3_70B),
    "mixtral-8x7b": (GPT2, MIXTRAL_8X7B),
    "deepseek-v3-like": (GPT2, DEEPSEEK_V3_LIKE),
}
MODEL_NAMES = (*MODEL_PRESETS, "custom")
SIZE_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size")
DTYPES = ("fp32", "fp16", "bf16")


def add_model_arguments(parser: argparse._ActionsContainer, default: str) -> None:
    """--model (a preset or ``custom``), --model-type and the sizes of a custom model."""
    parser.add_argument("--model", choices=MODEL_NAMES, default=default)
    parser.add_argument("--model-type", choices=tuple(FAMILIES), default=None,
                        help="with --model custom (default gpt2)")
    for flag in SIZE_FLAGS:
        parser.add_argument(f"--{flag.replace('_', '-')}", type=int, default=None,
                            help="with --model custom")


def make_model(name: str, model_type: str | None = None, params_dtype: str = "fp32",
               **sizes: int | None) -> tuple[ModelFamily, ModelConfig]:
    """``(family, ModelConfig)`` of a preset, or of ``custom`` sizes (ConfigError names a flag)."""
    if name not in MODEL_NAMES:
        raise ConfigError(f"--model: unknown model {name!r}; choose from {MODEL_NAMES}")
    given = {k: v for k, v in sizes.items() if v is not None}
    if name != "custom":
        if given or model_type is not None:
            raise ConfigError(f"--{next(iter(given), 'model_type').replace('_', '-')} applies "
                              f"only to --model custom (the preset {name} fixes the sizes)")
        family, config = MODEL_PRESETS[name]
        return family, dataclasses.replace(config, params_dtype=params_dtype)
    for flag in SIZE_FLAGS[:4]:
        if flag not in given:
            raise ConfigError(f"--model custom needs --{flag.replace('_', '-')}")
    for flag, value in given.items():
        if value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be positive, got {value}")
    if given["hidden_size"] % given["num_attention_heads"]:
        raise ConfigError(f"--hidden-size {given['hidden_size']} is not divisible by "
                          f"--num-attention-heads {given['num_attention_heads']}")
    family = get_family(model_type or "gpt2")
    extra = {"num_tokentypes": 2} if family.sentence_heads else {}
    return family, ModelConfig(params_dtype=params_dtype, **given, **extra)


def describe_model(name: str, family: ModelFamily, config: ModelConfig) -> str:
    """One line: name, family, sizes, precision and parameter count."""
    params = count_parameters(config, family)
    return (f"{name} ({family.title}: {config.num_layers} layers, hidden {config.hidden_size}, "
            f"{config.num_attention_heads} heads, seq {config.seq_length}, vocab "
            f"{config.padded_vocab_size}, {config.params_dtype}), {params / 1e6:.1f} M parameters")
