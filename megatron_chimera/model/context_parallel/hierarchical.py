"""``--cp-comm-type a2a+p2p`` with ``--hierarchical-context-parallel-sizes A B`` (Megatron's
hierarchical context parallelism, A x B = CP): the context ranks form groups of A adjacent ranks
(context rank ``g A + i`` is rank ``i`` of inner group ``g``). An all-to-all inside each inner
group trades its sequence split for a head split (``heads / A`` query heads and ``groups / A``
key/value heads, over the A ranks' tokens), ring attention then runs over the B inner groups
(the outer ring joins the ranks with the same ``i``), and a second all-to-all trades back. The
all-to-all stays on the A nearby ranks (within a node) and only the ring crosses nodes.

The outer ring sees each inner group as one rank holding the tokens of its A context ranks in
rank order (what the all-to-all gathers), so the masks are the whole group's
:class:`ContextTokens` regrouped (:func:`outer_tokens`).
"""

from __future__ import annotations

import torch

from megatron_chimera.model.context_parallel.comm import all_to_all
from megatron_chimera.model.context_parallel.gathered import check_heads
from megatron_chimera.model.context_parallel.ring import ring_attention
from megatron_chimera.model.context_parallel.tokens import ContextTokens
from megatron_chimera.parallel_state import HierarchicalGroups


def outer_tokens(tokens: ContextTokens, inner: int) -> ContextTokens:
    """``tokens`` of the whole context group as the outer ring sees it: outer rank ``g`` holds
    the tokens of context ranks ``g A .. g A + A - 1`` concatenated (cached on ``tokens``)."""
    key = ("hierarchical", inner)
    if key not in tokens._masks:
        outer, n = tokens.size // inner, tokens.positions.shape[1]
        positions = tokens.positions.reshape(outer, inner * n)
        docs = None
        if tokens.document_ids is not None:
            b = tokens.document_ids.shape[1]
            docs = tokens.document_ids.reshape(outer, inner, b, n).permute(0, 2, 1, 3)
            docs = docs.reshape(outer, b, inner * n)
        tokens._masks[key] = ContextTokens(positions, docs, tokens.rank // inner, tokens.causal,
                                           tokens.device)
    return tokens._masks[key]


def hierarchical_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           tokens: ContextTokens, groups: HierarchicalGroups,
                           scale: float) -> torch.Tensor:
    """``a2a+p2p`` context-parallel attention of this rank's queries ``[b, heads, s/CP, d]``
    against keys and values ``[b, groups, s/CP, d]`` (see the module docstring)."""
    inner = groups.inner_size
    check_heads(query.shape[1], key.shape[1], inner)
    if inner > 1:  # [b, heads, s/CP, d] -> [b, heads/A, A s/CP, d]
        query, key, value = (all_to_all(t, 1, 2, groups.inner) for t in (query, key, value))
    out = ring_attention(query, key, value, outer_tokens(tokens, inner), groups.outer, scale)
    return all_to_all(out, 2, 1, groups.inner) if inner > 1 else out
