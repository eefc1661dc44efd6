"""BERT: token types, padding mask, MLM head tied to the word embedding, pooler and the binary
(sentence-order / next-sentence) head. Built whole or as one pipeline stage's slice."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from megatron_chimera import parallel_state
from megatron_chimera.config import ConfigError, ModelConfig
from megatron_chimera.model.fused import FusedBackend, gelu, get_fused_backend
from megatron_chimera.model.language_model import (
    MegatronModule,
    TransformerLanguageModel,
    mask_padded_vocab_,
    parallel_lm_logits,
    per_token_cross_entropy,
    resolve_layer_range,
    tensor_parallel_vocab_size,
)
from megatron_chimera.model.linear import Linear
from megatron_chimera.model.transformer import sequence_parallel_layer_norm, uses_sequence_parallel
from megatron_chimera.model.utils import (
    BINARY_HEAD_KEY,
    LM_HEAD_KEY,
    init_linear_,
    make_generator,
)
from megatron_chimera.tensor_parallel.utils import (
    mark_sequence_parallel,
    set_tensor_model_parallel_attributes,
)


def bert_num_tokentypes(config: ModelConfig) -> int:
    """``--num-tokentypes`` when set, else 2 with the binary head and 0 without (Megatron)."""
    return config.num_tokentypes or (2 if config.bert_binary_head else 0)


def padding_to_attention_mask(padding_mask: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` padding mask (1 = token, 0 = pad) -> bool ``[b, 1, 1, s]``, True = forbidden
    (padded keys are masked; the outputs at padded positions are never used)."""
    return (padding_mask < 0.5)[:, None, None, :]


class BertLMHead(nn.Module):
    """MLM head: dense -> GeLU (exact; tanh with ``--gelu tanh``) -> ``layernorm`` -> logits
    against the tied embedding + ``bias`` (padded-vocabulary columns masked). With tensor
    parallelism ``bias`` and the logits are this rank's vocabulary range; under sequence
    parallelism dense and layernorm see this rank's chunk of the sequence (partial gradients)."""

    def __init__(self, config: ModelConfig, backend: FusedBackend, seed: int) -> None:
        super().__init__()
        h, dtype = config.hidden_size, config.torch_dtype
        self.sequence_parallel = uses_sequence_parallel(config)
        self.dense = skip_init(Linear, h, h, dtype=dtype)
        init_linear_(self.dense, config.init_method_std, make_generator(seed, LM_HEAD_KEY))
        mark_sequence_parallel(self.dense, self.sequence_parallel)
        self.layernorm = sequence_parallel_layer_norm(config, backend)
        local_vocab = tensor_parallel_vocab_size(config) // (
            parallel_state.get_tensor_model_parallel_world_size())
        self.bias = nn.Parameter(torch.zeros(local_vocab, dtype=dtype))
        set_tensor_model_parallel_attributes(self.bias, True, 0, 1,
                                             master_size=config.padded_vocab_size)
        self.tanh_gelu = config.gelu == "tanh"
        self.vocab_size = config.vocab_size

    def forward(self, hidden: torch.Tensor, word_embeddings_weight: torch.Tensor,
                batch_first: bool = True) -> torch.Tensor:
        """``[s(/T), b, h]`` -> logits ``[b, s, V/T]`` (``[s, b, V/T]``, the matmul's layout,
        without ``batch_first``: what the training loss reads)."""
        hidden = self.dense(hidden)
        hidden = self.layernorm(gelu(hidden) if self.tanh_gelu else F.gelu(hidden))
        logits = parallel_lm_logits(hidden, word_embeddings_weight, self.sequence_parallel,
                                    self.bias)
        logits = mask_padded_vocab_(logits, self.vocab_size)
        return logits.transpose(0, 1).contiguous() if batch_first else logits


class BertModel(MegatronModule):
    """BERT (or one stage of it). Last stage: ``(lm_loss [b, s], sop_logits [b, 2])`` with labels,
    ``(lm_logits [b, s, V], sop_logits)`` without; ``sop_logits`` is None without binary head."""

    def __init__(self, config: ModelConfig, pre_process: bool = True, post_process: bool = True,
                 layer_range: tuple[int, int] | None = None, seed: int = 1234) -> None:
        super().__init__()
        if config.untie_embeddings_and_output_weights:
            raise ConfigError("--untie-embeddings-and-output-weights is not supported for BERT "
                              "(its MLM decoder is tied to the word embedding, as in Megatron)")
        backend = get_fused_backend(config.use_apex)
        self.config = config
        self.pre_process = pre_process
        self.post_process = post_process
        self.tied = True
        self.num_tokentypes = bert_num_tokentypes(config)
        self.language_model = TransformerLanguageModel(
            config, backend, pre_process=pre_process, post_process=post_process,
            layer_range=resolve_layer_range(config, layer_range), causal=False,
            num_tokentypes=self.num_tokentypes, add_pooler=config.bert_binary_head,
            add_output_layer=False, seed=seed)
        self.lm_head = self.binary_head = None
        if post_process:
            self.lm_head = BertLMHead(config, backend, seed)
            if config.bert_binary_head:
                self.binary_head = skip_init(Linear, config.hidden_size, 2,
                                             dtype=config.torch_dtype)
                init_linear_(self.binary_head, config.init_method_std,
                             make_generator(seed, BINARY_HEAD_KEY))
        self._init_output_embedding_copy(config, seed)

    def forward(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor,
                tokentype_ids: torch.Tensor | None = None, lm_labels: torch.Tensor | None = None):
        """``attention_mask`` is the ``[b, s]`` padding mask (1 = token, 0 = pad)."""
        mask = padding_to_attention_mask(attention_mask)
        position_ids = None
        if self.pre_process:
            seq = input_ids.shape[1]
            position_ids = torch.arange(seq, device=input_ids.device).expand_as(input_ids)
        hidden = self.language_model(input_ids, position_ids, mask,
                                     tokentype_ids if self.num_tokentypes else None)
        if not self.post_process:
            return hidden
        sop_logits = None
        if self.binary_head is not None:
            sop_logits = self.binary_head(self.language_model.pooler(hidden))
        weight = self.shared_embedding_or_output_weight()
        if lm_labels is None:
            return self.lm_head(hidden, weight), sop_logits
        return (per_token_cross_entropy(self.lm_head(hidden, weight, batch_first=False),
                                        lm_labels), sop_logits)


def build_bert_stage(config: ModelConfig, partition: list[tuple[int, int]], stage: int,
                     seed: int = 1234) -> BertModel:
    """The slice of BERT that pipeline stage ``stage`` of ``partition`` holds."""
    if not 0 <= stage < len(partition):
        raise ValueError(f"stage {stage} outside a partition of {len(partition)} stages")
    return BertModel(config, pre_process=stage == 0, post_process=stage == len(partition) - 1,
                     layer_range=partition[stage], seed=seed)
