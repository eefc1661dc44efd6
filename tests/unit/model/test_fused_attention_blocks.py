"""Split attention runs through the fused kernels that return the log-sum-exp (issue 49): the
serial ring's forward and backward in float32 (CP = 2, grouped-query, causal) call no matrix
multiply on a score-shaped operand ``[.., s_block, s_block]`` -- the scores are never
materialised -- and still equal whole-sequence attention (2e-6 relative)."""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_chimera.model.context_parallel import merge_sequence, split_sequence
from megatron_chimera.model.context_parallel.serial import SerialRing, zigzag_tokens
from tests.distributed.cp_cases import reference_attention

SEQ, BATCH, HEADS, GROUPS, HEAD_DIM, CP = 32, 2, 4, 2, 8, 2
MATMULS = {"aten.mm", "aten.bmm", "aten.matmul", "aten.baddbmm", "aten.addmm"}


class _Ops(TorchDispatchMode):
    """Counts ops by name, and matrix multiplies with an operand or result whose last two
    dimensions are ``(block, block)`` (a score matrix of one block pair)."""

    def __init__(self, block: int) -> None:
        super().__init__()
        self.block, self.ops, self.score_matmuls = block, Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        self.ops[name] += 1
        if name in MATMULS:
            shapes = [t.shape for t in (*args, out) if isinstance(t, torch.Tensor)]
            if any(len(s) >= 2 and s[-2] == self.block and s[-1] == self.block
                   for s in shapes):
                self.score_matmuls += 1
        return out


def test_ring_blocks_materialise_no_scores_in_float32():
    generator = torch.Generator().manual_seed(3)
    full = [torch.randn(BATCH, h, SEQ, HEAD_DIM, generator=generator, dtype=torch.float64)
            .float().double().requires_grad_() for h in (HEADS, GROUPS, GROUPS)]
    grad_out = torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, generator=generator)
    ref = reference_attention(*full, True, None)
    ref.backward(grad_out.double())
    shares = [[split_sequence(t.detach(), 2, CP, r).float() for r in range(CP)] for t in full]
    ring = SerialRing(shares[1], shares[2], zigzag_tokens(SEQ, CP, True))
    block = SEQ // CP // 2  # a zigzag half: the ring's unit of work
    with _Ops(block) as ops:
        outs = [ring.forward(r, shares[0][r]) for r in range(CP)]
        dqs = [ring.backward(r, split_sequence(grad_out, 2, CP, r)) for r in range(CP)]
    assert ops.score_matmuls == 0, ops.ops
    fused = "aten._scaled_dot_product_flash_attention_for_cpu"
    assert ops.ops[fused] > 0 and ops.ops[fused + "_backward"] > 0, ops.ops
    dks, dvs = zip(*ring.key_value_grads())
    for what, got, want in [("output", outs, ref), ("dq", dqs, full[0].grad),
                            ("dk", dks, full[1].grad), ("dv", dvs, full[2].grad)]:
        err = float((merge_sequence(list(got), 2).double() - want.detach()).abs().max()
                    / want.abs().max())
        assert err <= 2e-6, f"{what}: {err:.2e}"


def test_the_counter_sees_score_matmuls():
    """The explicit math (what the ring ran before) is caught by the same counter."""
    from megatron_chimera.model.context_parallel import blocks
    q = torch.randn(1, 1, 2, 8, 4)
    kv = torch.randn(1, 1, 1, 8, 4)
    with _Ops(8) as ops:
        blocks._scores(q, kv, True, 0.5)
    assert ops.score_matmuls == 1


def test_document_masked_blocks_reach_the_cuda_kernel_laid_out_as_it_needs(monkeypatch):
    """CUDA's memory-efficient kernel (document-masked blocks) stood in for by the CPU kernel:
    it receives the mask as a bias expanded over batch x groups and heads, its rows padded to
    16 elements, and a log-sum-exp padded to 32 rows in the backward; the block's output,
    log-sum-exp and gradients equal the CPU kernel path's (a row that sees no key included)."""
    from megatron_chimera.model.context_parallel import blocks

    aten = torch.ops.aten
    cpu, cpu_backward = (aten._scaled_dot_product_flash_attention_for_cpu,
                         aten._scaled_dot_product_flash_attention_for_cpu_backward)
    seen = []

    def check_bias(q, k, bias):
        assert bias.shape == (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        assert bias.stride(-2) % 16 == 0 and bias.stride(-1) == 1
        seen.append(bias.shape)

    def forward(q, k, v, bias, compute_lse, dropout, causal, scale):
        check_bias(q, k, bias)
        out, lse = cpu(q, k, v, dropout, causal, attn_mask=bias, scale=scale)
        lse = torch.cat((lse, torch.full((*lse.shape[:-1], -lse.shape[-1] % 32), float("nan"))),
                        -1)
        return out, lse, torch.empty(()), torch.empty(())

    def backward(grad, q, k, v, bias, out, lse, seed, offset, dropout, mask, causal, scale):
        check_bias(q, k, bias)
        assert lse.shape[-1] % 32 == 0 and mask == [True, True, True, False]
        return (*cpu_backward(grad, q, k, v, out, lse[..., :q.shape[2]], dropout, causal,
                              attn_mask=bias, scale=scale), None)

    monkeypatch.setattr(aten, "_scaled_dot_product_efficient_attention", forward)
    monkeypatch.setattr(aten, "_scaled_dot_product_efficient_attention_backward", backward)
    g = torch.Generator().manual_seed(4)
    q, grad = (torch.randn(2, 2, 2, 9, 8, generator=g) for _ in range(2))
    k, v = (torch.randn(2, 2, 1, 7, 8, generator=g) for _ in range(2))
    doc = torch.tensor([0, 0, 1, 1, 1, 2, 2])
    allowed = torch.stack([doc[None, :] == torch.tensor([0, 0, 1, 1, 3, 2, 2, 1, 0])[:, None],
                           torch.ones(9, 7, dtype=torch.bool)])[:, None]  # [b, 1, sq, sk]
    want = blocks._fused_forward("cpu", q, k, v, allowed, 0.3, False)
    got = blocks._fused_forward("efficient", q, k, v, allowed, 0.3, False)
    assert torch.equal(got[1].isinf(), want[1].isinf())  # row 4 of sample 0 sees no key
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    out, lse = want
    want_grads = blocks._fused_backward("cpu", q, k, v, allowed, 0.3, False, grad, out, lse)
    got_grads = blocks._fused_backward("efficient", q, k, v, allowed, 0.3, False, grad, out, lse)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert seen == [(4, 2, 9, 7)] * 2
