"""Attention over the slices of one sequence that a pipeline stage runs one after another
(sequence-sliced pipelines, ``schedules/slices.py``): the stage keeps the keys and values of a
sequence's earlier slices, and each later slice attends to them plus its own.

A slice's keys and values are cached as detached leaves (:class:`SequenceCache`); the later
slices' backwards accumulate the leaves' ``.grad``. The slice's own keys and values pass through
an identity (:class:`_AddCachedGrad`) whose backward adds that accumulated gradient to what its
own attention returns. This is exact when the backward of slice ``j`` runs after the backwards
of every later slice of the sequence on that stage -- the slice-order rule the schedules keep.
With full recomputation the slice's forward runs twice: the first pass (no autograd graph)
caches the leaves, the replay in the slice's backward reuses them, their ``.grad`` included.

A slice attends to each earlier slice's cached keys/values and to its own as separate blocks
(:func:`~.context_parallel.block_attention.block_attention`): each block through the fused
attention kernel that returns its log-sum-exp (earlier slices unmasked, the own block with the
kernel's causal flag), merged by log-sum-exp -- no concatenation of the earlier keys (the saved
tensors are the cached leaves themselves) and no repeated grouped-query heads.
"""

from __future__ import annotations

import torch

from megatron_chimera.model.context_parallel.block_attention import BlockMask, block_attention
from megatron_chimera.model.loss_normalization import TokenMean, divisor_of


class _AddCachedGrad(torch.autograd.Function):
    """Identity whose backward adds the gradient the later slices left on ``leaf``."""

    @staticmethod
    def forward(ctx, tensor, leaf):
        ctx.leaf = leaf
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        extra = ctx.leaf.grad
        return (grad if extra is None else grad + extra), None


class SequenceCache:
    """Everything a stage keeps of one sequence's earlier slices: their token positions and
    document ids, and per layer the keys and values (leaves) they produced."""

    def __init__(self) -> None:
        self.positions: list[torch.Tensor] = []
        self.documents: list[torch.Tensor | None] = []
        self.keys_values: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}


class SequenceSlice:
    """What a sliced micro-batch carries besides its tokens: its sequence's ``cache`` (one object
    shared by the sequence's slices on a rank), the slice's tokens ``start`` to ``end`` in the
    sequence, the number of ``slices`` and the sequence's unmasked ``tokens`` (the loss's
    divisor)."""

    def __init__(self, cache: SequenceCache, start: int, end: int, slices: int,
                 tokens: torch.Tensor) -> None:
        self.cache, self.start, self.end = cache, start, end
        self.slices, self.tokens = slices, tokens

    def mask(self, document_ids: torch.Tensor | None, causal: bool = True) -> SliceTokens:
        """This slice's :class:`SliceTokens` (build once per stage)."""
        positions = torch.arange(self.start, self.end)
        return SliceTokens(self.cache, positions, document_ids, causal)

    def loss(self, losses: torch.Tensor, loss_mask: torch.Tensor,
             token_mean: TokenMean | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss, reported)``: the slice's masked loss sum over the whole sequence's unmasked
        tokens (the slices' losses sum to the sequence's token mean; with ``token_mean``: over
        its per-token divisor), and ``slices`` times it (its mean over the slices is the
        sequence's loss, as the monitor averages units)."""
        mask = loss_mask.reshape(-1).to(losses.dtype)
        loss = torch.sum(losses.reshape(-1) * mask) / divisor_of(self.tokens, token_mean)
        return loss, loss.detach() * self.slices


class SliceTokens:
    """The attention mask of one slice: its global ``positions`` ``[s_j]``, ``document_ids``
    ``[b, s_j]`` (``--reset-attention-mask``) or None, and its sequence's ``cache`` (the slice
    registers its tokens there when built: build it once per slice and stage)."""

    def __init__(self, cache: SequenceCache, positions: torch.Tensor,
                 document_ids: torch.Tensor | None = None, causal: bool = True) -> None:
        self.cache, self.causal = cache, causal
        self.index = len(cache.positions)
        cache.positions.append(positions.to("cpu", torch.int64))
        cache.documents.append(None if document_ids is None else document_ids)
        self._masks: list[BlockMask | None] | None = None  # built on first use

    def block_masks(self, device: torch.device) -> list[BlockMask | None]:
        """Per block (the earlier slices, then this one): ``(mask, causal)`` -- the boolean
        ``[b or 1, 1, s_j, s_i]`` mask or True (everything allowed), and whether it is the plain
        causal one of the own block -- or None where nothing is allowed (built once)."""
        if self._masks is None:
            self._masks = [self._block_mask(i, device) for i in range(self.index + 1)]
        return self._masks

    def _block_mask(self, block: int, device: torch.device) -> BlockMask | None:
        q_pos, k_pos = self.cache.positions[self.index], self.cache.positions[block]
        mask = None
        if self.causal:
            mask = (k_pos[None, :] <= q_pos[:, None])[None, None]
        q_doc, k_doc = self.cache.documents[self.index], self.cache.documents[block]
        if q_doc is not None:
            same = (q_doc.cpu()[:, :, None] == k_doc.cpu()[:, None, :])[:, None]
            mask = same if mask is None else (mask & same)
        if mask is None or bool(mask.all()):
            return True, False
        if not bool(mask.any()):
            return None
        causal = (q_doc is None and block == self.index
                  and bool((q_pos.diff() == 1).all()))  # consecutive: the top-left causal mask
        return mask.to(device), causal

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scale: float) -> torch.Tensor:
        """Attention of this slice's queries ``[b, heads, s_j, d]`` to the keys/values
        ``[b, groups, ., d]`` of the earlier slices (cached for ``layer``) and its own; caches
        its own for the later slices."""
        cached = self.cache.keys_values.setdefault(layer, [])
        if len(cached) < self.index:
            raise RuntimeError(f"layer {layer}: slice {self.index} of a sequence after "
                               f"{len(cached)} cached slices (slices must run in order)")
        if len(cached) == self.index:  # the slice's first forward: cache its keys/values
            # (under no_grad -- the first pass of --recompute-granularity full, or evaluation
            # -- the leaves still take the later slices' gradients: the replay reads them)
            grad = not torch.is_grad_enabled()
            cached.append((key.detach().requires_grad_(key.requires_grad or grad),
                           value.detach().requires_grad_(value.requires_grad or grad)))
        # else a replay (full recomputation in this slice's backward): the leaves the later
        # slices attended to, and whose .grad their backwards (run before this one) filled
        leaves = cached[self.index]
        key, value = _AddCachedGrad.apply(key, leaves[0]), _AddCachedGrad.apply(value, leaves[1])
        blocks = cached[:self.index] + [(key, value)]
        masks = self.block_masks(query.device)
        kept = [i for i, m in enumerate(masks) if m is not None]
        return block_attention(query, [blocks[i] for i in kept], [masks[i] for i in kept],
                               scale)


SLICE = "sequence_slice"  # the SequenceSlice record of a sliced micro-batch


def split_into_slices(batch: dict, slices: int) -> list[dict]:
    """A collated GPT micro-batch as ``slices`` equal consecutive slices of its sequence, in
    order (sequence-sliced pipelines): each holds its share of every per-token field (``text``
    one token more, for the labels) and a :class:`SequenceSlice` sharing one cache."""
    seq = batch["text"].shape[1] - 1
    if seq % slices:
        raise ValueError(f"--seq-length {seq} is not divisible into {slices} equal slices")
    length, cache = seq // slices, SequenceCache()
    tokens = batch["loss_mask"].float().sum()
    parts = []
    for j in range(slices):
        a, b = j * length, (j + 1) * length
        part = {key: value[:, a:b] for key, value in batch.items() if key != "text"}
        part["text"] = batch["text"][:, a:b + 1]
        part[SLICE] = SequenceSlice(cache, a, b, slices, tokens)
        parts.append(part)
    return parts
