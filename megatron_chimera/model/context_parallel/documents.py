"""Per-document zigzag: the context-parallel split of a row of packed documents.

Each document is cut into ``2 x CP`` equal chunks and context rank ``i`` holds chunks ``i`` and
``2 x CP - 1 - i`` *of every document* (Megatron-LM PR #5243's THD case: for
``cu_seqlens = [0, 4, 8]`` at CP = 2, rank 0 holds ``[0, 3, 4, 7]``, rank 1 ``[1, 2, 5, 6]``), so
every rank has the same causal attention work in every document, not only over the whole row.

A document whose length is not a multiple of ``2 x CP`` is either

* **padded** (``pad=True``, a packed THD micro-batch whose length is free): padding slots follow
  the document, each is a document of its own (it attends only itself, nothing attends it) and
  carries no loss; or
* **balanced** (``pad=False``, a fixed ``[b, s]`` row with ``s`` divisible by ``2 x CP``): every
  document's last ``length mod 2 CP`` tokens are gathered, in order, into one more stretch that
  is zigzag-split the same way, so every rank holds exactly ``s / CP`` tokens and no padding.

Slots are numbered document by document, padding after its document (without padding a slot is
its token's index in the row), which keeps every document's tokens in their packed order; each
rank's slots are kept in ascending order. Attention follows each token's slot (causal order
within a document) and document id (:class:`~.tokens.ContextTokens`), RoPE its position in its
document, so every per-token tensor is split with :meth:`DocumentSplit.take`.

In training (``pretrain_gpt2.py``, :func:`~.stage.document_split`) a micro-batch of one packed
row (``--micro-batch-size 1`` with ``--reset-attention-mask``) is split per document, balanced;
with several rows each row is zigzag-split whole (:mod:`.zigzag`), its documents masked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_chimera.errors import ConfigError
from megatron_chimera.model.context_parallel.tokens import ContextTokens


@dataclass(frozen=True)
class DocumentSplit:
    """The per-document split of one row: ``slots`` ``[CP, n]`` (each rank's slots of the padded
    row, ascending), and per slot of the padded row ``source`` (the packed token behind it, -1
    for padding), ``document_ids`` (padding: a negative id of its own) and ``positions`` (the
    token's index in its document: RoPE's position)."""

    slots: torch.Tensor
    source: torch.Tensor
    document_ids: torch.Tensor
    positions: torch.Tensor

    @property
    def size(self) -> int:
        """CP."""
        return self.slots.shape[0]

    @property
    def padded_length(self) -> int:
        """Slots of the padded row (``CP x n``)."""
        return self.source.numel()

    def held(self, rank: int) -> torch.Tensor:
        """The packed tokens ``rank`` holds, slot by slot (-1: padding)."""
        return self.source[self.slots[rank]]

    def valid(self, rank: int) -> torch.Tensor:
        """Boolean ``[n]``: which of ``rank``'s slots hold a real token (not padding)."""
        return self.source[self.slots[rank]] >= 0

    def take(self, tensor: torch.Tensor, dim: int, rank: int, fill: float = 0) -> torch.Tensor:
        """``rank``'s share along ``dim`` of a packed per-token ``tensor`` (its length the packed
        row's): padding slots get ``fill``."""
        source = self.source[self.slots[rank]]  # on the host: no device sync to decide
        padded = bool((source < 0).any())
        picked = tensor.index_select(dim, source.clamp(min=0).to(tensor.device))
        if padded:
            shape = [1] * tensor.dim()
            shape[dim] = source.numel()
            picked = picked.masked_fill((source < 0).view(shape).to(tensor.device), fill)
        return picked

    def merge(self, shares: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
        """Inverse of :meth:`take`: the packed tensor from every rank's share (padding dropped)."""
        slots = torch.cat([self.slots[r] for r in range(self.size)])
        source = self.source[slots]
        keep = (source >= 0).nonzero().flatten()
        joined = torch.cat(list(shares), dim=dim).index_select(dim, keep.to(shares[0].device))
        order = torch.argsort(source[keep])
        return joined.index_select(dim, order.to(joined.device))

    def context_tokens(self, rank: int, causal: bool = True,
                       device: torch.device | str | None = None) -> ContextTokens:
        """``rank``'s :class:`ContextTokens`: every rank's slots as positions (global causal
        order) and their document ids (one row); no communication, every rank knows the split."""
        docs = self.document_ids[self.slots][:, None]
        return ContextTokens(self.slots, docs, rank, causal, device)


def _zigzag_rank(index: torch.Tensor, chunk: torch.Tensor, cp: int) -> torch.Tensor:
    """The rank holding position ``index`` of a stretch cut into ``2 x CP`` chunks of ``chunk``
    tokens: chunks ``i`` and ``2 CP - 1 - i`` go to rank ``i``."""
    k = torch.div(index, chunk.clamp(min=1), rounding_mode="floor")
    return torch.where(k < cp, k, 2 * cp - 1 - k)


def split_documents(lengths: Sequence[int], context_parallel_size: int,
                    pad: bool = True) -> DocumentSplit:
    """The per-document split of a row of documents of ``lengths`` over ``context_parallel_size``
    ranks, odd lengths padded (``pad``) or balanced through one leftover stretch (module doc)."""
    cp = context_parallel_size
    step = 2 * cp
    if cp < 1 or any(n < 1 for n in lengths):
        raise ValueError(f"document lengths {list(lengths)} at CP = {cp}: lengths and CP >= 1")
    total = sum(lengths)
    if not pad and total % step:
        raise ConfigError(f"a packed row of {total} tokens is not divisible by 2 x "
                          f"--context-parallel-size ({step})")
    length = torch.tensor(list(lengths), dtype=torch.int64)
    start = torch.cumsum(length, 0) - length
    if pad:
        size = (length + step - 1) // step * step  # slots of each document, padding included
    else:
        size = length
    first = torch.cumsum(size, 0) - size
    slot = torch.arange(int(size.sum()))
    doc = torch.repeat_interleave(torch.arange(len(length)), size)
    within = slot - first[doc]
    real = within < length[doc]
    whole = size if pad else length - length % step  # the zigzag-split part of each document
    in_whole = within < whole[doc]
    rank = _zigzag_rank(within, whole[doc] // step, cp)
    if not pad:  # the leftover tails: one more stretch, in order
        left = ~in_whole
        order = torch.cumsum(left.to(torch.int64), 0) - 1
        chunk = torch.tensor(int(left.sum()) // step)
        rank = torch.where(left, _zigzag_rank(order, chunk, cp), rank)
    source = torch.where(real, start[doc] + within, torch.full_like(slot, -1))
    documents = torch.where(real, doc, -(slot + 1))
    slots = torch.stack([(rank == r).nonzero().flatten() for r in range(cp)])
    return DocumentSplit(slots, source, documents, within)


def document_lengths(document_ids: torch.Tensor) -> list[int]:
    """Lengths of the consecutive runs of one row's document ids ``[s]`` (host)."""
    return torch.unique_consecutive(document_ids.cpu(), return_counts=True)[1].tolist()


def split_cu_seqlens(cu_seqlens: Sequence[int], context_parallel_size: int,
                     pad: bool = True) -> DocumentSplit:
    """:func:`split_documents` from THD's cumulative lengths ``[0, l0, l0 + l1, ...]``."""
    bounds = list(cu_seqlens)
    return split_documents([b - a for a, b in zip(bounds, bounds[1:])], context_parallel_size,
                           pad)
