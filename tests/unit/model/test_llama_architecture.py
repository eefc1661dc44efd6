"""Today's decoder layers (RoPE, SwiGLU, RMSNorm, grouped-query attention, bias-free, untied)
against an independent reference: transformers' Llama and Qwen2 with the same weights, its RoPE
frequency functions, and hand-written formulas; positions that restart per document; the flags'
rules."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from megatron_chimera.config import ConfigError, ModelConfig
from megatron_chimera.hf import llama
from megatron_chimera.model.architecture import check_architecture
from megatron_chimera.model.fused import RMSNorm
from megatron_chimera.model.gpt2 import GPTModel, build_gpt_stage
from megatron_chimera.model.rotary import RotaryEmbedding, apply_rotary_pos_emb, inverse_frequencies
from megatron_chimera.tensor_parallel.utils import join_shards, shard_of_master
from tests.helpers.hf_models import llama_config, llama_model
from tests.helpers.models import small_config

LLAMA_FLAGS = dict(normalization="RMSNorm", swiglu=True, num_query_groups=2,
                   add_bias_linear=False, position_embedding_type="rope", rotary_base=500000,
                   untie_embeddings_and_output_weights=True, ffn_hidden_size=48)
# fp32 logits of a 2-layer model: summation order differs (fused QKV, SDPA), ~1e-6 observed
LOGIT_ATOL = 1e-4


def _imported(model_type: str, **overrides):
    hf = llama_model(model_type, **overrides)
    config = llama.model_config_from_hf(hf.config, "test", make_vocab_size_divisible_by=64)
    ours = GPTModel(config).eval()
    ours.load_state_dict(llama.state_from_hf(hf.state_dict(), config, "test"), strict=True)
    return hf, config, ours


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral"])
def test_logits_equal_transformers(model_type):
    hf, config, ours = _imported(model_type)
    assert config.query_groups == 2 and config.swiglu and config.normalization == "RMSNorm"
    assert config.untie_embeddings_and_output_weights
    assert config.has_qkv_bias == (model_type == "qwen2")
    ids = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = hf(ids).logits
        mine = ours(ids, torch.arange(24).expand(2, 24))[..., :100]
    assert theirs.abs().max() > 1.0  # not a degenerate comparison
    assert (mine - theirs).abs().max() < LOGIT_ATOL
    # and back: the exported state dict is transformers' exactly
    back = llama.state_to_hf(ours.state_dict(), config)
    reference = hf.state_dict()
    assert set(back) == set(reference)
    assert all(torch.equal(back[k], reference[k]) for k in back)


def test_llama3_rope_positions_beyond_the_scaling_band():
    """Positions up to 60 with base 500000 and the llama3 scaling: the scaled low frequencies
    move the logits measurably, and ours follow transformers'."""
    hf, config, ours = _imported("llama")
    unscaled = GPTModel(config.__class__(**{**config.__dict__, "use_rope_scaling": False}))
    unscaled.load_state_dict(ours.state_dict())
    ids = torch.randint(0, 100, (1, 60), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(60)[None]
    with torch.no_grad():
        theirs = hf(ids).logits
        mine = ours(ids, positions)[..., :100]
        without = unscaled.eval()(ids, positions)[..., :100]
    assert (mine - theirs).abs().max() < LOGIT_ATOL
    assert (without - theirs).abs().max() > 100 * LOGIT_ATOL


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
])
def test_inverse_frequencies_equal_transformers(rope):
    hf = transformers.LlamaConfig(hidden_size=512, num_attention_heads=4,
                                  max_position_embeddings=16384, rope_parameters=rope)
    theirs = LlamaRotaryEmbedding(hf).inv_freq
    config = ModelConfig(hidden_size=512, num_attention_heads=4, position_embedding_type="rope",
                         rotary_base=int(rope["rope_theta"]),
                         use_rope_scaling=rope["rope_type"] == "llama3",
                         rope_scaling_factor=rope.get("factor", 8.0))
    torch.testing.assert_close(inverse_frequencies(config), theirs.float(), rtol=1e-6, atol=0)


def test_rotary_percent_rotates_the_first_channels_by_hand():
    """rotate-half on the first rot = 8 of 16 channels, the rest untouched (by-hand angles)."""
    config = ModelConfig(hidden_size=64, num_attention_heads=4, position_embedding_type="rope",
                         rotary_percent=0.5, rotary_base=100)
    x = torch.randn(1, 1, 5, 16, generator=torch.Generator().manual_seed(0))
    out = apply_rotary_pos_emb(x, RotaryEmbedding(config).tables(5, None, x.device))
    expected = x.clone()
    for p in range(5):
        for i in range(4):  # pairs (i, i + 4) of the 8 rotated channels
            angle = p / 100 ** (2 * i / 8)
            a, b = x[0, 0, p, i], x[0, 0, p, i + 4]
            expected[0, 0, p, i] = a * math.cos(angle) - b * math.sin(angle)
            expected[0, 0, p, i + 4] = b * math.cos(angle) + a * math.sin(angle)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_rotary_tables_cached_and_gathered_for_per_sample_positions():
    rotary = RotaryEmbedding(ModelConfig(position_embedding_type="rope"))
    first = rotary.tables(8, None, torch.device("cpu"))
    assert rotary.tables(6, None, torch.device("cpu")).cos.data_ptr() == first.cos.data_ptr()
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    gathered = rotary.tables(8, positions, torch.device("cpu"))
    assert gathered.cos.shape == (1, 1, 8, first.cos.shape[-1])
    torch.testing.assert_close(gathered.cos[0, 0, 3:], first.cos[:5])


def test_rmsnorm_by_hand_and_in_bf16():
    norm = RMSNorm(8, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 8))
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    expected = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(norm(x), expected)
    bf16 = RMSNorm(8, 1e-6, torch.bfloat16)
    assert bf16(x.bfloat16()).dtype == torch.bfloat16


def test_reset_positions_restart_rope_per_document():
    """With RoPE, a document starting mid-sequence with restarted positions (and a document
    mask) gives the logits of the same document alone at the start."""
    from megatron_chimera.model.document_attention import DocumentMask

    config = small_config(**LLAMA_FLAGS)
    model = GPTModel(config).eval()
    doc = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(3))
    packed = torch.cat([torch.randint(0, 64, (1, 10)), doc], dim=1)
    positions = torch.cat([torch.arange(10), torch.arange(6)])[None]
    documents = torch.cat([torch.zeros(10), torch.ones(6)])[None].long()
    with torch.no_grad():
        alone = model(doc, torch.arange(6)[None])
        together = model(packed, positions, DocumentMask(documents, torch.device("cpu")))
    torch.testing.assert_close(together[:, 10:], alone, rtol=1e-5, atol=1e-5)


def test_stage_slices_take_positions_and_match_the_whole_model():
    """Two stages, the second fed only the hidden states and the positions, equal the whole."""
    config = small_config(**LLAMA_FLAGS)
    whole = GPTModel(config, seed=5).eval()
    first = build_gpt_stage(config, [(0, 2), (2, 4)], 0, seed=5).eval()
    second = build_gpt_stage(config, [(0, 2), (2, 4)], 1, seed=5).eval()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(4))
    positions = torch.cat([torch.arange(8), torch.arange(8)]).expand(2, 16)
    with torch.no_grad():
        second.set_input_tensor(first(ids, positions))
        torch.testing.assert_close(second(None, positions), whole(ids, positions))
        second.set_input_tensor(first(ids, positions))
        assert not torch.allclose(second(None, None), whole(ids, positions))


def test_llama_shapes_and_no_position_table():
    model = GPTModel(small_config(**LLAMA_FLAGS))
    names = dict(model.named_parameters())
    layer = "language_model.encoder.layers.0."
    assert names[layer + "self_attention.query_key_value.weight"].shape == ((4 + 2 * 2) * 8, 32)
    assert names[layer + "mlp.dense_h_to_4h.weight"].shape == (2 * 48, 32)
    assert not any(n.endswith(".bias") for n in names)
    assert "language_model.embedding.position_embeddings.weight" not in names
    assert "language_model.output_layer.weight" in names
    qwen = GPTModel(small_config(**LLAMA_FLAGS, add_qkv_bias=True))
    biases = [n for n, _ in qwen.named_parameters() if n.endswith(".bias")]
    assert biases and all("query_key_value" in n for n in biases)


def test_swiglu_default_ffn_size_is_megatrons():
    assert ModelConfig(hidden_size=4096, num_attention_heads=32, swiglu=True).ffn_size == 10880
    assert ModelConfig(hidden_size=64, swiglu=True, ffn_hidden_size=100).ffn_size == 100


def test_strided_shards_hold_matching_gate_and_up_halves():
    """Partition stride 2: rank r holds [gate_r; up_r]; joining the shards gives the master."""
    master = torch.arange(16.0).reshape(8, 2)  # gate rows 0..3, up rows 4..7
    param = torch.nn.Parameter(torch.empty(4, 2))
    param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, 0, 2
    param.master_size = 8
    shards = [shard_of_master(param, master, rank=r, world_size=2) for r in range(2)]
    torch.testing.assert_close(shards[0], master[[0, 1, 4, 5]])
    torch.testing.assert_close(shards[1], master[[2, 3, 6, 7]])
    torch.testing.assert_close(join_shards(param, shards), master)


@pytest.mark.parametrize("overrides, message", [
    (dict(num_query_groups=3), "--num-query-groups 3 must divide"),
    (dict(rotary_base=500000), "--rotary-base requires --position-embedding-type rope"),
    (dict(use_rope_scaling=True), "--use-rope-scaling requires"),
    (dict(position_embedding_type="rope", rotary_percent=0.1), "--rotary-percent"),
    (dict(num_attention_heads=5), "--hidden-size 64 is not divisible"),
    (dict(normalization="BatchNorm"), "--normalization"),
])
def test_architecture_rules(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_architecture(ModelConfig(**{"hidden_size": 64, "num_attention_heads": 4,
                                          **overrides}))


def test_kv_channels_sets_the_head_dimension():
    config = small_config(**LLAMA_FLAGS, kv_channels=16)
    check_architecture(config)
    model = GPTModel(config)
    qkv = model.language_model.encoder.layers[0].self_attention.query_key_value.weight
    assert qkv.shape == ((4 + 4) * 16, 32)
    ids = torch.randint(0, 64, (1, 16))
    assert model(ids, torch.arange(16)[None]).shape == (1, 16, config.padded_vocab_size)


def test_hf_config_round_trip():
    for model_type in ("llama", "qwen2"):
        hf = llama_config(model_type)
        config = llama.model_config_from_hf(hf, "t", 64)
        again = llama.model_config_from_hf(
            type(hf)(**llama.hf_config_dict(config, model_type, 0)), "t", 64)
        assert again == config


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_precision_runs_close_to_fp32(dtype):
    """The 16-bit model (RMSNorm statistics and RoPE tables in fp32) gives the fp32 loss within
    its rounding (2e-2 relative for a 4-layer model), and its backward reaches every weight."""
    losses = {}
    for precision in ("fp32", dtype):
        model = GPTModel(small_config(**LLAMA_FLAGS, params_dtype=precision), seed=3)
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
        loss = model(ids, torch.arange(16).expand(2, 16), labels=ids).float().mean()
        loss.backward()
        assert all(p.grad is not None and p.grad.dtype == model.config.torch_dtype
                   for p in model.parameters())
        losses[precision] = loss.item()
    assert abs(losses[dtype] - losses["fp32"]) < 2e-2 * losses["fp32"]


def test_flop_count_equals_torch_flop_counter():
    """model/flops.py's forward count of a Llama-shaped model (GQA's smaller K/V, SwiGLU's three
    matrices, the untied head over the padded vocabulary) equals what torch's FLOP counter sees
    in the unfused forward (every matmul)."""
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_chimera.model.family import GPT2
    from megatron_chimera.model.flops import stage_forward_flops

    config = small_config(**LLAMA_FLAGS, kv_channels=16, masked_softmax_fusion=False)
    model = GPTModel(config).eval()
    ids = torch.randint(0, 64, (2, config.seq_length))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(ids, torch.arange(config.seq_length).expand(2, -1))
    weights, attention = stage_forward_flops(config, GPT2, config.num_layers, True, 2)
    assert weights + attention == counter.get_total_flops()


@pytest.mark.parametrize("overrides", [LLAMA_FLAGS, {**LLAMA_FLAGS, "add_qkv_bias": True,
                                                     "kv_channels": 16},
                                       {**LLAMA_FLAGS, "normalization": "LayerNorm",
                                        "add_bias_linear": True}])
def test_parameter_count_equals_the_model(overrides):
    from megatron_chimera.model.family import GPT2
    from megatron_chimera.model.partition import count_parameters

    config = small_config(**overrides)
    assert count_parameters(config, GPT2) == sum(p.numel() for p in GPTModel(config).parameters())


@pytest.mark.parametrize("overrides", [
    dict(masked_softmax_fusion=False), dict(masked_softmax_fusion=False, params_dtype="bf16"),
    dict(masked_softmax_fusion=True, attention_dropout=0.0, params_dtype="bf16"),
])
def test_memory_estimates_match_measured_bytes(overrides):
    """The memory model's per-stage figures for a Llama-shaped model (SwiGLU keeps gate and up;
    no position table; RMSNorm) against the tensors autograd really saves (within 10 %, as for
    GPT-2)."""
    import functools

    from megatron_chimera.model.family import GPT2
    from megatron_chimera.model.memory import estimate_stage_memory
    from tests.unit.model.test_partition import measured_activation_bytes, run_stage, small

    config = small(**{**LLAMA_FLAGS, "ffn_hidden_size": 176, **overrides})
    partition = [(0, 2), (2, 4)]
    estimates = estimate_stage_memory(config, GPT2, partition, micro_batch_size=2,
                                      device_type="cpu")
    for stage in (0, 1):
        module = build_gpt_stage(config, partition, stage)
        estimate = estimates[stage]
        assert estimate.param_bytes == sum(p.numel() * config.torch_dtype.itemsize
                                           for p in module.parameters())
        module.set_input_tensor(torch.randn(32, 2, 64, dtype=config.torch_dtype))
        measured = measured_activation_bytes(
            module, functools.partial(run_stage, module, GPT2, stage == 0))
        assert abs(estimate.activation_bytes / measured - 1) < 0.10, (stage, measured,
                                                                       estimate.activation_bytes)


def test_fused_and_unfused_paths_agree():
    """SDPA vs the unfused softmax (grouped heads, RoPE), and the output biases left to the
    unfused bias-dropout-add (every linear with a bias): same logits within fp32 rounding."""
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(6))
    positions = torch.arange(16).expand(2, 16)
    outputs = []
    for overrides in (dict(), dict(masked_softmax_fusion=False, bias_dropout_fusion=False)):
        config = small_config(**{**LLAMA_FLAGS, "add_bias_linear": True}, **overrides)
        model = GPTModel(config, seed=2).eval()
        with torch.no_grad():
            for p in model.parameters():  # non-zero biases
                p.add_(0.05)
            outputs.append(model(ids, positions))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)


def test_no_position_embedding_type_none():
    """``--position-embedding-type none``: no table, no rotation; only the causal mask orders the
    tokens: in one layer, swapping two earlier tokens leaves a later one's logits unchanged
    (its attention sees the same set of keys)."""
    model = GPTModel(small_config(position_embedding_type="none", num_layers=1)).eval()
    assert model.language_model.embedding.position_embeddings is None
    assert model.language_model.encoder.rotary is None
    ids = torch.tensor([[3, 4, 5, 6]])
    swapped = torch.tensor([[4, 3, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids, None)[:, 3], model(swapped, None)[:, 3])
        assert not torch.allclose(model(ids, None)[:, 1], model(swapped, None)[:, 1])
