"""A small GPT/BERT model configuration shared by the model tests (fast on CPU)."""

from __future__ import annotations

from megatron_chimera.config import ModelConfig

SEQ, VOCAB = 16, 100


def small_config(**overrides) -> ModelConfig:
    """Four layers, hidden 32, four heads, sequence :data:`SEQ`, vocabulary :data:`VOCAB`, no
    dropout; ``overrides`` replace any field."""
    fields = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=SEQ,
                  vocab_size=VOCAB, make_vocab_size_divisible_by=64, hidden_dropout=0.0,
                  attention_dropout=0.0)
    fields.update(overrides)
    return ModelConfig(**fields)
