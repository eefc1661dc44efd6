"""GPT-2: learned positions, causal self-attention, LM head tied to the word embedding by default.

Built whole or as the slice one pipeline stage holds (``pre_process`` / ``post_process`` /
``layer_range``), as Megatron's ``model_provider``.
"""

from __future__ import annotations

import torch

from megatron_chimera.config import ModelConfig
from megatron_chimera.model.document_attention import DocumentMask
from megatron_chimera.model.fused import get_fused_backend
from megatron_chimera.model.language_model import (
    MegatronModule,
    TransformerLanguageModel,
    per_token_cross_entropy,
    resolve_layer_range,
)


class GPTModel(MegatronModule):
    """GPT-2 (or one stage of it): hidden ``[s, b, h]`` out of a non-last stage, per-token loss
    ``[b, s]`` (labels given) or logits ``[b, s, V]`` out of the last."""

    def __init__(self, config: ModelConfig, pre_process: bool = True, post_process: bool = True,
                 layer_range: tuple[int, int] | None = None, seed: int = 1234) -> None:
        super().__init__()
        self.config = config
        self.pre_process = pre_process
        self.post_process = post_process
        self.tied = not config.untie_embeddings_and_output_weights
        self.language_model = TransformerLanguageModel(
            config, get_fused_backend(config.use_apex), pre_process=pre_process,
            post_process=post_process, layer_range=resolve_layer_range(config, layer_range),
            causal=True, num_tokentypes=0, add_pooler=False, add_output_layer=not self.tied,
            seed=seed)
        self._init_output_embedding_copy(config, seed)

    def forward(self, input_ids: torch.Tensor | None, position_ids: torch.Tensor | None,
                attention_mask: torch.Tensor | DocumentMask | None = None,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        """``attention_mask``: None (plain causal attention, no mask built), a
        :class:`DocumentMask` (``--reset-attention-mask``: causal within each document; every
        stage needs it), or a bool tensor (True = forbidden, broadcastable to ``[b, heads, s, s]``)
        combined with the causal mask."""
        hidden = self.language_model(input_ids, position_ids, attention_mask)
        if not self.post_process:
            return hidden
        if labels is None:
            return self.output_logits(hidden)
        return per_token_cross_entropy(self.lm_logits(hidden), labels)


def build_gpt_stage(config: ModelConfig, partition: list[tuple[int, int]], stage: int,
                    seed: int = 1234) -> GPTModel:
    """The slice of GPT-2 that pipeline stage ``stage`` of ``partition`` (from
    :func:`megatron_chimera.model.partition.partition_layers`) holds."""
    if not 0 <= stage < len(partition):
        raise ValueError(f"stage {stage} outside a partition of {len(partition)} stages")
    return GPTModel(config, pre_process=stage == 0, post_process=stage == len(partition) - 1,
                    layer_range=partition[stage], seed=seed)
