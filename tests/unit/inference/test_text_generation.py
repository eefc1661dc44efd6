"""Generation: the KV-cached path equals the full forward, greedy decoding equals transformers'
``generate``, and the temperature / top-k / top-p filters equal transformers' logits warpers."""

from __future__ import annotations

import pytest
import torch

from megatron_chimera.config import ConfigError
from megatron_chimera.hf.convert import import_hf
from megatron_chimera.inference.generation import (
    KVCache,
    SamplingParams,
    filter_logits,
    forward_cached,
    generate,
)
from megatron_chimera.inference.loader import load_model
from tests.helpers.hf_models import SMALL_GPT2_VOCAB as VOCAB
from tests.helpers.hf_models import transformers


def test_cached_decoding_equals_full_forward(models):
    _, ours = models
    tokens = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = ours(tokens, torch.arange(20).expand(2, 20))
    cache = KVCache(4)
    pieces = [forward_cached(ours, tokens[:, :7], cache)]  # prefill, then one token at a time
    for i in range(7, 20):
        pieces.append(forward_cached(ours, tokens[:, i:i + 1], cache))
    cached = torch.cat(pieces, dim=1)
    assert cache.length == 20
    assert (cached[..., :VOCAB] - full[..., :VOCAB]).abs().max() <= 1e-5
    assert torch.isneginf(cached[..., VOCAB:]).all()


@pytest.mark.parametrize("prompt_len", [1, 9])
def test_greedy_generation_equals_transformers_generate(models, prompt_len):
    hf, ours = models
    prompt = torch.randint(0, VOCAB, (1, prompt_len),
                           generator=torch.Generator().manual_seed(prompt_len)).tolist()[0]
    new = generate(ours, prompt, 20, SamplingParams(greedy=True))
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, prompt_len,
                                                                            dtype=torch.long),
                          max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert new == ref[0, prompt_len:].tolist()
    assert len(set(new)) > 1  # not a degenerate repetition that anything would reproduce


def test_sampling_with_a_seed_equals_transformers_sampling(models, tmp_path):
    # torch.multinomial draws one random number per vocabulary column, so the random streams
    # line up only over the same number of columns: import this one unpadded (300 % 4 == 0)
    hf, _ = models
    hf.save_pretrained(tmp_path / "hf")
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), make_vocab_size_divisible_by=4)
    ours = load_model(str(tmp_path / "ckpt")).model
    prompt = [5, 17, 42]
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9)
    new = generate(ours, prompt, 15, params, torch.Generator().manual_seed(123))
    again = generate(ours, prompt, 15, params, torch.Generator().manual_seed(123))
    torch.manual_seed(123)  # transformers samples from the global generator
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 3,
                                                                            dtype=torch.long),
                          max_new_tokens=15, do_sample=True, temperature=0.8, top_k=50,
                          top_p=0.9, eos_token_id=None, pad_token_id=0)
    assert new == again == ref[0, 3:].tolist()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0),
                                                      (1.3, 0, 0.6), (0.5, 20, 0.3)])
def test_filters_equal_transformers_warpers(temperature, top_k, top_p):
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(top_k)) * 3
    expected = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1.0:
        expected = TopPLogitsWarper(top_p)(None, expected)
    got = filter_logits(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    finite = torch.isfinite(expected)
    assert torch.allclose(got[finite], expected[finite])
    if top_k or top_p < 1.0:
        assert torch.isinf(got).any()


def test_generation_stops_at_the_stop_token_and_checks_length(models):
    _, ours = models
    full = generate(ours, [1, 2, 3], 10, SamplingParams(greedy=True))
    stopped = generate(ours, [1, 2, 3], 10, SamplingParams(greedy=True), stop_token=full[4])
    assert stopped == full[:full.index(full[4])]
    with pytest.raises(ConfigError, match="--max-new-tokens"):
        generate(ours, [1] * 30, 5, SamplingParams(greedy=True))


@pytest.mark.parametrize("kwargs,flag", [(dict(temperature=0.0), "--temperature"),
                                         (dict(top_k=-1), "--top-k"),
                                         (dict(top_p=1.5), "--top-p")])
def test_bad_sampling_settings_name_the_flag(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        SamplingParams(**kwargs)


def test_transformers_is_the_reference():
    assert transformers.__version__
