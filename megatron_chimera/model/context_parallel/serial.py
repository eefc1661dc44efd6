"""Ring (``p2p``) attention's ranks run one after another in one process (:class:`SerialRing`).

One GPU cannot host the context-parallel group's ranks, so ``tools/gpu_check.py`` runs their
per-rank work serially on it: every rank's forward (its queries against every rank's key/value
block, merged by log-sum-exp) and backward (its dQ, and its contributions to every block's
dK/dV) are the functions the distributed :class:`~.ring.RingAttention` runs
(:func:`~.ring.rank_forward`, :func:`~.ring.rank_backward`); only where the blocks come from
differs -- a list instead of the ring's messages -- so each rank's compute can be timed alone.
A block's dK/dV sums the ranks' contributions in rank order (the ring sums them in ring order:
the same terms).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from megatron_chimera.model.context_parallel.blocks import compute_dtype
from megatron_chimera.model.context_parallel.ring import grouped_heads, rank_backward, rank_forward
from megatron_chimera.model.context_parallel.tokens import ContextTokens
from megatron_chimera.model.context_parallel.zigzag import zigzag_positions


def zigzag_tokens(seq_length: int, context_parallel_size: int, causal: bool,
                  device: torch.device | str | None = None) -> list[ContextTokens]:
    """Every rank's :class:`ContextTokens` of a zigzag-split sequence (no document masks)."""
    positions = torch.stack([zigzag_positions(seq_length, context_parallel_size, r)
                             for r in range(context_parallel_size)])
    return [ContextTokens(positions, None, r, causal, device)
            for r in range(context_parallel_size)]


class SerialRing:
    """The ranks of one ring-attention group in one process. ``keys`` / ``values``: every rank's
    share ``[b, groups, s/CP, d]`` (rank order), ``tokens``: every rank's
    :class:`ContextTokens`; ``scale`` defaults to ``1/sqrt(d)``. Call :meth:`forward` for each
    rank, then :meth:`backward` for each rank; :meth:`key_value_grads` gives every rank's
    dK/dV once every rank's backward has run."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor],
                 tokens: list[ContextTokens], scale: float | None = None) -> None:
        if not len(keys) == len(values) == len(tokens) == tokens[0].size:
            raise ValueError(f"{len(keys)} keys, {len(values)} values and {len(tokens)} token "
                             f"records for a group of {tokens[0].size} ranks")
        self.dtype = keys[0].dtype
        self.compute = compute_dtype(self.dtype)
        self.scale = keys[0].shape[-1] ** -0.5 if scale is None else scale
        self.tokens = tokens
        self.blocks = [torch.stack([k[:, :, None], v[:, :, None]])  # the ring's wire dtype
                       for k, v in zip(keys, values, strict=True)]
        self.grads = [torch.zeros_like(b, dtype=self.compute) for b in self.blocks]
        self._saved: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def _sources(self, rank: int) -> Iterator[int]:
        """The ring's order seen from ``rank``: its own block, then each previous rank's."""
        size = len(self.blocks)
        return ((rank - step) % size for step in range(size))

    def forward(self, rank: int, query: torch.Tensor) -> torch.Tensor:
        """Rank ``rank``'s attention output ``[b, heads, s/CP, d]`` (the query's dtype) of its
        queries ``[b, heads, s/CP, d]``; keeps what its backward needs, as the ring does."""
        q = grouped_heads(query, self.blocks[rank][0, :, :, 0], self.blocks[rank][1, :, :, 0],
                          self.dtype)[0]
        out, lse = rank_forward(q, self.tokens[rank], self.scale,
                                ((s, self.blocks[s]) for s in self._sources(rank)))
        out = out.reshape(query.shape).to(query.dtype)
        self._saved[rank] = (query, out, lse)
        return out

    def backward(self, rank: int, grad_output: torch.Tensor) -> torch.Tensor:
        """Rank ``rank``'s dQ (the query's dtype) for the output gradient ``grad_output``; adds its
        contributions to every block's dK/dV."""
        query, out, lse = self._saved.pop(rank)
        q = grouped_heads(query, self.blocks[rank][0, :, :, 0], self.blocks[rank][1, :, :, 0],
                          self.dtype)[0]
        grad_query = rank_backward(
            q, grad_output.to(self.compute).reshape(q.shape), out.to(self.compute).reshape(q.shape),
            lse, self.tokens[rank], self.scale,
            ((s, self.blocks[s], self.grads[s]) for s in self._sources(rank)))
        return grad_query.reshape(query.shape).to(query.dtype)

    def key_value_grads(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every rank's ``(dK, dV)`` ``[b, groups, s/CP, d]`` in the keys' dtype."""
        return [(g[0][:, :, 0].to(self.dtype), g[1][:, :, 0].to(self.dtype)) for g in self.grads]
