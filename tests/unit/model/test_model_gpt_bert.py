"""GPT-2 and BERT: forward/backward, stage slices vs the whole model, init, tied embeddings."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_chimera.config import ConfigError
from megatron_chimera.model.bert import BertModel, build_bert_stage
from megatron_chimera.model.gpt2 import GPTModel, build_gpt_stage
from megatron_chimera.model.linear import WeightGradStore, defer_weight_grad
from megatron_chimera.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron_chimera.tensor_parallel.weight_grad import deferrable_modules
from tests.helpers.models import SEQ, VOCAB, small_config

BATCH = 3


def gpt_batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    return tokens, positions, labels


def bert_batch(seed: int = 0):
    tokens, _, labels = gpt_batch(seed)
    padding = torch.ones(BATCH, SEQ)
    padding[1, SEQ - 5:] = 0
    types = torch.zeros(BATCH, SEQ, dtype=torch.long)
    types[:, SEQ // 2:] = 1
    return tokens, padding, types, labels


def global_name(name: str, layer_offset: int) -> str:
    """Map a slice's local layer index to the whole model's."""
    prefix = "language_model.encoder.layers."
    if not name.startswith(prefix):
        return name
    local, rest = name[len(prefix):].split(".", 1)
    return f"{prefix}{int(local) + layer_offset}.{rest}"


# ----------------------------------------------------------------------------- forward/backward
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gpt_forward_backward(dtype):
    config = small_config(params_dtype=dtype, hidden_dropout=0.1, attention_dropout=0.1)
    model = GPTModel(config)
    tokens, positions, labels = gpt_batch()
    loss = model(tokens, positions, labels=labels)
    assert loss.shape == (BATCH, SEQ) and loss.dtype == torch.float32
    # an untrained model predicts roughly uniformly over the padded vocabulary
    assert abs(loss.mean().item() - math.log(config.padded_vocab_size)) < 0.5
    loss.mean().backward()
    for name, param in model.named_parameters():
        assert param.dtype == config.torch_dtype
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
    logits = model(tokens, positions)
    assert logits.shape == (BATCH, SEQ, config.padded_vocab_size)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_bert_forward_backward(dtype):
    config = small_config(params_dtype=dtype, hidden_dropout=0.1, attention_dropout=0.1)
    model = BertModel(config)
    tokens, padding, types, labels = bert_batch()
    lm_loss, sop_logits = model(tokens, padding, types, labels)
    assert lm_loss.shape == (BATCH, SEQ) and sop_logits.shape == (BATCH, 2)
    (lm_loss.mean() + F.cross_entropy(sop_logits.float(), torch.tensor([0, 1, 0]))).backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
    lm_logits, _ = model(tokens, padding, types)
    assert lm_logits.shape == (BATCH, SEQ, config.padded_vocab_size)


def reference_gpt_loss(model: GPTModel, tokens, positions, labels) -> torch.Tensor:
    """GPT-2 written out with plain tensor ops from the model's weights (an independent check
    of the layer wiring, masks, QKV layout, GeLU and the tied LM head)."""
    params = dict(model.named_parameters())
    cfg = model.config
    heads, hd = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads

    def ln(x, prefix):
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + cfg.layernorm_epsilon) * params[prefix + ".weight"] \
            + params[prefix + ".bias"]

    def lin(x, prefix):
        return x @ params[prefix + ".weight"].T + params[prefix + ".bias"]

    emb = "language_model.embedding."
    x = params[emb + "word_embeddings.weight"][tokens] \
        + params[emb + "position_embeddings.weight"][positions]  # [b, s, h]
    b, s, _ = x.shape
    causal = torch.ones(s, s).tril().bool()
    for i in range(cfg.num_layers):
        p = f"language_model.encoder.layers.{i}."
        qkv = lin(ln(x, p + "input_layernorm"), p + "self_attention.query_key_value")
        qkv = qkv.view(b, s, heads, 3 * hd)
        q, k, v = (t.transpose(1, 2) for t in qkv.split(hd, dim=-1))  # [b, heads, s, hd]
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        context = (probs @ v).transpose(1, 2).reshape(b, s, heads * hd)
        x = x + lin(context, p + "self_attention.dense")
        hidden = lin(ln(x, p + "post_attention_layernorm"), p + "mlp.dense_h_to_4h")
        gelu = 0.5 * hidden * (1 + torch.tanh(math.sqrt(2 / math.pi)
                                              * (hidden + 0.044715 * hidden ** 3)))
        x = x + lin(gelu, p + "mlp.dense_4h_to_h")
    x = ln(x, "language_model.encoder.final_layernorm")
    logits = x @ params[emb + "word_embeddings.weight"].T
    logits[..., cfg.vocab_size:] = float("-inf")  # padded-vocabulary columns take no mass
    return F.cross_entropy(logits.reshape(b * s, -1), labels.reshape(-1),
                           reduction="none").view(b, s)


@pytest.mark.parametrize("fused", [True, False])
def test_gpt_matches_reference_implementation(fused):
    config = small_config(masked_softmax_fusion=fused, bias_gelu_fusion=fused)
    model = GPTModel(config, seed=7)
    tokens, positions, labels = gpt_batch(1)
    expected = reference_gpt_loss(model, tokens, positions, labels)
    torch.testing.assert_close(model(tokens, positions, labels=labels), expected,
                               rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- stage slices
def chain_gpt(stages, tokens, positions, labels):
    """Run stage slices one after another as the pipeline does (each non-first stage gets a
    detached input, as if received); return the last output, all outputs and stage inputs."""
    outputs, inputs, hidden = [], [], None
    for i, stage in enumerate(stages):
        if i > 0:
            hidden = hidden.detach().requires_grad_()
            inputs.append(hidden)
            stage.set_input_tensor(hidden)
        last = i == len(stages) - 1
        hidden = stage(tokens if i == 0 else None, positions if i == 0 else None,
                       labels=labels if last else None)
        outputs.append(hidden)
    return hidden, outputs, inputs


def backward_chain(loss, outputs, inputs) -> None:
    """Backward from the last stage down, each stage fed its successor's input gradient."""
    loss.sum().backward()
    for i in range(len(outputs) - 2, -1, -1):
        outputs[i].backward(inputs[i].grad)


@pytest.mark.parametrize("untied", [False, True])
def test_gpt_stage_slices_equal_whole_model(untied):
    config = small_config(untie_embeddings_and_output_weights=untied)
    partition = [(0, 1), (1, 3), (3, 4)]
    whole = GPTModel(config, seed=11)
    stages = [build_gpt_stage(config, partition, s, seed=11) for s in range(3)]
    tokens, positions, labels = gpt_batch(2)

    # weights: each slice holds exactly the whole model's parameters for its layers
    whole_params = dict(whole.named_parameters())
    for (start, _), stage in zip(partition, stages):
        for name, param in stage.named_parameters():
            if name == "word_embeddings.weight":
                reference = whole.shared_embedding_or_output_weight()
            else:
                reference = whole_params[global_name(name, start)]
            assert torch.equal(param, reference), name

    # forward: chained slices give bit-identical per-token losses
    expected = whole(tokens, positions, labels=labels)
    loss, outputs, inputs = chain_gpt(stages, tokens, positions, labels)
    assert torch.equal(loss, expected)

    # backward: the stage-to-stage gradient hand-off reproduces the whole model's grads
    expected.sum().backward()
    backward_chain(loss, outputs, inputs)
    for (start, _), stage in zip(partition, stages):
        for name, param in stage.named_parameters():
            if name.endswith("word_embeddings.weight") and not untied:
                continue  # tied copies: checked as a sum below
            assert torch.equal(param.grad, whole_params[global_name(name, start)].grad), name
    if not untied:
        # the whole model's tied embedding grad is the sum of the two copies' grads
        total = stages[0].shared_embedding_or_output_weight().grad \
            + stages[-1].shared_embedding_or_output_weight().grad
        torch.testing.assert_close(total, whole.shared_embedding_or_output_weight().grad,
                                   rtol=1e-5, atol=1e-6)


def test_bert_stage_slices_equal_whole_model():
    config = small_config()
    partition = [(0, 2), (2, 4)]
    whole = BertModel(config, seed=5)
    first, last = (build_bert_stage(config, partition, s, seed=5) for s in range(2))
    tokens, padding, types, labels = bert_batch(3)
    expected_lm, expected_sop = whole(tokens, padding, types, labels)
    hidden = first(tokens, padding, types)
    assert hidden.shape == (SEQ, BATCH, config.hidden_size)
    last.set_input_tensor(hidden)
    lm_loss, sop = last(None, padding, None, labels)
    assert torch.equal(lm_loss, expected_lm) and torch.equal(sop, expected_sop)
    assert torch.equal(last.shared_embedding_or_output_weight(),
                       first.shared_embedding_or_output_weight())


def test_shared_embedding_weight_per_stage():
    config = small_config()
    partition = [(0, 1), (1, 3), (3, 4)]
    first, middle, last = (build_gpt_stage(config, partition, s) for s in range(3))
    assert first.shared_embedding_or_output_weight() is \
        first.language_model.embedding.word_embeddings.weight
    assert middle.shared_embedding_or_output_weight() is None
    assert last.shared_embedding_or_output_weight() is last.word_embeddings.weight
    untied = GPTModel(small_config(untie_embeddings_and_output_weights=True))
    assert untied.shared_embedding_or_output_weight() is None
    assert untied.language_model.output_layer.weight.shape == (128, 32)


def test_layer_numbers_are_global():
    stage = build_gpt_stage(small_config(), [(0, 1), (1, 3), (3, 4)], 1)
    assert [layer.layer_number for layer in stage.language_model.encoder.layers] == [2, 3]
    assert stage.language_model.encoder.final_layernorm is None


# ----------------------------------------------------------------------------- initialisation
def test_megatron_init_statistics():
    config = small_config(num_layers=8, hidden_size=128, init_method_std=0.05)
    model = GPTModel(config)
    layer = model.language_model.encoder.layers[3]
    out_std = 0.05 / math.sqrt(2 * 8)
    checks = [(layer.self_attention.query_key_value.weight, 0.05),
              (layer.self_attention.dense.weight, out_std),
              (layer.mlp.dense_h_to_4h.weight, 0.05), (layer.mlp.dense_4h_to_h.weight, out_std),
              (model.language_model.embedding.word_embeddings.weight, 0.05)]
    for weight, std in checks:  # >= 16k samples: the std estimate is within ~1%
        assert abs(weight.std().item() / std - 1) < 0.05
        assert abs(weight.mean().item()) < 5 * std / math.sqrt(weight.numel())  # 5 sigma
    for module in (layer.self_attention.query_key_value, layer.mlp.dense_4h_to_h):
        assert torch.all(module.bias == 0)
    assert torch.all(layer.input_layernorm.weight == 1)
    assert torch.all(layer.input_layernorm.bias == 0)
    # different layers and seeds draw different weights
    other = model.language_model.encoder.layers[4]
    assert not torch.equal(layer.mlp.dense_h_to_4h.weight, other.mlp.dense_h_to_4h.weight)
    reseeded = GPTModel(config, seed=99)
    assert not torch.equal(reseeded.language_model.encoder.layers[3].mlp.dense_h_to_4h.weight,
                           layer.mlp.dense_h_to_4h.weight)


def test_init_is_dtype_independent():
    fp32 = GPTModel(small_config())
    bf16 = GPTModel(small_config(params_dtype="bf16"))
    for (name, a), (_, b) in zip(fp32.named_parameters(), bf16.named_parameters()):
        assert torch.equal(a.to(torch.bfloat16), b), name


def test_linear_layers_are_deferrable():
    model = GPTModel(small_config())
    layer = model.language_model.encoder.layers[0]
    for module, kind in ((layer.self_attention.query_key_value, ColumnParallelLinear),
                         (layer.self_attention.dense, RowParallelLinear),
                         (layer.mlp.dense_h_to_4h, ColumnParallelLinear),
                         (layer.mlp.dense_4h_to_h, RowParallelLinear)):
        assert isinstance(module, kind) and module in deferrable_modules(model)
    tokens, positions, labels = gpt_batch()
    model(tokens, positions, labels=labels).sum().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    store = WeightGradStore()
    with defer_weight_grad(model, store):
        model(tokens, positions, labels=labels).sum().backward()
    assert model.language_model.encoder.layers[0].mlp.dense_h_to_4h.weight.grad is None
    store.flush()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- recomputation
@pytest.mark.parametrize("granularity,method,num", [("full", "uniform", 2), ("full", "block", 1),
                                                    ("full", "uniform", 3), ("selective", None,
                                                                             None)])
def test_recomputation_gives_identical_gradients(granularity, method, num):
    base = small_config(hidden_dropout=0.1, attention_dropout=0.1, masked_softmax_fusion=False)
    recompute = small_config(hidden_dropout=0.1, attention_dropout=0.1, masked_softmax_fusion=False,
                             recompute_granularity=granularity, recompute_method=method,
                             recompute_num_layers=num)
    tokens, positions, labels = gpt_batch()
    grads, losses = [], []
    for config in (base, recompute):
        model = GPTModel(config)
        torch.manual_seed(123)  # same dropout masks in both runs; checkpoint replays the RNG
        loss = model(tokens, positions, labels=labels)
        loss.mean().backward()
        losses.append(loss)
        grads.append([p.grad for p in model.parameters()])
    assert torch.equal(losses[0], losses[1])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("overrides,flag", [
    (dict(recompute_granularity="everything"), "--recompute-granularity"),
    (dict(recompute_granularity="full"), "--recompute-method"),
    (dict(recompute_granularity="full", recompute_method="uniform"), "--recompute-num-layers"),
    (dict(recompute_method="block"), "--recompute-method"),
    (dict(num_attention_heads=5), "--num-attention-heads"),
])
def test_bad_model_flags_are_rejected(overrides, flag):
    with pytest.raises(ConfigError, match=flag):
        GPTModel(small_config(**overrides))


def test_bert_rejects_untied_and_bad_ranges():
    with pytest.raises(ConfigError, match="--untie-embeddings-and-output-weights"):
        BertModel(small_config(untie_embeddings_and_output_weights=True))
    with pytest.raises(ConfigError, match="--num-layers"):
        GPTModel(small_config(), layer_range=(2, 9))
    with pytest.raises(RuntimeError, match="set_input_tensor"):
        GPTModel(small_config(), pre_process=False)(None, None)


def test_padding_mask_hides_padded_tokens():
    """Changing padded tokens must not change the outputs at real tokens (BERT)."""
    model = BertModel(small_config())
    tokens, padding, types, _ = bert_batch()
    out_a, _ = model(tokens, padding, types)
    tokens_b = tokens.clone()
    tokens_b[1, SEQ - 5:] = (tokens_b[1, SEQ - 5:] + 1) % VOCAB
    out_b, _ = model(tokens_b, padding, types)
    torch.testing.assert_close(out_a[1, :SEQ - 5], out_b[1, :SEQ - 5], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out_a[1, SEQ - 5:], out_b[1, SEQ - 5:])


def test_building_a_model_leaves_the_global_rng_alone():
    """Init draws only from its own generators, so dropout streams do not depend on which
    stages a rank happens to build."""
    state = torch.get_rng_state()
    GPTModel(small_config(untie_embeddings_and_output_weights=True))
    BertModel(small_config())
    assert torch.equal(state, torch.get_rng_state())
