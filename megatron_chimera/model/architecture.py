"""The architecture flags' rules (normalisation, SwiGLU, head sizes, grouped-query attention,
biases, position embeddings): one owner, called by the flags' validation before any process
group and by the model's constructor."""

from __future__ import annotations

from megatron_chimera.config import (
    NORMALIZATIONS,
    POSITION_EMBEDDING_TYPES,
    ConfigError,
    ModelConfig,
)


def check_architecture(config: ModelConfig) -> None:
    """Raise ConfigError naming the flag for a combination the model cannot build."""
    if config.normalization not in NORMALIZATIONS:
        raise ConfigError(f"--normalization must be one of {NORMALIZATIONS}, got "
                          f"{config.normalization!r}")
    if config.position_embedding_type not in POSITION_EMBEDDING_TYPES:
        raise ConfigError(f"--position-embedding-type must be one of {POSITION_EMBEDDING_TYPES}, "
                          f"got {config.position_embedding_type!r}")
    _check_heads(config)
    _check_rotary(config)
    if config.swiglu:
        for flag, unused in (("--gelu", config.gelu != ModelConfig.gelu),
                             ("--no-bias-gelu-fusion", not config.bias_gelu_fusion)):
            if unused:
                raise ConfigError(f"{flag} has no effect with --swiglu (the MLP has no GeLU)")


def _check_heads(config: ModelConfig) -> None:
    heads = config.num_attention_heads
    if config.kv_channels is None and config.hidden_size % heads:
        raise ConfigError(f"--hidden-size {config.hidden_size} is not divisible by "
                          f"--num-attention-heads {heads} (or give --kv-channels)")
    if config.kv_channels is not None and config.kv_channels < 1:
        raise ConfigError(f"--kv-channels must be positive, got {config.kv_channels}")
    groups = config.num_query_groups
    if groups is not None and (groups < 1 or heads % groups):
        raise ConfigError(f"--num-query-groups {groups} must divide --num-attention-heads "
                          f"{heads}")


def _check_rotary(config: ModelConfig) -> None:
    rope = config.position_embedding_type == "rope"
    defaults = ModelConfig()
    if not rope:
        for flag, field in (("--rotary-base", "rotary_base"),
                            ("--rotary-percent", "rotary_percent"),
                            ("--use-rope-scaling", "use_rope_scaling"),
                            ("--rope-scaling-factor", "rope_scaling_factor")):
            if getattr(config, field) != getattr(defaults, field):
                raise ConfigError(f"{flag} requires --position-embedding-type rope")
        return
    if not 0.0 < config.rotary_percent <= 1.0:
        raise ConfigError(f"--rotary-percent must be in (0, 1], got {config.rotary_percent}")
    rotated = int(config.head_dim * config.rotary_percent)
    if rotated < 2 or rotated % 2:
        raise ConfigError(f"--rotary-percent {config.rotary_percent} rotates {rotated} of the "
                          f"{config.head_dim} channels of a head: it must be an even number >= 2")
    if config.rotary_base <= 0:
        raise ConfigError(f"--rotary-base must be positive, got {config.rotary_base}")
    if config.use_rope_scaling and config.rope_scaling_factor <= 0:
        raise ConfigError(f"--rope-scaling-factor must be positive, got "
                          f"{config.rope_scaling_factor}")


def describe_model(family_name: str, config: ModelConfig) -> str:
    """A readable name of the model's kind for logs and tables: ``GPT-2``, ``BERT``,
    ``Llama-style`` (RMSNorm, SwiGLU, RoPE), with ``GQA`` and ``MoE (E experts, top-k)``."""
    if family_name == "bert":
        return "BERT"
    llama = (config.normalization == "RMSNorm" and config.swiglu
             and config.position_embedding_type == "rope")
    kind = "Llama-style" if llama else "GPT-2" if config.position_embedding_type != "rope" \
        else "GPT (RoPE)"
    extras = []
    groups = config.num_query_groups
    if groups is not None and groups < config.num_attention_heads:
        extras.append(f"GQA {groups} groups")
    if config.moe.enabled:
        extras.append(f"MoE {config.moe.num_experts} experts, top-{config.moe.moe_router_topk}")
    return kind + (f" ({'; '.join(extras)})" if extras else "")
