"""A MoE layer's forward reads device values on the host at most once (issue 49): the sort-based
permutation has static shapes (T x k rows dropless; capacity rows per expert, padded, with a
capacity factor), the grouped GEMM's offsets come from the device counts, and only the looped
GEMM copies the counts to the host. An expert that receives no token is computed correctly."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_chimera.model.moe.layer import MoELayer
from megatron_chimera.model.moe.token_dispatcher import permute
from tests.helpers.host_syncs import count_host_syncs

from .test_moe_layer import B, H, S, config, reference_output


@pytest.mark.parametrize("moe, most", [
    (dict(moe_grouped_gemm=True), 0),
    (dict(moe_grouped_gemm=True, moe_expert_capacity_factor=0.5), 0),
    (dict(), 1),
    (dict(moe_expert_capacity_factor=1.0, add_bias=True), 0),
])
def test_moe_layer_forward_syncs_the_host_at_most_once(moe, most):
    moe = dict(moe)
    add_bias = moe.pop("add_bias", False)
    cfg = config(swiglu=True, **moe)
    if add_bias:
        cfg = dataclasses.replace(cfg, add_bias_linear=True)
    layer = MoELayer(cfg, 1, seed=3).train()
    hidden = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1))
    layer(hidden)  # once outside the count: the grouped-GEMM probe runs on the first call
    with count_host_syncs() as counts:
        out, _ = layer(hidden)
    assert counts.total() <= most, dict(counts)
    with torch.no_grad():
        probs, routing_map = layer.router(hidden.reshape(-1, H), S)
    torch.testing.assert_close(out, reference_output(layer, hidden, probs, routing_map, True),
                               rtol=1e-5, atol=1e-6)


def test_counter_sees_each_kind_of_host_read():
    x = torch.tensor([0, 2, 1])
    with count_host_syncs() as counts:
        x.nonzero()
        x.sum().item()
        x.tolist()
        torch.tensor([1, 2])
        x.repeat_interleave(x)
    assert counts.total() == 5, dict(counts)


def test_permutation_matches_nonzero_order_and_pads_empty_experts():
    """Expert 1 receives no token: the sorted permutation equals the ``nonzero`` order, and
    the padded one keeps each expert's tokens first with probability-0 padding after them."""
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randn(6, 4, generator=gen)
    routing_map = torch.zeros(6, 3, dtype=torch.bool)
    routing_map[[0, 2, 3, 5], 0] = True
    routing_map[[0, 1, 2, 3, 4, 5], 2] = True
    probs = torch.rand(6, 3, generator=gen) * routing_map
    rows, index, row_probs, counts = permute(tokens, probs, routing_map, num_rows=10)
    expert, token = routing_map.t().nonzero(as_tuple=True)
    assert torch.equal(index, token) and counts.tolist() == [4, 0, 6]
    assert torch.equal(rows, tokens[token]) and torch.equal(row_probs, probs[token, expert])
    rows, index, row_probs, counts = permute(tokens, probs, routing_map, rows_per_expert=5)
    assert counts.tolist() == [5, 5, 5] and rows.shape == (15, 4)
    assert index[:4].tolist() == [0, 2, 3, 5] and row_probs[4] == 0
    assert torch.all(row_probs[5:10] == 0)  # the empty expert: padding only
    assert index[10:].tolist() == [0, 1, 2, 3, 4]


def test_layer_with_an_expert_that_receives_no_token():
    """Route every token away from expert 0 (its router row strongly negative): the output and
    gradients equal the per-token reference; expert 0's weights get an exact zero gradient."""
    cfg = config(moe_grouped_gemm=True, moe_router_topk=1)
    layer = MoELayer(cfg, 1, seed=3).train()
    with torch.no_grad():
        layer.router.weight[0] = -100 * layer.router.weight[1:].abs().sum(0)
    hidden = torch.randn(S, B, H, generator=torch.Generator().manual_seed(2)).abs()
    hidden.requires_grad_()
    out, _ = layer(hidden)
    probs, routing_map = layer.router(hidden.reshape(-1, H), S)
    assert not routing_map[:, 0].any()
    expected = reference_output(layer, hidden, probs, routing_map, False)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    out.square().sum().backward()
    assert torch.count_nonzero(layer.experts.weight1.grad[0]) == 0
    assert torch.count_nonzero(layer.experts.weight1.grad[1:]) > 0
