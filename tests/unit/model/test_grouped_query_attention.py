"""Grouped-query attention: the fused core hands SDPA the groups' keys and values as they are
(``enable_gqa``) where its kernel takes them, else repeats them per query head; the unfused core
repeats them. Every path equals attention on explicitly repeated heads."""

import pytest
import torch
import torch.nn.functional as F

from megatron_chimera.model import fused
from megatron_chimera.model.fused import attention


def _qkv(dtype=torch.float32, groups=2, heads=8):
    gen = torch.Generator().manual_seed(0)
    shapes = ((2, heads, 16, 8), (2, groups, 16, 8), (2, groups, 16, 8))
    return [torch.randn(*shape, generator=gen).to(dtype).requires_grad_() for shape in shapes]


def _repeated(key, value, times):
    return key.repeat_interleave(times, 1), value.repeat_interleave(times, 1)


@pytest.mark.parametrize("fused_core", [True, False])
@pytest.mark.parametrize("masked", [False, True])
def test_grouped_heads_equal_repeated_heads(fused_core, masked):
    query, key, value = _qkv()
    mask = (torch.rand(16, 16, generator=torch.Generator().manual_seed(1)) > 0.7) if masked \
        else None
    out = attention(query, key, value, mask, True, 0.0, True, fused=fused_core)
    ref_q, ref_k, ref_v = (t.detach().clone().requires_grad_() for t in (query, key, value))
    ref = attention(ref_q, *_repeated(ref_k, ref_v, 4), mask, True, 0.0, True,
                    fused=fused_core)
    # fp32: the same products; SDPA's GQA path sums the shared heads' gradients inside the
    # kernel, repeat_interleave's backward outside: summation order only
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    for ours, theirs in ((query, ref_q), (key, ref_k), (value, ref_v)):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-5)


def test_fused_core_passes_the_groups_where_the_kernel_takes_them(monkeypatch):
    calls = []
    sdpa = F.scaled_dot_product_attention

    def recording(query, key, value, **kwargs):
        calls.append((key.shape[1], kwargs.get("enable_gqa", False)))
        return sdpa(query, key, value, **kwargs)

    monkeypatch.setattr(fused.F, "scaled_dot_product_attention", recording)
    query, key, value = _qkv(torch.bfloat16)
    assert fused.sdpa_handles_gqa(query, key, value, None, 0.0, True)  # the CPU kernels do
    attention(query, key, value, None, True, 0.0, True)
    monkeypatch.setattr(fused, "sdpa_handles_gqa", lambda *args: False)  # e.g. CUDA, fp32
    attention(query, key, value, None, True, 0.0, True)
    assert calls == [(2, True), (8, False)]


def test_fused_core_saves_the_groups_keys_and_values_only():
    """The memory the repeat cost: SDPA keeps its own copies of the 2 groups, not 8 heads, and
    not the buffer the key and value are views of."""
    query, _, _ = _qkv(torch.bfloat16)
    buffer = torch.randn(2, 16, 2, 3, 8, dtype=torch.bfloat16, requires_grad=True)
    key, value = buffer[:, :, :, 1].transpose(1, 2), buffer[:, :, :, 2].transpose(1, 2)
    saved = {}

    def pack(tensor):
        saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        attention(query, key, value, None, True, 0.0, True)
    assert buffer.untyped_storage().data_ptr() not in saved
    # query and output (b x 8 heads x s x d, bf16), key and value (2 groups), the fp32
    # log-sum-exp of the CPU flash kernel (b x heads x s); repeated heads: 4 x 4096 + 1024
    heads_bytes, group_bytes, lse_bytes = 2 * 8 * 16 * 8 * 2, 2 * 2 * 16 * 8 * 2, 2 * 8 * 16 * 4
    assert sum(saved.values()) == 2 * heads_bytes + 2 * group_bytes + lse_bytes
