"""Embeddings, pooler and the language model (embedding + encoder slice) shared by GPT-2 and BERT.

Module names follow Megatron (``language_model.embedding.word_embeddings``, ``.encoder``,
``.pooler``, ``.output_layer``) so parameter names match Megatron checkpoints with TP = 1.

With tensor parallelism the word embedding, the untied output layer and so the logits are split
over the vocabulary (:class:`~megatron_chimera.tensor_parallel.VocabParallelEmbedding`, padded to
Megatron's ``--make-vocab-size-divisible-by x T``), and the loss is
:func:`~megatron_chimera.tensor_parallel.vocab_parallel_cross_entropy`: the full logits never
exist on one rank. Position and token-type embeddings, the pooler and the heads' dense layers are
replicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from megatron_chimera import parallel_state
from megatron_chimera.config import ConfigError, ModelConfig
from megatron_chimera.model.dropout_rng import EMBEDDING_SITE, current_stream, seed_site
from megatron_chimera.model.fused import FusedBackend
from megatron_chimera.model.linear import Linear
from megatron_chimera.model.transformer import (
    AttentionMask,
    ParallelTransformer,
    tensor_parallel_rng,
    uses_sequence_parallel,
)
from megatron_chimera.model.utils import (
    OUTPUT_LAYER_KEY,
    POOLER_KEY,
    POSITION_EMBEDDINGS_KEY,
    TOKENTYPE_EMBEDDINGS_KEY,
    WORD_EMBEDDINGS_KEY,
    init_linear_,
    init_normal_,
    make_generator,
)
from megatron_chimera.tensor_parallel import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    vocab_parallel_cross_entropy,
)


def tensor_parallel_vocab_size(config: ModelConfig) -> int:
    """The vocabulary padded for this run's T ranks (Megatron's rule)."""
    return config.tensor_parallel_vocab_size(
        parallel_state.get_tensor_model_parallel_world_size())


def word_embeddings(config: ModelConfig, seed: int) -> VocabParallelEmbedding:
    """The padded-vocabulary word embedding (this rank's vocabulary range), initialised from its
    fixed key (so every copy of the tied embedding, on any stage and any T, starts
    bit-identical)."""
    embedding = VocabParallelEmbedding(tensor_parallel_vocab_size(config), config.hidden_size,
                                       master_size=config.padded_vocab_size,
                                       dtype=config.torch_dtype)
    init_normal_(embedding.weight, config.init_method_std,
                 make_generator(seed, WORD_EMBEDDINGS_KEY))
    return embedding


def parallel_lm_logits(hidden: torch.Tensor, weight: torch.Tensor, sequence_parallel: bool,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """``[s(/T), b, h]`` -> this rank's vocabulary-range logits ``[s, b, V/T]`` against the
    vocabulary-parallel ``weight`` (Megatron's ``parallel_lm_logits``): the input is all-gathered
    along the sequence under sequence parallelism, else its gradient all-reduced."""
    if sequence_parallel:
        hidden = gather_from_sequence_parallel_region(hidden)
    else:
        hidden = copy_to_tensor_model_parallel_region(hidden)
    return F.linear(hidden, weight, bias)


class Embedding(nn.Module):
    """Word + learned position (+ token type) embeddings and dropout; output ``[s, b, h]``. With
    ``--position-embedding-type rope`` or ``none`` there are no position embeddings (RoPE acts
    in the attention)."""

    def __init__(self, config: ModelConfig, num_tokentypes: int, seed: int) -> None:
        super().__init__()
        std, dtype = config.init_method_std, config.torch_dtype
        self.word_embeddings = word_embeddings(config, seed)
        self.position_embeddings = None
        if config.learned_positions:
            self.position_embeddings = skip_init(nn.Embedding, config.max_positions,
                                                 config.hidden_size, dtype=dtype)
            init_normal_(self.position_embeddings.weight, std,
                         make_generator(seed, POSITION_EMBEDDINGS_KEY))
        self.tokentype_embeddings = None
        if num_tokentypes > 0:
            self.tokentype_embeddings = skip_init(nn.Embedding, num_tokentypes,
                                                  config.hidden_size, dtype=dtype)
            init_normal_(self.tokentype_embeddings.weight, std,
                         make_generator(seed, TOKENTYPE_EMBEDDINGS_KEY))
        self.embedding_dropout = nn.Dropout(config.hidden_dropout)
        self.sequence_parallel = uses_sequence_parallel(config)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                tokentype_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``[b, s]`` token ids -> ``[s, b, h]`` embeddings (``[s/T, b, h]``, this rank's chunk
        of the sequence, under sequence parallelism)."""
        embeddings = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            if input_ids.shape[1] > self.position_embeddings.num_embeddings:
                raise ValueError(
                    f"sequence length {input_ids.shape[1]} exceeds --max-position-embeddings "
                    f"{self.position_embeddings.num_embeddings}")
            embeddings = embeddings + self.position_embeddings(position_ids)
        if self.tokentype_embeddings is not None:
            if tokentype_ids is None:
                raise ValueError("this model has token-type embeddings: pass tokentype_ids")
            embeddings = embeddings + self.tokentype_embeddings(tokentype_ids)
        elif tokentype_ids is not None:
            raise ValueError("tokentype_ids given but the model has no token-type embeddings")
        embeddings = embeddings.transpose(0, 1).contiguous()
        if self.sequence_parallel:
            embeddings = scatter_to_sequence_parallel_region(embeddings)
        with tensor_parallel_rng(self.sequence_parallel and self.training
                                 and self.embedding_dropout.p > 0, EMBEDDING_SITE):
            return self.embedding_dropout(embeddings)


class Pooler(nn.Module):
    """BERT pooler: ``tanh(dense(hidden[0]))``, the first token's hidden state (replicated over
    the tensor-parallel ranks; gathered along the sequence first under sequence parallelism)."""

    def __init__(self, config: ModelConfig, seed: int) -> None:
        super().__init__()
        h = config.hidden_size
        self.dense = skip_init(Linear, h, h, dtype=config.torch_dtype)
        init_linear_(self.dense, config.init_method_std, make_generator(seed, POOLER_KEY))
        self.sequence_parallel = uses_sequence_parallel(config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[s(/T), b, h] -> [b, h]``."""
        if self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden,
                                                          tensor_parallel_output_grad=False)
        return torch.tanh(self.dense(hidden[0]))


class TransformerLanguageModel(nn.Module):
    """Embedding (first stage), the encoder layers of ``layer_range``, pooler and untied output
    layer (last stage). Non-first stages take their input from :meth:`set_input_tensor`."""

    def __init__(self, config: ModelConfig, backend: FusedBackend, *, pre_process: bool,
                 post_process: bool, layer_range: tuple[int, int], causal: bool,
                 num_tokentypes: int, add_pooler: bool, add_output_layer: bool,
                 seed: int) -> None:
        super().__init__()
        self.pre_process = pre_process
        self.post_process = post_process
        self.input_tensor: torch.Tensor | None = None
        self.embedding = Embedding(config, num_tokentypes, seed) if pre_process else None
        self.encoder = ParallelTransformer(config, layer_range, post_process, causal, backend, seed)
        self.pooler = Pooler(config, seed) if post_process and add_pooler else None
        self.output_layer = None
        if post_process and add_output_layer:
            self.output_layer = ColumnParallelLinear(
                config.hidden_size, tensor_parallel_vocab_size(config), bias=False,
                gather_output=False, sequence_parallel=uses_sequence_parallel(config),
                dtype=config.torch_dtype,
                async_allreduce=config.async_tensor_model_parallel_allreduce)
            self.output_layer.weight.master_size = config.padded_vocab_size
            init_linear_(self.output_layer, config.init_method_std,
                         make_generator(seed, OUTPUT_LAYER_KEY))

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """Input ``[s, b, h]`` of a non-first stage (received from the previous stage)."""
        # a plain attribute, never a parameter or buffer: set without nn.Module's registration
        # checks (once per micro-batch, on the host's critical path)
        object.__setattr__(self, "input_tensor", tensor)

    def forward(self, input_ids: torch.Tensor | None, position_ids: torch.Tensor | None,
                mask: AttentionMask,
                tokentype_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states ``[s, b, h]`` after this stage's layers (and the final layer norm);
        ``position_ids`` also place the rotary embedding of every stage (None: ``0..s-1``)."""
        if self.pre_process:
            seed_site(current_stream(), EMBEDDING_SITE)
            hidden = self.embedding(input_ids, position_ids, tokentype_ids)
        else:
            if self.input_tensor is None:
                raise RuntimeError("non-first stage: call set_input_tensor() before forward()")
            hidden = self.input_tensor
        return self.encoder(hidden, mask, position_ids)


class MegatronModule(nn.Module):
    """Base of the full models: the tied word-embedding bookkeeping of a pipeline stage."""

    config: ModelConfig
    pre_process: bool
    post_process: bool
    tied: bool
    language_model: TransformerLanguageModel

    def _init_output_embedding_copy(self, config: ModelConfig, seed: int) -> None:
        """On a last stage that is not first, hold a copy of the tied word embedding (Megatron's
        ``word_embeddings``) for the output layer; equal to the first stage's at init."""
        self.word_embeddings = None
        if self.tied and self.post_process and not self.pre_process:
            self.word_embeddings = word_embeddings(config, seed)

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """Input ``[s, b, h]`` of a non-first stage."""
        self.language_model.set_input_tensor(tensor)

    def shared_embedding_or_output_weight(self) -> nn.Parameter | None:
        """The tied word-embedding parameter this slice holds, or None (untied / middle stage)."""
        if not self.tied:
            return None
        if self.pre_process:
            return self.language_model.embedding.word_embeddings.weight
        if self.post_process:
            return self.word_embeddings.weight
        return None

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[s(/T), b, h]`` -> logits ``[s, b, V/T]`` of this rank's range of the padded
        vocabulary, as the matmul leaves them (no transpose; padding masked in place)."""
        if self.tied:
            logits = parallel_lm_logits(hidden, self.shared_embedding_or_output_weight(),
                                        uses_sequence_parallel(self.config))
        else:
            logits, _ = self.language_model.output_layer(hidden)
        return mask_padded_vocab_(logits, self.config.vocab_size)

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[s(/T), b, h]`` -> logits ``[b, s, V/T]`` (batch first, for generation and
        evaluation; the training loss reads :meth:`lm_logits` without the transpose)."""
        return self.lm_logits(hidden).transpose(0, 1).contiguous()


def mask_padded_vocab_(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Set the logits of the vocabulary padding columns (ids >= ``vocab_size``) to -inf, in
    place (``logits`` is the output layer's fresh result: no copy), so ids no tokenizer produces
    never take probability mass, in the loss or in sampling; their gradients are zero.
    ``logits`` are this tensor-parallel rank's vocabulary range."""
    local = logits.shape[-1]
    first = parallel_state.get_tensor_model_parallel_rank() * local
    if first + local > vocab_size:
        logits[..., max(vocab_size - first, 0):].fill_(float("-inf"))
    return logits


def per_token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """fp32 cross-entropy ``[b, s]`` of logits ``[s, b, V]`` (as the output layer leaves them;
    padding columns -inf) against ``labels`` ``[b, s]``; with T > 1 the logits are this rank's
    vocabulary range and the loss is vocabulary-parallel. Only the ``[s, b]`` targets and losses
    are transposed, never the logits."""
    s, b, v = logits.shape
    if labels.shape != (b, s):
        raise ValueError(f"labels shape {tuple(labels.shape)} != logits' [b, s] {(b, s)}")
    target = labels.t()
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        return vocab_parallel_cross_entropy(logits, target).t()
    return F.cross_entropy(logits.float().view(s * b, v), target.reshape(s * b),
                           reduction="none").view(s, b).t()


def resolve_layer_range(config: ModelConfig,
                        layer_range: tuple[int, int] | None) -> tuple[int, int]:
    """``None`` -> all layers; otherwise checked against ``--num-layers``."""
    if layer_range is None:
        return (0, config.num_layers)
    start, end = layer_range
    if not 0 <= start <= end <= config.num_layers:
        raise ConfigError(
            f"layer range {layer_range} outside the model's --num-layers {config.num_layers}")
    return (int(start), int(end))
