"""One process's MoE layer against independent references: the routed output against a per-token
loop over the chosen experts, the router's scores, capacity dropping and auxiliary losses against
their formulas written out directly, the auxiliary gradients, grouped against looped GEMMs, and
the ``--moe-layer-freq`` patterns."""

from __future__ import annotations

import argparse
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from megatron_chimera.config import ConfigError, ModelConfig, MoEConfig, parse_moe_layer_freq
from megatron_chimera.config.moe import layer_freq
from megatron_chimera.model.moe.aux_loss import pop_aux_losses, set_aux_loss_scale
from megatron_chimera.model.moe.layer import MoELayer, check_moe
from megatron_chimera.model.transformer import moe_layer

S, B, H = 6, 2, 16


def config(**moe) -> ModelConfig:
    """A tiny fp32 model config with 4 experts and the given MoE fields."""
    fields = dict(num_experts=4, moe_ffn_hidden_size=8, moe_router_topk=2)
    fields.update(moe)
    swiglu = fields.pop("swiglu", False)
    return ModelConfig(num_layers=2, hidden_size=H, num_attention_heads=2, swiglu=swiglu,
                       hidden_dropout=0.0, attention_dropout=0.0,
                       gelu="megatron" if swiglu else "erf",
                       init_method_std=0.5, moe=MoEConfig(**fields))


def reference_output(layer: MoELayer, hidden: torch.Tensor, probs: torch.Tensor,
                     routing_map: torch.Tensor, swiglu: bool) -> torch.Tensor:
    """sum_e p[t, e] x expert_e(x_t), one token and one expert at a time."""
    ex = layer.experts
    tokens = hidden.reshape(-1, H)
    out = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        for e in range(ex.num_local):
            if not routing_map[t, e]:
                continue
            h = tokens[t] @ ex.weight1[e] + (ex.bias1[e] if ex.bias1 is not None else 0)
            if swiglu:
                gate, up = h.chunk(2)
                h = F.silu(gate) * up
            else:
                h = F.gelu(h)
            y = h @ ex.weight2[e] + (ex.bias2[e] if ex.bias2 is not None else 0)
            out[t] += probs[t, e] * y
    return out.view_as(hidden)


@pytest.mark.parametrize("moe", [
    dict(),
    dict(swiglu=True, moe_router_score_function="sigmoid"),
    dict(moe_router_pre_softmax=True, moe_router_topk=1),
    dict(moe_expert_capacity_factor=0.5, moe_token_dispatcher_type="allgather"),
    dict(moe_grouped_gemm=True, moe_router_topk=3),
])
def test_routed_output_matches_per_token_loop(moe):
    torch.manual_seed(0)
    cfg = config(**moe)
    layer = MoELayer(cfg, 1, seed=3)
    hidden = torch.randn(S, B, H)
    out, bias = layer(hidden)
    probs, routing_map = layer.router(hidden.reshape(-1, H), S)
    expected = reference_output(layer, hidden, probs, routing_map, cfg.swiglu)
    assert bias is None
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_router_scores_follow_the_score_functions():
    torch.manual_seed(1)
    for moe, expected in [
        (dict(), lambda lg: _scatter(torch.softmax(lg.topk(2).values, -1), lg.topk(2).indices)),
        (dict(moe_router_pre_softmax=True),
         lambda lg: _scatter(torch.softmax(lg, -1).topk(2).values, lg.topk(2).indices)),
        (dict(moe_router_score_function="sigmoid"),
         lambda lg: _scatter(_normalised(torch.sigmoid(lg).topk(2).values),
                             lg.topk(2).indices)),
    ]:
        layer = MoELayer(config(**moe), 1, seed=3)
        tokens = torch.randn(S * B, H)
        probs, routing_map = layer.router(tokens, S)
        logits = tokens @ layer.router.weight.t()
        torch.testing.assert_close(probs, expected(logits))
        assert (routing_map == (probs > 0)).all() and (routing_map.sum(1) == 2).all()


def _scatter(values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return torch.zeros(values.shape[0], 4).scatter(1, indices, values)


def _normalised(values: torch.Tensor) -> torch.Tensor:
    return values / values.sum(-1, keepdim=True)


def test_capacity_keeps_each_experts_most_probable_tokens():
    torch.manual_seed(2)
    factor = 0.5
    layer = MoELayer(config(moe_expert_capacity_factor=factor), 1, seed=3)
    free = MoELayer(config(), 1, seed=3)
    tokens = torch.randn(S * B, H)
    probs, routing_map = layer.router(tokens, S)
    all_probs, all_map = free.router(tokens, S)
    capacity = math.ceil(S * B * 2 / 4 * factor)
    for e in range(4):
        chosen = all_map[:, e].nonzero().flatten()
        kept = chosen[all_probs[chosen, e].argsort(descending=True)[:capacity]]
        assert set(routing_map[:, e].nonzero().flatten().tolist()) == set(kept.tolist())
    assert routing_map.sum() < all_map.sum()  # something was dropped
    torch.testing.assert_close(probs, all_probs * routing_map)


@pytest.mark.parametrize("balancing", ["aux_loss", "seq_aux_loss"])
def test_aux_losses_values_and_gradients(balancing):
    torch.manual_seed(4)
    coeff, z_coeff, scale = 0.1, 0.01, 0.25
    cfg = config(moe_router_load_balancing_type=balancing, moe_aux_loss_coeff=coeff,
                 moe_z_loss_coeff=z_coeff)
    layer = MoELayer(cfg, 2, seed=3).train()
    set_aux_loss_scale([layer], scale)
    hidden = torch.randn(S, B, H, requires_grad=True)
    out, _ = layer(hidden)
    out.square().sum().backward()
    got = {n: p.grad.clone() for n, p in layer.named_parameters()}

    # reference: the auxiliary losses written out and added to the objective with weight `scale`
    plain = MoELayer(dataclasses.replace(cfg, moe=dataclasses.replace(
        cfg.moe, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None)), 2, seed=3).train()
    out_plain, _ = plain(hidden)
    logits = hidden.reshape(-1, H) @ plain.router.weight.t()
    scores = torch.softmax(logits, -1)
    chosen = torch.zeros_like(scores).scatter(1, scores.topk(2).indices, 1.0)
    if balancing == "aux_loss":
        aux = 4 * ((chosen.sum(0) / (S * B * 2)) * scores.mean(0)).sum()
    else:  # per sequence j: tokens (i, j) for every position i
        per_seq = [4 * ((chosen.view(S, B, 4)[:, j].sum(0) / (S * 2))
                        * scores.view(S, B, 4)[:, j].mean(0)).sum() for j in range(B)]
        aux = torch.stack(per_seq).mean()
    z = torch.logsumexp(logits, -1).square().mean()
    objective = out_plain.square().sum() + scale * (coeff * aux + z_coeff * z)
    objective.backward()
    for n, p in plain.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-7, msg=n)
    logged = pop_aux_losses([layer])
    name = "load_balancing_loss" if balancing == "aux_loss" else "seq_load_balancing_loss"
    torch.testing.assert_close(logged[name][2], aux.detach())
    torch.testing.assert_close(logged["z_loss"][2], z.detach())
    assert pop_aux_losses([layer]) == {}


def test_shared_expert_adds_a_dense_mlp():
    torch.manual_seed(5)
    cfg = config(moe_shared_expert_intermediate_size=12)
    layer = moe_layer(cfg, 1, seed=3)
    hidden = torch.randn(S, B, H)
    out, _ = layer(hidden)
    shared, bias = layer.shared_experts(hidden)
    routed = out - (shared if bias is None else shared + bias)
    probs, routing_map = layer.router(hidden.reshape(-1, H), S)
    torch.testing.assert_close(routed, reference_output(layer, hidden, probs, routing_map,
                                                        False), rtol=1e-5, atol=1e-5)
    assert layer.shared_experts.dense_h_to_4h.weight.shape[0] == 12


def test_shared_expert_gate_scales_the_shared_output_per_token():
    """``--moe-shared-expert-gate``: out = routed + sigmoid(x w_g) x shared(x) (Qwen2-MoE's
    ``shared_expert_gate``), the gate drawn from its own key and trained."""
    torch.manual_seed(7)
    cfg = config(moe_shared_expert_intermediate_size=12, moe_shared_expert_gate=True)
    layer = moe_layer(cfg, 1, seed=3)
    gate = layer.shared_experts.gate_weight
    assert gate.shape == (1, H) and float(gate.abs().sum()) > 0
    hidden = torch.randn(S, B, H)
    out, _ = layer(hidden)
    shared, bias = layer.shared_experts(hidden)
    shared = shared if bias is None else shared + bias
    factor = 1.0 / (1.0 + torch.exp(-(hidden @ gate.detach()[0])))  # [S, B]
    probs, routing_map = layer.router(hidden.reshape(-1, H), S)
    expected = reference_output(layer, hidden, probs, routing_map, False) + (
        factor.unsqueeze(-1) * shared)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    out.square().sum().backward()
    assert gate.grad is not None and float(gate.grad.abs().sum()) > 0
    ungated = moe_layer(config(moe_shared_expert_intermediate_size=12), 1, seed=3)
    assert not hasattr(ungated.shared_experts, "gate_weight")


def test_grouped_and_looped_gemms_agree():
    torch.manual_seed(6)
    looped = MoELayer(config(swiglu=True), 1, seed=3)
    grouped = MoELayer(config(swiglu=True, moe_grouped_gemm=True), 1, seed=3)
    hidden = torch.randn(S, B, H)
    a, _ = looped(hidden)
    b, _ = grouped(hidden)
    a.sum().backward()
    b.sum().backward()
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(looped.experts.weight1.grad, grouped.experts.weight1.grad,
                               rtol=1e-5, atol=1e-6)


def test_layer_freq_patterns():
    assert parse_moe_layer_freq(2, 5) == (True, False, True, False, True)
    assert parse_moe_layer_freq("[1,0,1]", 3) == (True, False, True)
    assert parse_moe_layer_freq("([1]*3+[0])*2", 8) == (True,) * 3 + (False,) + (True,) * 3 + (
        False,)
    assert parse_moe_layer_freq("3", 4) == (True, False, False, True)
    for bad in ("[1,0]", "__import__('os')", "[2,0,1]", "0"):
        with pytest.raises(ConfigError, match="--moe-layer-freq"):
            parse_moe_layer_freq(bad, 3)
    assert layer_freq("2") == 2 and layer_freq(" [1,0]*2") == " [1,0]*2"
    with pytest.raises(argparse.ArgumentTypeError, match="only ints, lists"):
        layer_freq("open('x')")


def test_unsupported_settings_name_their_flag():
    with pytest.raises(ConfigError, match="--expert-tensor-parallel-size"):
        check_moe(1, 2)
    with pytest.raises(ConfigError, match="--tensor-model-parallel-size"):
        check_moe(2)
    with pytest.raises(ConfigError, match="--moe-router-topk"):
        MoELayer(config(moe_router_topk=5), 1, seed=3)
    with pytest.raises(ConfigError, match="--moe-router-pre-softmax"):
        MoELayer(config(moe_router_pre_softmax=True, moe_router_score_function="sigmoid"), 1,
                 seed=3)


@pytest.mark.parametrize("fields", [
    dict(),
    dict(swiglu=True, moe_shared_expert_intermediate_size=12),
    dict(swiglu=True, moe_shared_expert_intermediate_size=12, moe_shared_expert_gate=True),
])
@pytest.mark.parametrize("bias", [True, False])
def test_parameter_counts_match_the_modules(fields, bias):
    from megatron_chimera.model.fused import FusedBackend
    from megatron_chimera.model.partition import expert_parameters, layer_parameters
    from megatron_chimera.model.transformer import ParallelTransformerLayer
    cfg = dataclasses.replace(config(moe_layer_freq="[0,1]", **fields), add_bias_linear=bias)
    for index in range(2):
        layer = ParallelTransformerLayer(cfg, index + 1, True, FusedBackend(apex=False), seed=1)
        counted = sum(p.numel() for p in layer.parameters())
        assert layer_parameters(cfg, layer=index) == counted
        experts = sum(p.numel() for p in layer.parameters() if getattr(p, "is_expert", False))
        assert expert_parameters(cfg, index, index + 1) == experts
        assert expert_parameters(cfg, index, index + 1, expert_parallel=2) == experts // 2


@pytest.mark.parametrize("counts", [[0, 5, 0], [2, 0, 3], [0, 0, 0]])
def test_grouped_matmul_with_empty_experts(counts):
    """Experts (or a whole rank) receiving no token: grouped and looped agree, backward too."""
    from megatron_chimera.model.moe.experts import grouped_matmul
    torch.manual_seed(7)
    x = torch.randn(sum(counts), 8, requires_grad=True)
    w = torch.randn(3, 8, 4, requires_grad=True)
    outs, grads = [], []
    for grouped in (True, False):
        out = grouped_matmul(x, w, counts, grouped)
        outs.append(out)
        grads.append(torch.autograd.grad(out.square().sum(), (x, w)))
    torch.testing.assert_close(outs[0], outs[1])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
