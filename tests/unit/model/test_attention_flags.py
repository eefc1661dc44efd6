"""--use-flash-attn, the --no-*-fusion flags and the fp32-softmax / layer-scaling notices.

The unfused paths are independent compositions of element-wise ops and matmuls; they must give
the fused model's losses and gradients to fp32 round-off (2e-5 relative: different summation
order in the softmax, GeLU and bias additions over a 3-layer model).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from megatron_chimera.config import ConfigError, ModelConfig
from megatron_chimera.model import fused
from megatron_chimera.model.bert import BertModel
from megatron_chimera.model.gpt2 import GPTModel
from megatron_chimera.model.linear import WeightGradStore, defer_weight_grad
from tests.helpers.models import small_config

LOGGER = "megatron_chimera.model.fused"


@pytest.fixture(autouse=True)
def fresh_notices():
    fused._NOTICES.clear()
    yield
    fused._NOTICES.clear()


def _config(**overrides) -> ModelConfig:
    return small_config(**{"num_layers": 3, "vocab_size": 60, **overrides})


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 60, (3, 16), generator=g)
    labels = torch.randint(0, 60, (3, 16), generator=g)
    return tokens, torch.arange(16).expand(3, 16), labels


def _loss_and_grads(model, *inputs):
    loss = model(*inputs)
    loss = (loss[0] if isinstance(loss, tuple) else loss).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


@pytest.mark.parametrize("flag", ["masked_softmax_fusion", "bias_gelu_fusion",
                                  "bias_dropout_fusion"])
def test_unfused_paths_equal_fused(flag):
    tokens, positions, labels = _batch()
    ref_loss, ref_grads = _loss_and_grads(GPTModel(_config(), seed=3), tokens, positions, None,
                                          labels)
    loss, grads = _loss_and_grads(GPTModel(_config(**{flag: False}), seed=3), tokens, positions,
                                  None, labels)
    torch.testing.assert_close(loss, ref_loss, rtol=2e-5, atol=2e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=2e-5, atol=2e-5)
    # BERT (padding mask through the masked softmax) as well
    padding = torch.ones(3, 16)
    padding[1, 11:] = 0
    types = torch.zeros(3, 16, dtype=torch.long)
    bert_ref, bert_ref_grads = _loss_and_grads(BertModel(_config(), seed=3), tokens, padding,
                                               types, labels)
    bert, bert_grads = _loss_and_grads(BertModel(_config(**{flag: False}), seed=3), tokens,
                                       padding, types, labels)
    torch.testing.assert_close(bert, bert_ref, rtol=2e-5, atol=2e-5)
    assert bert_grads.keys() == bert_ref_grads.keys()
    for name, grad in bert_grads.items():
        torch.testing.assert_close(grad, bert_ref_grads[name], rtol=2e-5, atol=2e-5)


def test_no_bias_dropout_fusion_leaves_the_bias_to_bias_dropout_add():
    """Fused (default): the output projections add their bias in Linear, so a split backward
    defers the bias gradient to W. Unfused: residual + dropout(x + bias) in separate ops, so the
    bias gradient comes from autograd in B."""
    tokens, positions, labels = _batch(1)
    for fusion, bias_grad_in_b in ((True, False), (False, True)):
        model = GPTModel(_config(bias_dropout_fusion=fusion), seed=2)
        store = WeightGradStore()
        with defer_weight_grad(model, store):
            model(tokens, positions, None, labels).sum().backward()
        layer = model.language_model.encoder.layers[0]
        for linear in (layer.self_attention.dense, layer.mlp.dense_4h_to_h):
            assert (linear.bias.grad is not None) == bias_grad_in_b
            assert linear.weight.grad is None  # the weight gradient waits for W either way
        store.flush()
        assert layer.mlp.dense_4h_to_h.weight.grad is not None


def test_use_flash_attn_on_cpu_warns_once_and_changes_nothing(caplog):
    tokens, positions, labels = _batch(2)
    plain = GPTModel(_config(), seed=4)(tokens, positions, None, labels)
    model = GPTModel(_config(use_flash_attn=True), seed=4)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        out = model(tokens, positions, None, labels)
        model(tokens, positions, None, labels)
    messages = [r.getMessage() for r in caplog.records if "--use-flash-attn" in r.getMessage()]
    assert len(messages) == 1 and "no effect on the CPU" in messages[0]
    torch.testing.assert_close(out, plain, rtol=0, atol=0)


def test_flash_only_sdpa_names_the_reason():
    """The flash/memory-efficient restriction (what --use-flash-attn does on CUDA): a
    configuration without such a kernel is a ConfigError naming the flag and torch's reason.
    On the CPU SDPA's flash kernel takes no dropout, so dropout shows the error path."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 16, generator=g) for _ in range(3))
    out = fused.sdpa(q, k, v, None, 0.0, True, flash_only=True)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    with pytest.warns(UserWarning), pytest.raises(
            ConfigError, match=r"--use-flash-attn: .*dropout 0.1.*do not support non-zero dropout"):
        fused.sdpa(q, k, v, None, 0.1, True, flash_only=True)


@pytest.mark.parametrize("flag", ["attention_softmax_in_fp32", "apply_query_key_layer_scaling"])
def test_fp32_softmax_flags_warn_once_on_the_fused_16_bit_path(flag, caplog):
    tokens, positions, labels = _batch(3)
    cli = "--" + flag.replace("_", "-")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        model = GPTModel(_config(params_dtype="bf16", **{flag: True}), seed=1)
        model(tokens, positions, None, labels)
        model(tokens, positions, None, labels)
    assert [r.getMessage() for r in caplog.records if cli in r.getMessage()] == [
        f"warning: {cli} has no effect on the fused attention path: "
        "scaled_dot_product_attention's fused kernels compute the scores and softmax in fp32 "
        "internally (layer scaling only guards an fp16 softmax); add --no-masked-softmax-fusion "
        "for Megatron's unfused softmax, which honours it"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):  # the unfused path honours it
        GPTModel(_config(params_dtype="bf16", masked_softmax_fusion=False, **{flag: True}),
                 seed=1)(tokens, positions, None, labels)
    assert not caplog.records
