"""Named model configurations (the paper's BERT-48 and 64-layer GPT-2, GPT-2 small and medium) and
the ``--model`` flags the analysis tools share to pick one or describe a custom model."""

from __future__ import annotations

import argparse
import dataclasses

from megatron_chimera.config import ConfigError, ModelConfig
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
# name -> (family, configuration); "custom" takes its sizes from flags
MODEL_PRESETS: dict[str, tuple[ModelFamily, ModelConfig]] = {
    "gpt2-small": (GPT2, ModelConfig(num_layers=12, hidden_size=768, num_attention_heads=12,
                                     seq_length=1024, vocab_size=50257)),
    "gpt2-medium": (GPT2, ModelConfig(num_layers=24, hidden_size=1024, num_attention_heads=16,
                                      seq_length=1024, vocab_size=50257)),
    "bert-48": (BERT, PAPER_CONFIGS["bert-48"]),
    "gpt2-64": (GPT2, PAPER_CONFIGS["gpt2-64"]),
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
