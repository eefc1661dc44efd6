"""Context parallelism inside a model stage and its forward step: which tokens this rank holds
(:func:`stage_tokens`, built once per micro-batch and stage), this rank's share of a micro-batch
(:func:`split_batch`) and the loss as the token mean over the whole sequence
(:func:`sequence_mean_loss`). Every function is the identity at CP = 1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_chimera import parallel_state
from megatron_chimera.errors import ConfigError
from megatron_chimera.model.context_parallel.documents import (
    DocumentSplit,
    document_lengths,
    split_documents,
)
from megatron_chimera.model.context_parallel.tokens import ContextTokens
from megatron_chimera.model.context_parallel.zigzag import split_sequence, zigzag_positions
from megatron_chimera.model.document_attention import DocumentMask
from megatron_chimera.model.loss_normalization import TokenMean, divisor_of


def context_parallel_size() -> int:
    """CP of the initialised groups (1 without groups)."""
    return parallel_state.get_context_parallel_world_size()


def stage_tokens(mask, local_seq_length: int, causal: bool,
                 device: torch.device | None = None) -> ContextTokens:
    """The :class:`ContextTokens` of a micro-batch on this rank (CP > 1): the zigzag positions of
    every context rank and, with a :class:`DocumentMask` (``--reset-attention-mask``), every
    rank's document ids (one all-gather); masks on ``device``. A dense mask has no
    context-parallel form."""
    if isinstance(mask, ContextTokens):
        return mask
    cp, rank = context_parallel_size(), parallel_state.get_context_parallel_rank()
    seq = local_seq_length * cp
    if mask is None:
        positions = torch.stack([zigzag_positions(seq, cp, r) for r in range(cp)])
        return ContextTokens(positions, None, rank, causal, device)
    if isinstance(mask, DocumentMask):
        return ContextTokens.gather(parallel_state.get_context_parallel_group(),
                                    zigzag_positions(seq, cp, rank), mask.document_ids, causal,
                                    device)
    raise ConfigError("--context-parallel-size > 1 takes causal attention, optionally within "
                      "documents (--reset-attention-mask); a dense attention mask (BERT's "
                      "padding mask) has no context-parallel form")


def document_split(document_ids: torch.Tensor | None) -> DocumentSplit | None:
    """The per-document zigzag of a micro-batch of one packed row (CP > 1, document ids ``[1,
    s]`` from --reset-attention-mask; see :mod:`.documents`), decided on the host; None
    otherwise (several rows: each row is split whole, its documents masked)."""
    cp = context_parallel_size()
    if cp == 1 or document_ids is None or document_ids.shape[0] != 1:
        return None
    return split_documents(document_lengths(document_ids[0]), cp, pad=False)


def document_tokens(split: DocumentSplit, causal: bool, device: torch.device | None = None
                    ) -> ContextTokens:
    """This context rank's :class:`ContextTokens` of a :func:`document_split` micro-batch (every
    rank's slots and document ids are known locally: no all-gather)."""
    return split.context_tokens(parallel_state.get_context_parallel_rank(), causal, device)


def split_batch(*tensors: torch.Tensor | None, split: DocumentSplit | None = None
                ) -> tuple[torch.Tensor | None, ...]:
    """This context rank's share of each ``[b, s]`` micro-batch tensor (None stays None):
    tokens, labels, loss mask, position and document ids follow their tokens. The zigzag of
    the whole row, or of each document with ``split`` (:func:`document_split`)."""
    cp = context_parallel_size()
    if cp == 1:
        return tensors
    rank = parallel_state.get_context_parallel_rank()
    if split is not None:
        return tuple(None if t is None else split.take(t, 1, rank) for t in tensors)
    return tuple(None if t is None else split_sequence(t, 1, cp, rank) for t in tensors)


def sequence_mean_loss(losses: torch.Tensor, loss_mask: torch.Tensor,
                       token_mean: TokenMean | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, reported)``: this rank's per-token ``losses`` summed under ``loss_mask`` and
    divided by the unmasked tokens of the *whole* sequence (all context ranks), or by the
    per-token divisor of ``token_mean``, so the gradients summed over the context ranks are
    those of the token mean; ``reported`` is the whole sequence's loss (detached, equal on
    every context rank)."""
    mask = loss_mask.reshape(-1).to(losses.dtype)
    local = torch.sum(losses.reshape(-1) * mask)
    if context_parallel_size() == 1:
        loss = local / divisor_of(mask.sum(), token_mean)
        return loss, loss.detach()
    totals = torch.stack([local.detach(), mask.sum()])
    dist.all_reduce(totals, group=parallel_state.get_context_parallel_group())
    divisor = divisor_of(totals[1], token_mean)
    return local / divisor, totals[0] / divisor
