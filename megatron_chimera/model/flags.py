"""The one writer from a model configuration to the training flags that build it (for the
autotuner's torchrun command, the checkpoint-mismatch hint and the converters' printed command),
so every place that prints a command spells the model the same way."""

from __future__ import annotations

from megatron_chimera.config import ModelConfig


def model_flags(model: ModelConfig, seq_length: int | None = None) -> list[str]:
    """Flags that build exactly ``model`` (the tokenizer gives the vocabulary): its shape, and
    every model setting that differs from its default; ``--seq-length`` when given (a run's
    choice, not the model's)."""
    flags = ["--num-layers", str(model.num_layers), "--hidden-size", str(model.hidden_size),
             "--num-attention-heads", str(model.num_attention_heads)]
    if seq_length is not None:
        flags += ["--seq-length", str(seq_length)]
    flags += ["--max-position-embeddings", str(model.max_positions)]
    if model.ffn_size != ModelConfig(hidden_size=model.hidden_size, swiglu=model.swiglu).ffn_size:
        flags += ["--ffn-hidden-size", str(model.ffn_size)]
    if model.make_vocab_size_divisible_by != ModelConfig.make_vocab_size_divisible_by:
        flags += ["--make-vocab-size-divisible-by", str(model.make_vocab_size_divisible_by)]
    if model.layernorm_epsilon != ModelConfig.layernorm_epsilon:
        flags += ["--layernorm-epsilon", repr(model.layernorm_epsilon)]
    if model.gelu != ModelConfig.gelu:
        flags += ["--gelu", model.gelu]
    flags += architecture_flags(model)
    for flag, field in (("--hidden-dropout", "hidden_dropout"),
                        ("--attention-dropout", "attention_dropout")):
        if getattr(model, field) != getattr(ModelConfig, field):
            flags += [flag, repr(getattr(model, field))]
    if model.untie_embeddings_and_output_weights:
        flags.append("--untie-embeddings-and-output-weights")
    if not model.bert_binary_head:
        flags.append("--bert-no-binary-head")
    if not model.masked_softmax_fusion:
        flags.append("--no-masked-softmax-fusion")
    return flags


def architecture_flags(model: ModelConfig) -> list[str]:
    """The decoder-architecture flags of ``model`` that differ from Megatron's defaults
    (normalisation, SwiGLU, head sizes, query groups, biases, position embeddings)."""
    default = ModelConfig()
    flags = []
    if model.normalization != default.normalization:
        flags += ["--normalization", model.normalization]
    if model.swiglu:
        flags.append("--swiglu")
    if model.kv_channels is not None:
        flags += ["--kv-channels", str(model.kv_channels)]
    if model.num_query_groups is not None:
        flags += ["--group-query-attention", "--num-query-groups", str(model.num_query_groups)]
    if not model.add_bias_linear:
        flags.append("--disable-bias-linear")
    if model.add_qkv_bias:
        flags.append("--add-qkv-bias")
    if model.position_embedding_type != default.position_embedding_type:
        flags += ["--position-embedding-type", model.position_embedding_type]
    for flag, field in (("--rotary-base", "rotary_base"), ("--rotary-percent", "rotary_percent"),
                        ("--rope-scaling-factor", "rope_scaling_factor")):
        if getattr(model, field) != getattr(default, field):
            flags += [flag, str(getattr(model, field))]
    if model.use_rope_scaling:
        flags.append("--use-rope-scaling")
    return flags
