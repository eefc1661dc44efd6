"""Ring attention's ranks run serially in one process (``context_parallel/serial.py``, what the GPU
check times on one device) equal whole-sequence attention computed independently (the
distributed tests' float64 reference): outputs and dQ/dK/dV, CP = 2 and 4, causal and
bidirectional, grouped-query attention."""

from __future__ import annotations

import pytest
import torch

from megatron_chimera.model.context_parallel import merge_sequence, split_sequence
from megatron_chimera.model.context_parallel.serial import SerialRing, zigzag_tokens
from tests.distributed.cp_cases import reference_attention

SEQ, BATCH, HEADS, GROUPS, HEAD_DIM = 16, 2, 4, 2, 8


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.bfloat16, 3e-2)])
def test_serial_ring_equals_full_attention(cp, causal, dtype, tolerance):
    generator = torch.Generator().manual_seed(7)
    full = [torch.randn(BATCH, h, SEQ, HEAD_DIM, generator=generator, dtype=torch.float64)
            .to(dtype).to(torch.float64).requires_grad_() for h in (HEADS, GROUPS, GROUPS)]
    grad_out = torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, generator=generator,
                           dtype=torch.float64).to(dtype)
    ref = reference_attention(*full, causal, None)
    ref.backward(grad_out.double())

    shares = [[split_sequence(t.detach(), 2, cp, r).to(dtype) for r in range(cp)]
              for t in full]
    ring = SerialRing(shares[1], shares[2], zigzag_tokens(SEQ, cp, causal))
    outs = [ring.forward(r, shares[0][r]) for r in range(cp)]
    dqs = [ring.backward(r, split_sequence(grad_out, 2, cp, r)) for r in range(cp)]
    dks, dvs = zip(*ring.key_value_grads())
    for what, got, want in [("output", outs, ref), ("dq", dqs, full[0].grad),
                            ("dk", dks, full[1].grad), ("dv", dvs, full[2].grad)]:
        assert all(g.dtype == dtype for g in got), what
        err = _relative(merge_sequence(list(got), 2).double(), want.detach())
        assert err <= tolerance, f"{what}: {err:.2e} > {tolerance}"
