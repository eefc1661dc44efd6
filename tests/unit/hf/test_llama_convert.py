"""Llama, Mistral and Qwen2 through ``import-hf`` / ``export-hf``: a random small model (4 heads,
2 KV heads, SwiGLU, RMSNorm, RoPE base 500000 with Llama 3.1's scaling, untied) imported gives
transformers' logits within 1e-4 (fp32) and its greedy generation token for token (our KV cache
holds the KV heads only); the fast tokenizer travels with the checkpoint as HuggingFaceTokenizer;
export -> ``from_pretrained`` gives the same logits; a sliding window is refused."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_chimera.hf.common import HFError
from megatron_chimera.hf.convert import export_hf, import_hf
from megatron_chimera.inference.generation import KVCache, SamplingParams, forward_cached, generate
from megatron_chimera.inference.loader import load_model, load_tokenizer
from tests.helpers.hf_models import save_llama, transformers

LOGIT_ATOL = 1e-4  # fp32, 2 layers: ~1e-6 observed (summation order)
VOCAB = 300  # the byte-level BPE needs its 256 bytes


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def imported(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    hf = save_llama(root / "hf", request.param, vocab_size=VOCAB)
    result = import_hf(str(root / "hf"), str(root / "ckpt"), make_vocab_size_divisible_by=64,
                       verify=True)
    return request.param, hf, result, root


def test_import_gives_transformers_logits(imported):
    model_type, hf, result, root = imported
    assert result.agreement.max_abs_logit_diff < LOGIT_ATOL
    config = result.model_config
    assert (config.query_groups, config.swiglu, config.normalization) == (2, True, "RMSNorm")
    assert config.use_rope_scaling == (model_type == "llama")
    loaded = load_model(str(root / "ckpt"))
    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = loaded.model(tokens, torch.arange(40).expand(2, 40))[..., :VOCAB]
        theirs = hf(tokens).logits
    assert (ours - theirs).abs().max() < LOGIT_ATOL


def test_greedy_generation_equals_transformers_with_a_kv_cache_of_kv_heads(imported):
    _, hf, _, root = imported
    model = load_model(str(root / "ckpt")).model
    prompt = [0, 5, 17, 33, 2]
    new = generate(model, prompt, 20, SamplingParams(greedy=True))
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 5, dtype=torch.long),
                          max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert new == ref[0, 5:].tolist()
    assert len(set(new)) > 1
    cache = KVCache(2)
    forward_cached(model, torch.tensor([prompt]), cache)
    assert cache.keys[0].shape == (1, 2, 5, 8)  # 2 KV heads of dimension 32 / 4


def test_the_fast_tokenizer_travels_with_the_checkpoint(imported):
    _, _, result, root = imported
    assert result.tokenizer.tokenizer_type == "HuggingFaceTokenizer"
    ours = load_tokenizer(load_model(str(root / "ckpt")))
    theirs = transformers.AutoTokenizer.from_pretrained(root / "hf")
    text = "the king shall speak and the fool laughs"
    assert ours.tokenize(text) == theirs(text).input_ids
    assert ours.tokenize(text)[0] == 0  # the BOS its post-processor adds
    assert ours.detokenize(ours.tokenize(text)[1:]) == text
    assert ours.eod == theirs.eos_token_id == 1


def test_export_loads_in_transformers_with_equal_logits(imported, tmp_path):
    model_type, hf, _, root = imported
    result = export_hf(str(root / "ckpt"), str(tmp_path / "out"))
    assert result.architecture == hf.config.architectures[0]
    assert result.agreement.max_abs_logit_diff < LOGIT_ATOL
    assert "tokenizer.json" in result.files
    again = type(hf).from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    reference = hf.state_dict()
    assert all(torch.equal(again.state_dict()[k], reference[k]) for k in reference)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["num_key_value_heads"] == 2 and config["model_type"] == model_type
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tokenizer("the queen").input_ids == transformers.AutoTokenizer.from_pretrained(
        root / "hf")("the queen").input_ids


def test_mistral_round_trip_and_sliding_window_refused(tmp_path):
    save_llama(tmp_path / "hf", "mistral", tokenizer=False)
    result = import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), verify=True)
    assert result.agreement.max_abs_logit_diff < LOGIT_ATOL
    out = export_hf(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    assert out.architecture == "MistralForCausalLM"
    assert out.agreement.max_abs_logit_diff < LOGIT_ATOL
    save_llama(tmp_path / "windowed", "mistral", tokenizer=False, sliding_window=16)
    with pytest.raises(HFError, match="sliding_window = 16"):
        import_hf(str(tmp_path / "windowed"), str(tmp_path / "ckpt2"))


def test_unsupported_rope_scaling_refused(tmp_path):
    save_llama(tmp_path / "hf", "llama", tokenizer=False,
               rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(HFError, match="rope_scaling type 'linear'"):
        import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))


def test_training_flags_must_match_the_imported_architecture(imported):
    import dataclasses

    from megatron_chimera.checkpoint.saved_args import check_model_matches_checkpoint
    from megatron_chimera.config import ConfigError

    _, _, result, root = imported
    good = result.model_config
    check_model_matches_checkpoint(str(root / "ckpt"), good)
    for change, flag in ((dict(num_query_groups=None), "--num-query-groups"),
                         (dict(swiglu=False), "--swiglu"),
                         (dict(normalization="LayerNorm"), "--normalization"),
                         (dict(position_embedding_type="learned_absolute"),
                          "--position-embedding-type"),
                         (dict(rotary_base=12345), "--rotary-base")):
        with pytest.raises(ConfigError, match=flag):
            check_model_matches_checkpoint(str(root / "ckpt"), dataclasses.replace(good, **change))


def test_export_refuses_a_model_transformers_has_no_architecture_for():
    from megatron_chimera.config import ModelConfig
    from megatron_chimera.hf import gpt2

    odd = ModelConfig(normalization="RMSNorm")  # learned positions with RMSNorm: neither family
    with pytest.raises(HFError, match="neither GPT-2-shaped"):
        gpt2.state_to_hf({}, odd)
    with pytest.raises(HFError, match="not LlamaForCausalLM-shaped"):
        from megatron_chimera.hf import llama

        llama.hf_config_dict(ModelConfig(position_embedding_type="rope"), "llama", None)


def test_perplexity_equals_transformers(imported):
    """tools/evaluate.py's sliding-window perplexity of the imported model equals transformers'
    per-token negative log-likelihoods (each token with the context its window gives it)."""
    import torch.nn.functional as F

    from megatron_chimera.inference.evaluation import perplexity, sliding_windows

    _, hf, _, root = imported
    model = load_model(str(root / "ckpt")).model
    stream = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    result = perplexity(model, stream, 8, 3, batch_size=2)
    expected = 0.0
    for win in sliding_windows(len(stream), 8, 3):
        for t in range(win.first_target, win.end):
            with torch.no_grad():
                logits = hf(input_ids=torch.tensor([stream[win.begin:t]])).logits[0, -1]
            expected -= float(F.log_softmax(logits.double(), -1)[stream[t]])
    assert result["tokens_scored"] == 29
    assert abs(result["nll_sum"] - expected) <= 1e-4 * 29
