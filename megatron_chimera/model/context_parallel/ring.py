"""``--cp-comm-type p2p``: ring attention. Key/value blocks travel around the context-parallel
group; each rank attends its queries to the block it holds while the next one is in flight, and
merges the partial results by their log-sum-exp. The backward travels the same ring: each block's
dK/dV accumulate as the block visits every rank and arrive home after one more step.

Work is split per pair of (query half, key half) -- the two zigzag chunks of each rank -- so a
pair that the causal or document mask hides entirely costs nothing and a pair it allows entirely
needs no mask.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_chimera.model.context_parallel.blocks import (
    block_backward,
    block_forward,
    compute_dtype,
    merge,
)
from megatron_chimera.model.context_parallel.comm import RingShift
from megatron_chimera.model.context_parallel.tokens import ContextTokens

PARTS = 2  # query/key halves per rank: the zigzag split's two chunks


def _halves(length: int) -> list[slice]:
    step = length // PARTS
    return [slice(i * step, (i + 1) * step if i < PARTS - 1 else length) for i in range(PARTS)]


def _attend_block(query, key, value, tokens: ContextTokens, key_rank: int, scale: float,
                  outs: list, lses: list) -> None:
    """Merge ``key_rank``'s block into the running ``outs``/``lses`` of each query half."""
    q_halves, k_halves = _halves(query.shape[-2]), _halves(key.shape[-2])
    for i, qh in enumerate(q_halves):
        for kh in k_halves:
            allowed = tokens.allowed(tokens.rank, key_rank, qh, kh)
            if allowed is False:
                continue
            out, lse = block_forward(query[..., qh, :], key[..., kh, :], value[..., kh, :],
                                     allowed, scale)
            outs[i], lses[i] = merge(outs[i], lses[i], out, lse)


def _block_grads(query, key, value, grad_out, lse, delta, tokens: ContextTokens, key_rank: int,
                 scale: float, grad_query: torch.Tensor, grad_key: torch.Tensor,
                 grad_value: torch.Tensor) -> None:
    """Add ``key_rank``'s block's contributions to dQ (this rank's) and to its dK, dV."""
    q_halves, k_halves = _halves(query.shape[-2]), _halves(key.shape[-2])
    for qh in q_halves:
        for kh in k_halves:
            allowed = tokens.allowed(tokens.rank, key_rank, qh, kh)
            if allowed is False:
                continue
            dq, dk, dv = block_backward(query[..., qh, :], key[..., kh, :], value[..., kh, :],
                                        allowed, scale, grad_out[..., qh, :], lse[..., qh],
                                        delta[..., qh])
            grad_query[..., qh, :] += dq
            grad_key[..., kh, :] += dk
            grad_value[..., kh, :] += dv


def _grouped(query, key, value, dtype):
    b, heads, s, d = query.shape
    groups = key.shape[1]
    return (query.to(dtype).reshape(b, groups, heads // groups, s, d),
            key.to(dtype)[:, :, None], value.to(dtype)[:, :, None])


class RingAttention(torch.autograd.Function):
    """Autograd of ring attention (see the module docstring)."""

    @staticmethod
    def forward(ctx, query, key, value, tokens, group, scale):
        dtype = compute_dtype(query.dtype)
        q, k, v = _grouped(query, key, value, dtype)
        size = tokens.size
        ring = RingShift(group) if size > 1 else None
        outs, lses = [None] * PARTS, [None] * PARTS
        block = torch.stack([k, v])
        for step in range(size):
            if step < size - 1:
                ring.start(block)
            source = (tokens.rank - step) % size
            _attend_block(q, block[0], block[1], tokens, source, scale, outs, lses)
            if step < size - 1:
                block = ring.wait()
        out = torch.cat(outs, dim=-2).reshape(query.shape).to(query.dtype)
        lse = torch.cat(lses, dim=-1)
        # saved in the inputs' precision (16-bit inputs: as FlashAttention, lse in float32)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.tokens, ctx.group, ctx.scale = tokens, group, scale
        return out

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, out, lse = ctx.saved_tensors
        tokens, scale, size = ctx.tokens, ctx.scale, ctx.tokens.size
        q, k, v = _grouped(query, key, value, lse.dtype)
        grad_out = grad_output.to(q.dtype).reshape(q.shape)
        delta = (grad_out * out.to(q.dtype).reshape(q.shape)).sum(-1)
        grad_query = torch.zeros_like(q)
        ring = RingShift(ctx.group) if size > 1 else None
        block = torch.stack([k, v])
        grads = torch.zeros_like(block)
        for step in range(size):
            if step < size - 1:
                ring.start(block)
            source = (tokens.rank - step) % size
            _block_grads(q, block[0], block[1], grad_out, lse, delta, tokens, source, scale,
                         grad_query, grads[0], grads[1])
            if step < size - 1:
                block = ring.wait()
            if size > 1:  # dK/dV follow their block (one step behind it); home after `size`
                ring_grads = RingShift(ctx.group)
                ring_grads.start(grads)
                grads = ring_grads.wait()
        dq = grad_query.reshape(query.shape).to(query.dtype)
        return (dq, grads[0][:, :, 0].to(key.dtype), grads[1][:, :, 0].to(value.dtype),
                None, None, None)


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   tokens: ContextTokens, group: dist.ProcessGroup | None,
                   scale: float) -> torch.Tensor:
    """Ring attention of this rank's queries ``[b, heads, s/CP, d]`` against every rank's keys
    and values ``[b, groups, s/CP, d]`` (grouped-query attention: ``groups`` divides
    ``heads``); ``tokens`` says which tokens each rank holds and what may attend to what."""
    return RingAttention.apply(query, key, value, tokens, group, scale)
