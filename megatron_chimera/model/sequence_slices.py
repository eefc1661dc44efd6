"""Attention over the slices of one sequence that a pipeline stage runs one after another
(sequence-sliced pipelines, ``schedules/slices.py``): the stage keeps the keys and values of a
sequence's earlier slices, and each later slice attends to them plus its own.

A slice's keys and values are cached as detached leaves (:class:`SequenceCache`); the later
slices' backwards accumulate the leaves' ``.grad``. The slice's own keys and values pass through
an identity (:class:`_AddCachedGrad`) whose backward adds that accumulated gradient to what its
own attention returns. This is exact when the backward of slice ``j`` runs after the backwards
of every later slice of the sequence on that stage -- the slice-order rule the schedules keep.
"""

from __future__ import annotations

import torch

from megatron_chimera.model.context_parallel.gathered import masked_attention


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

    def loss(self, losses: torch.Tensor, loss_mask: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss, reported)``: the slice's masked loss sum over the whole sequence's unmasked
        tokens (the slices' losses sum to the sequence's token mean), and ``slices`` times it
        (its mean over the slices is that token mean, as the monitor averages units)."""
        mask = loss_mask.reshape(-1).to(losses.dtype)
        loss = torch.sum(losses.reshape(-1) * mask) / self.tokens
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
        self._allowed: torch.Tensor | None | bool = False  # False: not built yet

    def allowed(self, device: torch.device) -> torch.Tensor | None:
        """Boolean ``[b or 1, 1, s_j, s_0 + .. + s_j]`` (None: everything), built once."""
        if self._allowed is False:
            q_pos = self.cache.positions[self.index]
            k_pos = torch.cat(self.cache.positions[:self.index + 1])
            mask = None
            if self.causal:
                mask = (k_pos[None, :] <= q_pos[:, None])[None, None].to(device)
            docs = self.cache.documents[:self.index + 1]
            if docs[-1] is not None:
                k_doc = torch.cat(docs, dim=1).to(device)
                same = (docs[-1].to(device)[:, :, None] == k_doc[:, None, :])[:, None]
                mask = same if mask is None else (mask & same)
            self._allowed = None if mask is None or bool(mask.all()) else mask
        return self._allowed

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scale: float) -> torch.Tensor:
        """Attention of this slice's queries ``[b, heads, s_j, d]`` to the keys/values
        ``[b, groups, ., d]`` of the earlier slices (cached for ``layer``) and its own; caches
        its own for the later slices."""
        cached = self.cache.keys_values.setdefault(layer, [])
        if len(cached) != self.index:
            raise RuntimeError(f"layer {layer}: slice {self.index} of a sequence after "
                               f"{len(cached)} cached slices (slices must run in order)")
        leaves = (key.detach().requires_grad_(key.requires_grad),
                  value.detach().requires_grad_(value.requires_grad))
        key, value = _AddCachedGrad.apply(key, leaves[0]), _AddCachedGrad.apply(value, leaves[1])
        keys = torch.cat([k for k, _ in cached] + [key], dim=2)
        values = torch.cat([v for _, v in cached] + [value], dim=2)
        cached.append(leaves)
        return masked_attention(query, keys, values, self.allowed(query.device), scale)
