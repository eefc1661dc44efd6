"""Model families (GPT-2, BERT): what the driver and the analytic models need to know of each.

The entry scripts pass one of these to ``training.pretrain``; partitioning, parameter, FLOP and
memory counts, the autotuner's command and the data path read their differences from it instead
of comparing model-type strings.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_chimera.config import ConfigError


@dataclass(frozen=True)
class ModelFamily:
    """The structural differences between GPT-2 and BERT that code outside the model needs."""

    name: str  # "gpt2" | "bert"
    entry_point: str  # the pretraining script
    causal: bool  # causal self-attention (GPT) or bidirectional with a padding mask (BERT)
    always_tied: bool  # the LM head always uses the word embedding (BERT)
    lm_head_transform: bool  # the LM head has its own dense + GeLU + layer norm (BERT)
    sentence_heads: bool  # token types, pooler and the binary head (BERT, unless disabled)
    every_stage_reads_batch: bool  # every stage needs its micro-batch (BERT's padding mask)

    @property
    def title(self) -> str:
        """``GPT-2`` or ``BERT`` for messages and tables."""
        return {"gpt2": "GPT-2", "bert": "BERT"}.get(self.name, self.name)


GPT2 = ModelFamily("gpt2", "pretrain_gpt2.py", causal=True, always_tied=False,
                   lm_head_transform=False, sentence_heads=False, every_stage_reads_batch=False)
BERT = ModelFamily("bert", "pretrain_bert.py", causal=False, always_tied=True,
                   lm_head_transform=True, sentence_heads=True, every_stage_reads_batch=True)
FAMILIES = {family.name: family for family in (GPT2, BERT)}


def get_family(name: str) -> ModelFamily:
    """The family called ``name`` (``gpt2`` or ``bert``); ConfigError naming ``--model`` else."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ConfigError(f"--model: unknown model family {name!r}; choose from "
                          f"{tuple(FAMILIES)}") from None
