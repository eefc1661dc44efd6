"""``--cp-comm-type p2p``: ring attention. Key/value blocks travel around the context-parallel
group; each rank attends its queries to the block it holds while the next one is in flight, and
merges the partial results by their log-sum-exp. The backward travels the same ring: each block's
dK/dV accumulate as the block visits every rank and arrive home after one more step.

Work is split per pair of (query half, key half) -- the two zigzag chunks of each rank -- so a
pair that the causal or document mask hides entirely costs nothing and a pair it allows entirely
needs no mask.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

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


def diagonal(tokens: ContextTokens, key_rank: int, query_rows: slice, key_rows: slice) -> bool:
    """Whether the block's mask is the plain top-left causal one (a zigzag diagonal block: the
    same consecutive positions on both sides, no documents), so the kernel's ``is_causal``
    replaces the mask. Decided on the host."""
    if not tokens.causal or tokens.document_ids is not None:
        return False
    q_pos = tokens.positions[tokens.rank, query_rows]
    k_pos = tokens.positions[key_rank, key_rows]
    return bool(torch.equal(q_pos, k_pos) and (q_pos.numel() < 2 or bool(
        (q_pos.diff() == 1).all())))


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
                                     allowed, scale, causal=not isinstance(allowed, bool)
                                     and diagonal(tokens, key_rank, qh, kh))
            outs[i], lses[i] = merge(outs[i], lses[i], out, lse)


def _block_grads(query, key, value, grad_out, out, lse, delta, tokens: ContextTokens, key_rank: int,
                 scale: float, grad_query: torch.Tensor, grad_key: torch.Tensor,
                 grad_value: torch.Tensor) -> None:
    """Add ``key_rank``'s block's contributions to dQ (this rank's) and to its dK, dV."""
    q_halves, k_halves = _halves(query.shape[-2]), _halves(key.shape[-2])
    for qh in q_halves:
        for kh in k_halves:
            allowed = tokens.allowed(tokens.rank, key_rank, qh, kh)
            if allowed is False:
                continue
            causal = not isinstance(allowed, bool) and diagonal(tokens, key_rank, qh, kh)
            dq, dk, dv = block_backward(query[..., qh, :], key[..., kh, :], value[..., kh, :],
                                        allowed, scale, grad_out[..., qh, :], lse[..., qh],
                                        delta[..., qh], out[..., qh, :], causal)
            grad_query[..., qh, :] += dq
            grad_key[..., kh, :] += dk
            grad_value[..., kh, :] += dv


def grouped_heads(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[b, heads, s, d]`` queries and ``[b, groups, s, d]`` keys/values in ``dtype``, as the
    blocks take them: ``[b, groups, heads / groups, s, d]`` and ``[b, groups, 1, s, d]``."""
    b, heads, s, d = query.shape
    groups = key.shape[1]
    return (query.to(dtype).reshape(b, groups, heads // groups, s, d),
            key.to(dtype)[:, :, None], value.to(dtype)[:, :, None])


def rank_forward(query: torch.Tensor, tokens: ContextTokens, scale: float,
                 blocks: Iterable[tuple[int, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's side of the ring's forward: its grouped queries against each ``(source rank,
    stacked key/value block)`` that ``blocks`` yields, merged by log-sum-exp. Returns the
    output (grouped, compute dtype) and its log-sum-exp."""
    outs, lses = [None] * PARTS, [None] * PARTS
    for source, block in blocks:
        _attend_block(query, block[0], block[1], tokens, source, scale, outs, lses)
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


def rank_backward(query: torch.Tensor, grad_out: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, tokens: ContextTokens, scale: float,
                  blocks: Iterable[tuple[int, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """One rank's side of the ring's backward (grouped, compute dtype; ``out``, ``lse``: the
    final forward results): for each ``(source rank, key/value block, its dK/dV accumulator)``
    that ``blocks`` yields, add the block's contributions to the accumulator; returns dQ."""
    delta = (grad_out * out).sum(-1)
    grad_query = torch.zeros_like(query, dtype=compute_dtype(query.dtype))
    for source, block, grads in blocks:
        _block_grads(query, block[0], block[1], grad_out, out, lse, delta, tokens, source, scale,
                     grad_query, grads[0], grads[1])
    return grad_query


def _ring_blocks(block: torch.Tensor, tokens: ContextTokens, group: dist.ProcessGroup | None,
                 after_step: Callable[[], None] | None = None
                 ) -> Iterator[tuple[int, torch.Tensor]]:
    """The ring seen from one rank: its own block, then each previous rank's, the next one in
    flight while the caller computes on the current one; ``after_step`` runs once the next
    block has arrived (after the last step too)."""
    size = tokens.size
    ring = RingShift(group) if size > 1 else None
    for step in range(size):
        if step < size - 1:
            ring.start(block)
        yield (tokens.rank - step) % size, block
        if step < size - 1:
            block = ring.wait()
        if after_step is not None:
            after_step()


class _RingGrads:
    """The backward's ring: yields ``(source, block, scratch)``; each step's dK/dV go into a fresh
    scratch while the block's accumulator (the previous ranks' contributions) is still in
    flight, and are added to it after the wait, which starts its next hop -- so the grads'
    transfer overlaps the next step's compute. :attr:`grads` holds this rank's own block's
    dK/dV once the iteration is over (home after ``size`` steps; float32 for 16-bit blocks)."""

    def __init__(self, block: torch.Tensor, tokens: ContextTokens,
                 group: dist.ProcessGroup | None) -> None:
        self.block, self.tokens, self.group = block, tokens, group
        self.dtype = compute_dtype(block.dtype)
        self.grads = torch.zeros_like(block, dtype=self.dtype)

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        pending: RingShift | None = None
        accumulated = self.grads
        for source, block in _ring_blocks(self.block, self.tokens, self.group):
            scratch = torch.zeros_like(block, dtype=self.dtype)
            yield source, block, scratch
            accumulated = scratch if pending is None else pending.wait() + scratch
            if self.tokens.size > 1:
                pending = RingShift(self.group)
                pending.start(accumulated)
        self.grads = pending.wait() if pending is not None else accumulated


class RingAttention(torch.autograd.Function):
    """Autograd of ring attention (see the module docstring)."""

    @staticmethod
    def forward(ctx, query, key, value, tokens, group, scale):
        # the blocks travel in the inputs' dtype (16-bit on the wire); each block's kernel
        # returns float32 partial results for 16-bit inputs, merged in float32
        q, k, v = grouped_heads(query, key, value, query.dtype)
        out, lse = rank_forward(q, tokens, scale, _ring_blocks(torch.stack([k, v]), tokens,
                                                               group))
        out = out.reshape(query.shape).to(query.dtype)
        # saved in the inputs' precision (16-bit inputs: as FlashAttention, lse in float32)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.tokens, ctx.group, ctx.scale = tokens, group, scale
        return out

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, out, lse = ctx.saved_tensors
        q, k, v = grouped_heads(query, key, value, query.dtype)
        ring = _RingGrads(torch.stack([k, v]), ctx.tokens, ctx.group)
        grad_query = rank_backward(q, grad_output.to(lse.dtype).reshape(q.shape),
                                   out.to(lse.dtype).reshape(q.shape), lse, ctx.tokens,
                                   ctx.scale, ring)
        grads = ring.grads
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
