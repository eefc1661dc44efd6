"""Per-document zigzag under context parallelism (``context_parallel/documents.py``): Megatron-LM
PR #5243's case holds exactly its positions; odd document lengths (padded, or balanced through
the leftover stretch) give every CP rank the right RoPE positions, and the ring's attention with
dQ/dK/dV, its ranks run serially, equals whole-row document-causal attention (float64, 1e-12)."""

from __future__ import annotations

import pytest
import torch

from megatron_chimera.errors import ConfigError
from megatron_chimera.model.context_parallel.documents import (
    document_lengths,
    split_cu_seqlens,
    split_documents,
)
from megatron_chimera.model.context_parallel.serial import SerialRing
from tests.distributed.cp_cases import reference_attention

HEADS, GROUPS, HEAD_DIM = 4, 2, 8


def test_megatron_pr_5243_positions():
    split = split_cu_seqlens([0, 4, 8], 2)
    assert split.held(0).tolist() == [0, 3, 4, 7]
    assert split.held(1).tolist() == [1, 2, 5, 6]
    assert split.positions[split.slots[0]].tolist() == [0, 3, 0, 3]  # RoPE: within the document
    assert split.positions[split.slots[1]].tolist() == [1, 2, 1, 2]
    assert split_documents([4, 4], 2, pad=False).held(0).tolist() == [0, 3, 4, 7]


def test_padding_and_balance():
    padded = split_documents([5, 3], 2)  # padded to 8 and 4: 12 slots, 6 per rank
    assert padded.padded_length == 12 and padded.slots.shape == (2, 6)
    assert sorted(t for r in range(2) for t in padded.held(r).tolist() if t >= 0) == list(range(8))
    assert int((padded.source < 0).sum()) == 4
    balanced = split_documents([5, 3, 9, 7], 2, pad=False)  # 24 tokens, no padding
    assert balanced.slots.shape == (2, 12)
    assert torch.equal(balanced.source, torch.arange(24))  # slot = token: RoPE fallback right
    with pytest.raises(ConfigError, match="not divisible by 2 x --context-parallel-size"):
        split_documents([5, 2], 2, pad=False)
    assert document_lengths(torch.tensor([0, 0, 0, 1, 2, 2])) == [3, 1, 2]


@pytest.mark.parametrize("lengths, cp, pad", [([5, 3, 9, 1], 2, True), ([7, 2, 11], 3, True),
                                              ([5, 3, 9, 7], 2, False)])
def test_ring_attention_equals_full_attention_float64(lengths, cp, pad):
    split = split_documents(lengths, cp, pad=pad)
    total = sum(lengths)
    documents = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    generator = torch.Generator().manual_seed(11)
    full = [torch.randn(1, h, total, HEAD_DIM, generator=generator, dtype=torch.float64)
            .requires_grad_() for h in (HEADS, GROUPS, GROUPS)]
    grad_out = torch.randn(1, HEADS, total, HEAD_DIM, generator=generator, dtype=torch.float64)
    ref = reference_attention(*full, True, documents)
    ref.backward(grad_out)

    # RoPE positions every rank gets: each token's index in its document
    within = torch.cat([torch.arange(n) for n in lengths])
    for r in range(cp):
        valid = split.valid(r)
        assert torch.equal(split.positions[split.slots[r]][valid], within[split.held(r)[valid]])

    shares = [[split.take(t.detach(), 2, r, fill=float(r + 3)) for r in range(cp)] for t in full]
    tokens = [split.context_tokens(r, True) for r in range(cp)]
    ring = SerialRing(shares[1], shares[2], tokens)
    outs = [ring.forward(r, shares[0][r]) for r in range(cp)]
    dqs = [ring.backward(r, split.take(grad_out, 2, r)) for r in range(cp)]  # no loss: 0
    dks, dvs = zip(*ring.key_value_grads())
    for what, got, want in [("output", outs, ref), ("dq", dqs, full[0].grad),
                            ("dk", dks, full[1].grad), ("dv", dvs, full[2].grad)]:
        merged = split.merge(list(got), 2)
        assert merged.shape == want.shape
        err = float((merged - want.detach()).abs().max() / want.detach().abs().max())
        assert err <= 1e-12, (what, err)
