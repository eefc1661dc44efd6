"""Rank bodies of the context-parallel attention tests: every comm type at CP = 2 and 4 against
full attention computed independently (plain float64 softmax attention of the whole sequence)."""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from megatron_chimera.model.context_parallel import (
    ContextTokens,
    context_parallel_attention,
    merge_sequence,
    split_sequence,
    zigzag_positions,
)
from megatron_chimera.model.context_parallel.documents import split_documents

SEQ, BATCH, HEADS, HEAD_DIM = 16, 2, 8, 8


def reference_attention(query, key, value, causal, documents):
    """Whole-sequence attention in plain ops (independent of the package): ``[b, h, s, d]``."""
    per_group = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(per_group, 1)
    value = value.repeat_interleave(per_group, 1)
    scores = query @ key.transpose(-1, -2) / query.shape[-1] ** 0.5
    s = query.shape[2]
    allowed = torch.ones(s, s, dtype=torch.bool)
    if causal:
        allowed = allowed.tril()
    allowed = allowed[None, None]
    if documents is not None:
        allowed = allowed & (documents[:, None, :, None] == documents[:, None, None, :])
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, -1) @ value


def _documents(generator):
    breaks = torch.rand(BATCH, SEQ, generator=generator) < 0.2
    breaks[:, 0] = False
    return torch.cumsum(breaks.long(), dim=1)


def _relative(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def check_case(group, cp, rank, comm_type, causal, groups, documents, dtype, tolerance,
               attention_group=None):
    """One configuration: outputs and dQ/dK/dV against the reference; AssertionError naming it.
    ``attention_group``: what the attention communicates over when it is not ``group`` (the
    hierarchical groups of ``a2a+p2p``); the tokens are always gathered over ``group``."""
    generator = torch.Generator().manual_seed(1234)
    full = [torch.randn(BATCH, h, SEQ, HEAD_DIM, generator=generator, dtype=torch.float64)
            for h in (HEADS, groups, groups)]
    grad_out = torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, generator=generator,
                           dtype=torch.float64)
    docs = _documents(generator) if documents else None
    full = [t.to(dtype).to(torch.float64).requires_grad_() for t in full]
    ref = reference_attention(*full, causal, docs)
    ref.backward(grad_out)

    local = [split_sequence(t.detach(), 2, cp, rank).to(dtype).requires_grad_() for t in full]
    positions = zigzag_positions(SEQ, cp, rank)
    local_docs = None if docs is None else split_sequence(docs, 1, cp, rank)
    tokens = ContextTokens.gather(group, positions, local_docs, causal)
    out = context_parallel_attention(*local, tokens,
                                     group if attention_group is None else attention_group,
                                     comm_type)
    out.backward(split_sequence(grad_out, 2, cp, rank).to(dtype))
    sizes = ("" if attention_group is None else
             f" {attention_group.inner_size}x{attention_group.outer_size}")
    name = (f"{comm_type}{sizes} CP={cp} causal={causal} groups={groups} documents={documents} "
            f"{dtype}")
    for what, got, want in [("output", out, ref)] + [
            (f"d{n}", t.grad, f.grad) for n, t, f in zip("qkv", local, full)]:
        want_local = split_sequence(want.detach(), 2, cp, rank)
        assert got.dtype == dtype, (name, what, got.dtype)
        err = _relative(got.double(), want_local)
        assert err <= tolerance, f"{name}: {what} differs by {err:.2e} (> {tolerance})"


def run_attention_cases(rank, world_size):
    """CP=2 (two groups) and CP=4 (the world of 4): p2p, a2a, allgather; causal and
    bidirectional; grouped-query (8 query heads on 4 key/value heads) and plain multi-head;
    with and without document masks; float64 (1e-12), float32 (2e-6) and bfloat16 (3e-2)."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    world = dist.new_group(list(range(world_size)))
    settings = [(pairs[rank // 2], 2, rank % 2), (world, 4, rank)]
    for (group, cp, r), comm_type, causal, documents in itertools.product(
            settings, ("p2p", "a2a", "allgather"), (True, False), (False, True)):
        for groups, dtype, tolerance in ((4, torch.float64, 1e-12), (HEADS, torch.float64, 1e-12),
                                         (4, torch.float32, 2e-6)):
            check_case(group, cp, r, comm_type, causal, groups, documents, dtype, tolerance)
        # 16-bit inputs run in float32 inside and return bfloat16 (only the rounding of the
        # inputs and outputs to 8 mantissa bits differs from the float64 reference)
        check_case(group, cp, r, comm_type, causal, 4, documents, torch.bfloat16, 3e-2)
    for group, cp, r in settings:  # packed documents split per document (PR #5243's THD case)
        check_document_split(group, cp, r)


def check_document_split(group, cp, rank):
    """The per-document zigzag (odd lengths padded, or balanced without padding): every comm
    type's outputs and dQ/dK/dV on the real tokens equal whole-row document-causal attention
    (float64, 1e-12)."""
    for lengths, pad in (([5, 3, 9, 1, 6], True), ([5, 3, 9, 7, 8], False)):
        split = split_documents(lengths, cp, pad=pad)
        generator = torch.Generator().manual_seed(5)
        full = [torch.randn(1, h, sum(lengths), HEAD_DIM, generator=generator,
                            dtype=torch.float64).requires_grad_() for h in (HEADS, 4, 4)]
        grad_out = torch.randn(1, HEADS, sum(lengths), HEAD_DIM, generator=generator,
                               dtype=torch.float64)
        docs = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
        ref = reference_attention(*full, True, docs)
        ref.backward(grad_out)
        valid, held = split.valid(rank), split.held(rank)[split.valid(rank)]
        for comm_type in ("p2p", "a2a", "allgather"):
            local = [split.take(t.detach(), 2, rank, fill=1.5).requires_grad_() for t in full]
            out = context_parallel_attention(*local, split.context_tokens(rank, True), group,
                                             comm_type)
            out.backward(split.take(grad_out, 2, rank))
            for what, got, want in [("output", out, ref)] + [
                    (f"d{n}", t.grad, f.grad) for n, t, f in zip("qkv", local, full)]:
                err = _relative(got.detach()[..., valid, :], want.detach()[..., held, :])
                assert err <= 1e-12, (f"{comm_type} CP={cp} documents {lengths} pad={pad}: "
                                      f"{what} differs by {err:.2e}")


def run_zigzag_round_trip(rank, world_size):
    """merge_sequence inverts split_sequence (used by the attention cases' comparisons)."""
    x = torch.arange(2 * SEQ).view(2, SEQ)
    for cp in (1, 2, 4):
        shares = [split_sequence(x, 1, cp, r) for r in range(cp)]
        assert torch.equal(merge_sequence(shares, 1), x)
        assert torch.equal(torch.cat([zigzag_positions(SEQ, cp, r) for r in range(cp)]).sort()[0],
                           torch.arange(SEQ))
