"""Attention of one set of queries to several key/value blocks, each through the fused kernel of
:mod:`.blocks`, merged by log-sum-exp (:func:`block_attention`). Sequence slices use it: a
slice's queries against each earlier slice's cached keys/values and its own, without
concatenating the keys (no copy: the saved tensors are the cached ones) and without repeating
grouped-query heads."""

from __future__ import annotations

import torch

from megatron_chimera.model.context_parallel.blocks import (
    block_backward,
    block_forward,
    compute_dtype,
    merge,
)

#: per key/value block: its mask (True: everything allowed, or boolean ``[b or 1, 1, sq, sk]``)
#: and whether that mask is the plain top-left causal one
BlockMask = tuple[torch.Tensor | bool, bool]


def _grouped(query: torch.Tensor, groups: int) -> torch.Tensor:
    b, heads, s, d = query.shape
    return query.reshape(b, groups, heads // groups, s, d)


class _BlockAttention(torch.autograd.Function):
    """Forward: merge each block's (output, log-sum-exp); backward: each block's gradients from
    the merged output and log-sum-exp (FlashAttention's recurrence)."""

    @staticmethod
    def forward(ctx, query, scale, masks, *keys_values):  # noqa: D102
        groups = keys_values[0].shape[1]
        q = _grouped(query, groups)
        out = lse = None
        for (allowed, causal), key, value in zip(masks, keys_values[0::2], keys_values[1::2],
                                                 strict=True):
            block_out, block_lse = block_forward(q, key[:, :, None], value[:, :, None],
                                                 allowed, scale, causal)
            out, lse = merge(out, lse, block_out, block_lse)
        out = out.reshape(query.shape).to(query.dtype)
        ctx.save_for_backward(query, out, lse, *keys_values)
        ctx.scale, ctx.masks = scale, masks
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        query, out, lse, *keys_values = ctx.saved_tensors
        groups = keys_values[0].shape[1]
        q, grad_g, out_g = (_grouped(t, groups) for t in (query, grad, out))
        compute = compute_dtype(query.dtype)
        delta = (grad_g.to(compute) * out_g.to(compute)).sum(-1)
        grad_query, grads = None, []
        for (allowed, causal), key, value in zip(ctx.masks, keys_values[0::2],
                                                 keys_values[1::2], strict=True):
            dq, dk, dv = block_backward(q, key[:, :, None], value[:, :, None], allowed,
                                        ctx.scale, grad_g, lse, delta, out_g, causal)
            grad_query = dq if grad_query is None else grad_query + dq
            grads += [dk[:, :, 0].to(key.dtype), dv[:, :, 0].to(value.dtype)]
        return (grad_query.reshape(query.shape).to(query.dtype), None, None, *grads)


def block_attention(query: torch.Tensor, blocks: list[tuple[torch.Tensor, torch.Tensor]],
                    masks: list[BlockMask], scale: float) -> torch.Tensor:
    """Queries ``[b, heads, sq, d]`` against the key/value blocks ``[b, groups, sk_i, d]``
    under their ``masks``: ``[b, heads, sq, d]``, as one softmax over all the blocks' keys."""
    flat = [t for pair in blocks for t in pair]
    return _BlockAttention.apply(query, scale, masks, *flat)
