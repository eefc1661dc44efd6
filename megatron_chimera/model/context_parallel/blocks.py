"""Exact attention of one block of queries against one block of keys, with its log-sum-exp, and
the gradient of a block given the *final* output and log-sum-exp (FlashAttention's recurrence).

Shapes: queries ``[b, groups, g, sq, d]`` (``g`` query heads share one key/value head: grouped-
query attention), keys and values ``[b, groups, 1, sk, d]``, masks ``[b or 1, 1, sq, sk]``
(True: may attend; broadcast over heads). Scores are computed in float32 for 16-bit inputs, in the
input's precision otherwise, so the float64 path is exact to rounding.
"""

from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for 16-bit inputs, else ``dtype``."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _scores(query: torch.Tensor, key: torch.Tensor, allowed: torch.Tensor | bool,
            scale: float) -> torch.Tensor:
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    if not isinstance(allowed, bool):
        scores = scores.masked_fill(~allowed[:, :, None], float("-inf"))
    return scores


def block_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  allowed: torch.Tensor | bool, scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``: the block's softmax-normalised output ``[b, groups, g, sq, d]`` and the
    log-sum-exp of its scores ``[b, groups, g, sq]`` (-inf on a row that may see no key)."""
    scores = _scores(query, key, allowed, scale)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.clamp_min(torch.finfo(scores.dtype).min)[..., None])
    return torch.matmul(probs, value), lse


def merge(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial results over disjoint keys merged by their log-sum-exp (rows that saw no key
    in one of them keep the other's)."""
    if out is None:
        return block_out, block_lse
    new_lse = torch.logaddexp(lse, block_lse)
    finite = torch.isfinite(new_lse)
    safe = torch.where(finite, new_lse, torch.zeros_like(new_lse))
    w_old = torch.where(finite, torch.exp(lse - safe), torch.zeros_like(lse))[..., None]
    w_new = torch.where(finite, torch.exp(block_lse - safe), torch.zeros_like(lse))[..., None]
    return out * w_old + block_out * w_new, new_lse


def block_backward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   allowed: torch.Tensor | bool, scale: float, grad_out: torch.Tensor,
                   lse: torch.Tensor, delta: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of one block: ``lse`` is the final log-sum-exp of the queries' rows over
    all keys, ``delta = rowsum(grad_out * out)`` with the final output. ``dk``, ``dv`` are summed
    over the ``g`` query heads of each group (``[b, groups, 1, sk, d]``)."""
    scores = _scores(query, key, allowed, scale)
    probs = torch.exp(scores - lse.clamp_min(torch.finfo(scores.dtype).min)[..., None])
    grad_value = torch.matmul(probs.transpose(-1, -2), grad_out).sum(2, keepdim=True)
    grad_probs = torch.matmul(grad_out, value.transpose(-1, -2))
    grad_scores = probs * (grad_probs - delta[..., None])
    grad_query = torch.matmul(grad_scores, key) * scale
    grad_key = (torch.matmul(grad_scores.transpose(-1, -2), query) * scale).sum(2, keepdim=True)
    return grad_query, grad_key, grad_value
