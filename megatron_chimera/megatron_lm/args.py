"""Megatron-LM's saved ``args`` <-> our ModelConfig: what maps, what is refused by name.

A Megatron checkpoint records its whole command line as an ``argparse.Namespace`` (``args`` in
every legacy ``model_optim_rng.pt`` and in ``torch_dist``'s ``common.pt``). The model flags share
Megatron's names with ours, so most map one to one; a feature our GPT model does not have (MoE,
multi-latent attention, QK layer norm, multi-token prediction, ...) is refused naming the flag,
so a conversion never drops a part of the model silently.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from megatron_chimera.checkpoint.megatron_format import MegatronCheckpointError
from megatron_chimera.config import ModelConfig

# Megatron flag (attribute) -> the value our model needs, when set to anything else: refused
_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "num_experts": (None, "mixture of experts (--num-experts)"),
    "moe_shared_expert_intermediate_size": (None, "MoE shared experts"),
    "multi_latent_attention": (False, "multi-latent attention (--multi-latent-attention)"),
    "qk_layernorm": (False, "QK layer norm (--qk-layernorm)"),
    "mtp_num_layers": (None, "multi-token prediction (--mtp-num-layers)"),
    "apply_layernorm_1p": (False, "zero-centred layer norm (--apply-layernorm-1p)"),
    "squared_relu": (False, "squared ReLU (--squared-relu)"),
    "rotary_interleaved": (False, "interleaved RoPE (--rotary-interleaved)"),
    "use_legacy_models": (False, "Megatron's legacy model classes (--use-legacy-models)"),
    "virtual_pipeline_model_parallel_size": (None, "a virtual-pipeline checkpoint"),
    "num_layers_per_virtual_pipeline_stage": (None, "a virtual-pipeline checkpoint"),
    "window_size": (None, "sliding-window attention (--window-size)"),
    "heterogeneous_layers_config_path": (None, "heterogeneous layers"),
    "experimental_attention_variant": (None, "an experimental attention variant"),
    "use_mup": (False, "muP scaling"),
}
_ACTIVATIONS = ("swiglu", "openai_gelu", "squared_relu", "quick_geglu")


def args_dict(args: Any, source: str) -> dict[str, Any]:
    """The saved ``args`` (a Namespace or a dict) as a dict; MegatronCheckpointError if absent."""
    if isinstance(args, argparse.Namespace):
        return vars(args)
    if isinstance(args, dict):
        return dict(args)
    raise MegatronCheckpointError(f"{source}: holds no Megatron 'args' (found "
                                  f"{type(args).__name__}); cannot tell the model's shape")


def _get(args: dict[str, Any], name: str, source: str) -> Any:
    if name not in args:
        raise MegatronCheckpointError(f"{source}: the saved args lack {name!r}")
    return args[name]


def check_supported(args: dict[str, Any], source: str) -> None:
    """MegatronCheckpointError naming the first flag of a feature we do not have."""
    for name, (neutral, what) in _UNSUPPORTED.items():
        value = args.get(name, neutral)
        if value not in (neutral, None, False, 0):
            raise MegatronCheckpointError(f"{source}: {what} is not supported (args.{name} = "
                                          f"{value!r}); our GPT model has no such part")
    position = args.get("position_embedding_type", "learned_absolute")
    if position not in ("learned_absolute", "rope", "none"):
        raise MegatronCheckpointError(f"{source}: args.position_embedding_type = {position!r} "
                                      "is not supported (learned_absolute, rope or none)")
    if args.get("normalization", "LayerNorm") not in ("LayerNorm", "RMSNorm"):
        raise MegatronCheckpointError(f"{source}: args.normalization = "
                                      f"{args['normalization']!r} is not supported")


def _params_dtype(args: dict[str, Any]) -> str:
    if args.get("bf16"):
        return "bf16"
    if args.get("fp16"):
        return "fp16"
    dtype = args.get("params_dtype")
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


def _vocab_multiple(args: dict[str, Any], vocab_rows: int) -> int:
    """Megatron's effective padding multiple, ``--make-vocab-size-divisible-by`` x T, when it
    divides the stored rows: a tokenizer then pads to the stored rows again in training (our
    padding is layout-independent)."""
    base = int(args.get("make_vocab_size_divisible_by") or 1)
    for multiple in (base * int(args.get("tensor_model_parallel_size") or 1), base, 1):
        if vocab_rows % multiple == 0:
            return multiple
    return 1


def model_config_from_args(args: dict[str, Any], vocab_rows: int, source: str) -> ModelConfig:
    """Our ModelConfig of Megatron's saved ``args`` and the stored vocabulary rows.

    The vocabulary is the stored (padded) rows: Megatron computes its softmax over all of them, so
    keeping them as real ids gives identical logits (our padding mask would change them); the
    padding multiple is Megatron's effective one, so the tokenizer it was trained with pads to the
    same rows when training resumes.
    """
    check_supported(args, source)
    heads = int(_get(args, "num_attention_heads", source))
    hidden = int(_get(args, "hidden_size", source))
    groups = args.get("num_query_groups") if args.get("group_query_attention") else None
    kv_channels = args.get("kv_channels")
    divisible = _vocab_multiple(args, vocab_rows)
    swiglu = bool(args.get("swiglu", False))
    # Megatron's default activation is erf GeLU; --openai-gelu is our default, tanh GeLU
    gelu = "megatron" if args.get("openai_gelu") or swiglu else "erf"
    rope = args.get("position_embedding_type", "learned_absolute") == "rope"
    defaults = ModelConfig()
    seq = int(args.get("seq_length") or args.get("max_position_embeddings") or 0)
    positions = int(args.get("max_position_embeddings") or seq)
    epsilon = args.get("norm_epsilon", args.get("layernorm_epsilon", 1e-5))
    return ModelConfig(
        num_layers=int(_get(args, "num_layers", source)), hidden_size=hidden,
        num_attention_heads=heads, ffn_hidden_size=args.get("ffn_hidden_size"),
        seq_length=seq or positions, max_position_embeddings=positions, vocab_size=vocab_rows,
        make_vocab_size_divisible_by=divisible,
        hidden_dropout=float(args.get("hidden_dropout", 0.1)),
        attention_dropout=float(args.get("attention_dropout", 0.1)),
        init_method_std=float(args.get("init_method_std", 0.02)),
        layernorm_epsilon=float(epsilon),
        untie_embeddings_and_output_weights=bool(
            args.get("untie_embeddings_and_output_weights", False)),
        apply_query_key_layer_scaling=bool(args.get("apply_query_key_layer_scaling", False)),
        attention_softmax_in_fp32=bool(args.get("attention_softmax_in_fp32", False)),
        params_dtype=_params_dtype(args), gelu=gelu,
        normalization=args.get("normalization", "LayerNorm"), swiglu=swiglu,
        kv_channels=(int(kv_channels) if kv_channels and int(kv_channels) * heads != hidden
                     else None),
        num_query_groups=int(groups) if groups and int(groups) != heads else None,
        add_bias_linear=bool(args.get("add_bias_linear", True)),
        add_qkv_bias=bool(args.get("add_qkv_bias", False)),
        position_embedding_type=args.get("position_embedding_type", "learned_absolute"),
        rotary_base=int(args.get("rotary_base", 10000)) if rope else defaults.rotary_base,
        rotary_percent=(float(args.get("rotary_percent", 1.0)) if rope
                        else defaults.rotary_percent),
        use_rope_scaling=bool(args.get("use_rope_scaling", False)) and rope,
        rope_scaling_factor=(float(args.get("rope_scaling_factor", 8.0)) if rope
                             else defaults.rope_scaling_factor))


def args_from_model_config(config: ModelConfig, iteration: int) -> argparse.Namespace:
    """The Megatron ``args`` an exported checkpoint records (the model flags Megatron-LM's
    ``--use-checkpoint-args`` reads, under Megatron's names)."""
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[
        config.params_dtype]
    return argparse.Namespace(
        num_layers=config.num_layers, hidden_size=config.hidden_size,
        ffn_hidden_size=config.ffn_size, num_attention_heads=config.num_attention_heads,
        kv_channels=config.head_dim, group_query_attention=config.num_query_groups is not None,
        num_query_groups=config.query_groups, seq_length=config.seq_length,
        max_position_embeddings=config.max_positions,
        position_embedding_type=config.position_embedding_type,
        rotary_percent=config.rotary_percent, rotary_base=config.rotary_base,
        rotary_interleaved=False, use_rope_scaling=config.use_rope_scaling,
        rope_scaling_factor=config.rope_scaling_factor, normalization=config.normalization,
        norm_epsilon=config.layernorm_epsilon, apply_layernorm_1p=False, swiglu=config.swiglu,
        openai_gelu=config.gelu != "erf", squared_relu=False,
        add_bias_linear=config.add_bias_linear, add_qkv_bias=config.add_qkv_bias,
        untie_embeddings_and_output_weights=config.untie_embeddings_and_output_weights,
        padded_vocab_size=config.padded_vocab_size,
        make_vocab_size_divisible_by=config.make_vocab_size_divisible_by,
        hidden_dropout=config.hidden_dropout, attention_dropout=config.attention_dropout,
        init_method_std=config.init_method_std,
        apply_query_key_layer_scaling=config.apply_query_key_layer_scaling,
        attention_softmax_in_fp32=config.attention_softmax_in_fp32,
        fp16=config.params_dtype == "fp16", bf16=config.params_dtype == "bf16",
        params_dtype=dtype, num_experts=None, qk_layernorm=False,
        multi_latent_attention=False, transformer_impl="local", use_legacy_models=False,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        ckpt_format="torch_dist", iteration=iteration)
