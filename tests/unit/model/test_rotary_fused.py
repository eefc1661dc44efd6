"""RoPE in three kernels (roll, product, addcmul; queries and keys of a group in one call)
against the unfused rotate-half composition it replaced, kept here as the reference."""

import pytest
import torch

from megatron_chimera.config import ModelConfig
from megatron_chimera.model.rotary import RotaryEmbedding, RotaryTables, apply_rotary_pos_emb
from megatron_chimera.model.transformer import ParallelAttention


def reference_rotary(x: torch.Tensor, tables: RotaryTables) -> torch.Tensor:
    """The previous implementation: ``x cos + rotate_half(x) sin`` on the first ``rot``
    channels of ``[b, heads, s, head_dim]``, the rest passed through."""
    rot = tables.cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    first, second = x_rot.chunk(2, dim=-1)
    rotated = torch.cat((-second, first), dim=-1)
    out = x_rot * tables.cos.to(x.dtype) + rotated * tables.sin.to(x.dtype)
    return out if x_pass.shape[-1] == 0 else torch.cat((out, x_pass), dim=-1)


def _config(**overrides) -> ModelConfig:
    values = dict(hidden_size=64, num_attention_heads=4, seq_length=12, vocab_size=64,
                  num_layers=1, position_embedding_type="rope", rotary_base=100)
    values.update(overrides)
    return ModelConfig(**values)


@pytest.mark.parametrize("percent", [1.0, 0.5])
@pytest.mark.parametrize("per_sample", [False, True])
def test_matches_the_unfused_rotation_in_fp32_with_gradients(percent, per_sample):
    config = _config(rotary_percent=percent)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7],
                              [3, 4, 5, 6, 7, 8, 9, 10, 11, 0, 1, 2]]) if per_sample else None
    tables = RotaryEmbedding(config).tables(12, positions, torch.device("cpu"))
    x = torch.randn(2, 4, 12, 16, generator=torch.Generator().manual_seed(0),
                    requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, ref = apply_rotary_pos_emb(x, tables), reference_rotary(x_ref, tables)
    # the same products; the fused sum rounds once where the reference rounds each product
    # first: fp32 differences of a few ulp of values of magnitude ~3
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)


def test_bf16_within_one_rounding_of_the_unfused_rotation():
    config = _config()
    tables = RotaryEmbedding(config).tables(12, None, torch.device("cpu"), torch.bfloat16)
    x = torch.randn(2, 4, 12, 16, generator=torch.Generator().manual_seed(1)).bfloat16()
    exact = reference_rotary(x.double(), RotaryTables(*(t.double() for t in tables)))
    out, ref = apply_rotary_pos_emb(x, tables).double(), reference_rotary(x, tables).double()
    # the reference rounds x*cos, rotate_half(x)*sin and their sum to bf16 (3 roundings), the
    # fused one x*cos and the sum (2): each is within 3 half-ulps (2^-8 relative) of the exact
    # value, the fused one no further from it than the reference's bound
    bound = 3 * 2.0 ** -8 * (x.double().abs().amax(-1, keepdim=True) * 2)
    assert bool(((out - exact).abs() <= bound).all())
    assert bool(((ref - exact).abs() <= bound).all())
    assert (out - exact).abs().mean() <= (ref - exact).abs().mean()


@pytest.mark.parametrize("groups", [4, 2, 1])
def test_queries_and_keys_rotated_together_equal_separately(groups):
    """``query_key_value_heads`` rotates a group's queries and key in one call; the result and
    the gradient of the fused QKV equal the previous split-then-rotate-each path."""
    config = _config(num_query_groups=groups)
    attention = ParallelAttention(config, 1, causal=True)
    per, d, s, b = 4 // groups, 16, 12, 2
    tables = RotaryEmbedding(config).tables(s, None, torch.device("cpu"))
    qkv = torch.randn(s, b, groups * (per + 2) * d, generator=torch.Generator().manual_seed(2),
                      requires_grad=True)
    qkv_ref = qkv.detach().clone().requires_grad_()
    query, key, value = attention.query_key_value_heads(qkv, tables)
    q, k, v = qkv_ref.view(s, b, groups, (per + 2) * d).split([per * d, d, d], dim=-1)
    q = reference_rotary(q.reshape(s, b, 4, d).permute(1, 2, 0, 3), tables)
    k = reference_rotary(k.permute(1, 2, 0, 3), tables)
    v = v.permute(1, 2, 0, 3)
    for ours, ref in ((query, q), (key, k), (value, v)):
        assert ours.shape == ref.shape
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    weights = [torch.randn_like(t) for t in (q, k, v)]
    sum((t * w).sum() for t, w in zip((query, key, value), weights)).backward()
    sum((t * w).sum() for t, w in zip((q, k, v), weights)).backward()
    torch.testing.assert_close(qkv.grad, qkv_ref.grad, rtol=1e-6, atol=1e-6)
