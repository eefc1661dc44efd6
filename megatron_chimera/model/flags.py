"""The one writer from a model configuration to the training flags that build it (for the
autotuner's torchrun command, the checkpoint-mismatch hint and the converters' printed command),
so every place that prints a command spells the model the same way. It reads the flags declared on
:class:`~megatron_chimera.config.ModelConfig`'s fields: a field marked ``model`` is written when it
differs from its default."""

from __future__ import annotations

from megatron_chimera.config import ModelConfig, MoEConfig, flag_fields


def model_flags(model: ModelConfig, seq_length: int | None = None) -> list[str]:
    """Flags that build exactly ``model`` (the tokenizer gives the vocabulary): its shape, and
    every model setting that differs from its default; ``--seq-length`` when given (a run's
    choice, not the model's)."""
    flags = ["--num-layers", str(model.num_layers), "--hidden-size", str(model.hidden_size),
             "--num-attention-heads", str(model.num_attention_heads)]
    if seq_length is not None:
        flags += ["--seq-length", str(seq_length)]
    flags += ["--max-position-embeddings", str(model.max_positions)]
    return flags + _settings(model, decoder_only=False)


def architecture_flags(model: ModelConfig) -> list[str]:
    """The decoder-architecture flags of ``model`` that differ from Megatron's defaults
    (normalisation, SwiGLU, head sizes, query groups, biases, position embeddings)."""
    return _settings(model, decoder_only=True)


def _settings(model: ModelConfig, decoder_only: bool) -> list[str]:
    """The flags of the model settings (or only the decoder's) away from their defaults."""
    flags: list[str] = []
    for section, values in ((ModelConfig, model), (MoEConfig, model.moe)):
        for field, spec in flag_fields(section):
            if not spec.model or (decoder_only and not spec.decoder):
                continue
            value = getattr(values, field.name)
            if value != field.default:
                flags += [*spec.needs, *spec.spelled(value, field.default)]
    return flags
