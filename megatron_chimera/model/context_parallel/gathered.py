"""``--cp-comm-type allgather`` and ``a2a``: context-parallel attention built from differentiable
collectives around an ordinary attention call.

* ``allgather``: keys and values are all-gathered along the sequence (every rank's tokens, in rank
  order); this rank's queries attend to them under the mask of :class:`ContextTokens` -- causal
  without documents: each zigzag half against the earlier keys (unmasked) and its own chunk
  (causal) through the fused LSE kernels, no mask. The backward reduce-scatters dK/dV.
* ``a2a`` (DeepSpeed-Ulysses): an all-to-all trades the sequence split for a head split, so each
  rank runs full-sequence attention for ``heads / CP`` query heads and ``groups / CP`` key/value
  heads (CP must divide both); a second all-to-all trades back. Tokens are put in sequence order
  for the attention, so the causal and document masks are the ordinary ones (causal alone:
  SDPA's ``is_causal``, no mask; grouped-query heads through ``enable_gqa``, not repeated).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_chimera.errors import ConfigError
from megatron_chimera.model.context_parallel.block_attention import block_attention
from megatron_chimera.model.context_parallel.comm import all_gather, all_to_all
from megatron_chimera.model.context_parallel.tokens import ContextTokens

#: ``F.scaled_dot_product_attention`` takes ``enable_gqa`` (torch >= 2.5): grouped-query heads
#: without repeating the keys/values
_ENABLE_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def masked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     allowed: torch.Tensor | None, scale: float,
                     causal: bool = False) -> torch.Tensor:
    """Softmax attention ``[b, heads, sq, d]`` against ``[b, groups, sk, d]`` keys/values (each
    key/value head serves ``heads / groups`` query heads), ``allowed`` ``[b or 1, 1, sq, sk]``
    (None: everything, or the top-left causal mask with ``causal``, which SDPA applies without
    materialising it); every query row must be allowed some key. One SDPA call in the inputs'
    precision (its kernels accumulate 16-bit inputs in float32)."""
    per_group = query.shape[1] // key.shape[1]
    extra = {}
    if per_group > 1 and _ENABLE_GQA:
        extra["enable_gqa"] = True
    elif per_group > 1:
        key = key.repeat_interleave(per_group, dim=1)
        value = value.repeat_interleave(per_group, dim=1)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=allowed,
                                          is_causal=causal and allowed is None, scale=scale,
                                          **extra)


def _consecutive(positions: torch.Tensor) -> bool:
    return positions.numel() > 0 and bool((positions.diff() == 1).all())


def _gathered_causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     tokens: ContextTokens, scale: float) -> torch.Tensor | None:
    """Causal attention of this rank's zigzag halves against the gathered keys put in sequence
    order: each half sees every earlier key unmasked and its own chunk causally -- two blocks
    of :func:`.block_attention.block_attention` per half, no mask over the whole sequence.
    None when a half's positions are not consecutive (then the mask path runs)."""
    positions = tokens.positions[tokens.rank]
    half = positions.numel() // 2
    halves = [slice(0, half), slice(half, positions.numel())]
    if not all(_consecutive(positions[h]) for h in halves):
        return None
    order = tokens.natural_order().to(key.device)
    key, value = key.index_select(2, order), value.index_select(2, order)
    outs = []
    for h in halves:
        first, n = int(positions[h][0]), h.stop - h.start
        own = torch.ones(n, n, dtype=torch.bool, device=query.device).tril()[None, None]
        blocks, masks = [(key[:, :, first:first + n], value[:, :, first:first + n])], [(own, True)]
        if first:
            blocks.insert(0, (key[:, :, :first], value[:, :, :first]))
            masks.insert(0, (True, False))
        outs.append(block_attention(query[:, :, h], blocks, masks, scale))
    return torch.cat(outs, dim=2)


def all_gather_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         tokens: ContextTokens, group: dist.ProcessGroup | None,
                         scale: float) -> torch.Tensor:
    """``allgather`` context-parallel attention (see the module docstring)."""
    if tokens.size > 1:
        key, value = all_gather(key, 2, group), all_gather(value, 2, group)
    if tokens.causal and tokens.document_ids is None:
        out = _gathered_causal(query, key, value, tokens, scale)
        if out is not None:
            return out
    return masked_attention(query, key, value, tokens.gathered_allowed(), scale)


def check_heads(heads: int, groups: int, context_parallel_size: int) -> None:
    """ConfigError unless CP divides this tensor rank's query heads and key/value heads."""
    for flag, n in (("--num-attention-heads", heads), ("--num-query-groups", groups)):
        if n % context_parallel_size:
            raise ConfigError(f"--cp-comm-type a2a splits the heads over the context-parallel "
                              f"ranks: {flag} per tensor rank ({n}) is not divisible by "
                              f"--context-parallel-size {context_parallel_size}")


def all_to_all_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         tokens: ContextTokens, group: dist.ProcessGroup | None,
                         scale: float) -> torch.Tensor:
    """``a2a`` context-parallel attention (see the module docstring)."""
    size = tokens.size
    check_heads(query.shape[1], key.shape[1], size)
    if size > 1:  # [b, heads, s/CP, d] -> [b, heads/CP, s (rank order), d]
        query, key, value = (all_to_all(t, 1, 2, group) for t in (query, key, value))
    order = tokens.natural_order().to(query.device)
    query, key, value = (t.index_select(2, order) for t in (query, key, value))
    s = query.shape[2]
    allowed = None
    documents = tokens.natural_document_ids()
    if documents is not None:
        allowed = (documents[:, :, None] == documents[:, None, :])[:, None].to(query.device)
        if tokens.causal:
            allowed = allowed & torch.ones(s, s, dtype=torch.bool, device=query.device).tril()
    out = masked_attention(query, key, value, allowed, scale, causal=tokens.causal)
    out = out.index_select(2, torch.argsort(order))  # back to rank order
    return all_to_all(out, 2, 1, group) if size > 1 else out
