"""Mixtral and Qwen2-MoE through ``import-hf`` / ``export-hf`` against ``transformers`` itself
(random tiny models built here, every weight perturbed so routing varies per token): logits within
1e-5 (fp32), greedy generation token for token, export -> ``from_pretrained`` with bit-identical
weights. Qwen2-MoE covers a dense layer (``mlp_only_layers``), the sigmoid-gated shared expert
(``--moe-shared-expert-gate``) and both routings (``norm_topk_prob`` false = Megatron's
``--moe-router-pre-softmax``, true = the default softmax over the top-k logits). Settings we do
not reproduce are refused by name."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from megatron_chimera.config import ConfigError, ModelConfig, MoEConfig
from megatron_chimera.hf import moe as hf_moe
from megatron_chimera.hf.common import HFError
from megatron_chimera.hf.convert import export_hf, import_hf
from megatron_chimera.inference.generation import SamplingParams, generate
from megatron_chimera.inference.loader import load_model
from megatron_chimera.model.partition import count_parameters
from tests.helpers.hf_models import save_moe, transformers

LOGIT_ATOL = 1e-5  # fp32, 2-3 layers: ~3e-6 observed (summation order; top-k ties never occur)
VOCAB = 300  # the byte-level BPE needs its 256 bytes
CASES = {"mixtral": ("mixtral", {}),
         "qwen2_moe": ("qwen2_moe", dict(num_hidden_layers=3, mlp_only_layers=[1]))}


@pytest.fixture(scope="module", params=sorted(CASES))
def imported(request, tmp_path_factory):
    model_type, overrides = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    hf = save_moe(root / "hf", model_type, vocab_size=VOCAB, tokenizer=True, **overrides)
    result = import_hf(str(root / "hf"), str(root / "ckpt"), make_vocab_size_divisible_by=64,
                       verify=True)
    return model_type, hf, result, root


def test_import_gives_transformers_logits(imported):
    model_type, hf, result, root = imported
    assert result.agreement.max_abs_logit_diff < LOGIT_ATOL
    moe = result.model_config.moe
    assert (moe.num_experts, moe.moe_router_topk) == (4, 2)
    if model_type == "qwen2_moe":
        assert moe.moe_layer_freq == "[1,0,1]" and moe.moe_router_pre_softmax
        assert (moe.moe_shared_expert_intermediate_size, moe.moe_shared_expert_gate) == (24, True)
        assert result.model_config.add_qkv_bias
    loaded = load_model(str(root / "ckpt"))
    model = loaded.model
    assert sum(p.numel() for p in model.parameters()) == count_parameters(result.model_config)
    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens, torch.arange(40).expand(2, 40))[..., :VOCAB]
        theirs = hf(tokens).logits
    assert (ours - theirs).abs().max() < LOGIT_ATOL
    # the routing is not degenerate: every expert of the first MoE layer takes tokens
    router = model.language_model.encoder.layers[0].mlp.router
    hidden = torch.randn(80, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, routing_map = router(hidden, 40)
    assert bool(routing_map.any(dim=0).all())


def test_greedy_generation_equals_transformers(imported):
    _, hf, _, root = imported
    model = load_model(str(root / "ckpt")).model
    prompt = [0, 5, 17, 33, 2]
    new = generate(model, prompt, 16, SamplingParams(greedy=True))
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 5, dtype=torch.long),
                          max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert new == ref[0, 5:].tolist()
    assert len(set(new)) > 1


def test_export_loads_in_transformers_with_identical_weights(imported, tmp_path):
    model_type, hf, _, root = imported
    result = export_hf(str(root / "ckpt"), str(tmp_path / "out"))
    assert result.architecture == hf.config.architectures[0]
    assert result.agreement.max_abs_logit_diff < LOGIT_ATOL
    again = type(hf).from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    reference = hf.state_dict()
    assert again.state_dict().keys() == reference.keys()
    assert all(torch.equal(again.state_dict()[k], reference[k]) for k in reference)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == model_type
    assert again.config.num_experts_per_tok == 2
    if model_type == "qwen2_moe":
        assert again.config.mlp_only_layers == [1] and not again.config.norm_topk_prob


def test_qwen2_moe_renormalised_top_k_is_the_default_softmax_routing(tmp_path):
    hf = save_moe(tmp_path / "hf", "qwen2_moe", vocab_size=VOCAB, norm_topk_prob=True, seed=1)
    result = import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), verify=True)
    assert not result.model_config.moe.moe_router_pre_softmax
    assert result.agreement.max_abs_logit_diff < LOGIT_ATOL
    out = export_hf(str(tmp_path / "ckpt"), str(tmp_path / "out"), verify=False)
    again = type(hf).from_pretrained(tmp_path / "out")
    assert again.config.norm_topk_prob
    # and exported as Mixtral the same weights are refused (Mixtral has no shared expert)
    with pytest.raises(HFError, match="Mixtral has no shared expert"):
        export_hf(str(tmp_path / "ckpt"), str(tmp_path / "mixtral"), model_type="mixtral")
    assert out.architecture == "Qwen2MoeForCausalLM"


def test_unmatched_settings_are_refused_by_name(tmp_path):
    save_moe(tmp_path / "jitter", "mixtral", router_jitter_noise=0.1)
    with pytest.raises(HFError, match="router_jitter_noise = 0.1"):
        import_hf(str(tmp_path / "jitter"), str(tmp_path / "c1"))
    save_moe(tmp_path / "window", "mixtral", sliding_window=16)
    with pytest.raises(HFError, match="sliding_window = 16"):
        import_hf(str(tmp_path / "window"), str(tmp_path / "c2"))
    qwen3 = transformers.Qwen3MoeConfig(
        vocab_size=100, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64)
    transformers.Qwen3MoeForCausalLM(qwen3).save_pretrained(tmp_path / "qwen3")
    with pytest.raises(HFError, match="q_norm / k_norm"):
        import_hf(str(tmp_path / "qwen3"), str(tmp_path / "c3"))


def test_export_refuses_routing_transformers_does_not_have():
    base = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, normalization="RMSNorm",
                       swiglu=True, add_bias_linear=False, position_embedding_type="rope",
                       untie_embeddings_and_output_weights=True,
                       moe=MoEConfig(num_experts=4, moe_router_topk=2))
    hf_moe.hf_config_dict(base, "mixtral", None)  # the plain Mixtral shape is fine
    for change, message in ((dict(moe_router_score_function="sigmoid"), "sigmoid"),
                            (dict(moe_expert_capacity_factor=1.0), "capacity-factor"),
                            (dict(moe_router_pre_softmax=True), "pre-softmax"),
                            (dict(moe_layer_freq=2), "dense layers")):
        odd = dataclasses.replace(base, moe=dataclasses.replace(base.moe, **change))
        with pytest.raises(HFError, match=message):
            hf_moe.hf_config_dict(odd, "mixtral", None)
    with pytest.raises(HFError, match="shared expert with its gate"):
        hf_moe.hf_config_dict(base, "qwen2_moe", None)
    ungated = dataclasses.replace(base, moe=dataclasses.replace(
        base.moe, moe_shared_expert_intermediate_size=24))
    with pytest.raises(HFError, match="--moe-shared-expert-gate"):
        hf_moe.hf_config_dict(ungated, "qwen2_moe", None)


def test_shared_expert_gate_needs_a_shared_expert_and_is_part_of_the_checkpoint(imported):
    from megatron_chimera.checkpoint.saved_args import check_model_matches_checkpoint
    from megatron_chimera.model.moe.layer import MoELayer

    config = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                         moe=MoEConfig(num_experts=4, moe_shared_expert_gate=True))
    with pytest.raises(ConfigError, match="--moe-shared-expert-gate needs"):
        MoELayer(config, 1, seed=0)
    model_type, _, result, root = imported
    if model_type == "qwen2_moe":
        good = result.model_config
        ungated = dataclasses.replace(good, moe=dataclasses.replace(
            good.moe, moe_shared_expert_gate=False))
        with pytest.raises(ConfigError, match="--moe-shared-expert-gate"):
            check_model_matches_checkpoint(str(root / "ckpt"), ungated)


def test_the_printed_training_flags_build_the_imported_model(imported):
    """``import-hf`` prints ``model_flags`` of the import: parsed by the training parser they give
    the same MoE configuration, which the checkpoint accepts."""
    from megatron_chimera.checkpoint.saved_args import check_model_matches_checkpoint
    from megatron_chimera.model.flags import model_flags
    from megatron_chimera.training.arguments import parse_args

    _, _, result, root = imported
    imported_config = result.model_config
    argv = model_flags(imported_config, seq_length=imported_config.max_positions)
    config = parse_args([*argv, "--mock-data", "--train-iters", "1", "--lr", "1e-4",
                         "--micro-batch-size", "1", "--vocab-size", str(VOCAB),
                         "--make-vocab-size-divisible-by", "64"], world_size=1)
    assert config.model.moe == imported_config.moe
    check_model_matches_checkpoint(str(root / "ckpt"), config.model)


def test_export_megatron_refuses_a_moe_checkpoint_before_writing_anything(imported, tmp_path):
    from megatron_chimera.checkpoint.megatron_format import MegatronCheckpointError
    from megatron_chimera.megatron_lm.exporter import export_megatron

    _, _, _, root = imported
    with pytest.raises(MegatronCheckpointError) as info:
        export_megatron(str(root / "ckpt"), str(tmp_path / "megatron"))
    assert "mixture-of-experts model (4 experts)" in str(info.value)
    assert "\n" not in str(info.value) and not (tmp_path / "megatron").exists()
