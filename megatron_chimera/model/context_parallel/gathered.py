"""``--cp-comm-type allgather`` and ``a2a``: context-parallel attention built from differentiable
collectives around an ordinary attention call.

* ``allgather``: keys and values are all-gathered along the sequence (every rank's tokens, in rank
  order); this rank's queries attend to them under the mask of :class:`ContextTokens`. The
  backward reduce-scatters dK/dV.
* ``a2a`` (DeepSpeed-Ulysses): an all-to-all trades the sequence split for a head split, so each
  rank runs full-sequence attention for ``heads / CP`` query heads and ``groups / CP`` key/value
  heads (CP must divide both); a second all-to-all trades back. Tokens are put in sequence order
  for the attention, so the causal and document masks are the ordinary ones.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_chimera.errors import ConfigError
from megatron_chimera.model.context_parallel.blocks import compute_dtype
from megatron_chimera.model.context_parallel.comm import all_gather, all_to_all
from megatron_chimera.model.context_parallel.tokens import ContextTokens


def masked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     allowed: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Softmax attention ``[b, heads, sq, d]`` against ``[b, groups, sk, d]`` keys/values (each
    key/value head serves ``heads / groups`` query heads), ``allowed`` ``[b or 1, 1, sq, sk]``
    (None: everything); every query row must be allowed some key. Scores and softmax in float32
    for 16-bit inputs."""
    dtype = compute_dtype(query.dtype)
    per_group = query.shape[1] // key.shape[1]
    if per_group > 1:
        key = key.repeat_interleave(per_group, dim=1)
        value = value.repeat_interleave(per_group, dim=1)
    out = F.scaled_dot_product_attention(query.to(dtype), key.to(dtype), value.to(dtype),
                                         attn_mask=allowed, scale=scale)
    return out.to(query.dtype)


def all_gather_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         tokens: ContextTokens, group: dist.ProcessGroup | None,
                         scale: float) -> torch.Tensor:
    """``allgather`` context-parallel attention (see the module docstring)."""
    if tokens.size > 1:
        key, value = all_gather(key, 2, group), all_gather(value, 2, group)
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
    if tokens.causal:
        allowed = torch.ones(s, s, dtype=torch.bool, device=query.device).tril()[None, None]
    documents = tokens.natural_document_ids()
    if documents is not None:
        same = (documents[:, :, None] == documents[:, None, :])[:, None].to(query.device)
        allowed = same if allowed is None else (allowed & same)
    out = masked_attention(query, key, value, allowed, scale)
    out = out.index_select(2, torch.argsort(order))  # back to rank order
    return all_to_all(out, 2, 1, group) if size > 1 else out
