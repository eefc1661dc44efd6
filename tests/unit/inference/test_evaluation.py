"""Evaluation: sliding windows score every token once; perplexity equals transformers' token by
token; LAMBADA accuracy and target perplexity equal transformers' greedy predictions."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_chimera.config import ConfigError
from megatron_chimera.inference.evaluation import (
    lambada_accuracy,
    lambada_example,
    perplexity,
    sliding_windows,
)
from tests.helpers.hf_models import SMALL_GPT2_VOCAB as VOCAB


@pytest.mark.parametrize("n,window,stride", [(50, 8, 1), (50, 8, 3), (50, 8, 7), (5, 8, 4),
                                             (33, 32, 16)])
def test_windows_score_each_token_once_with_enough_context(n, window, stride):
    scored = []
    for win in sliding_windows(n, window, stride):
        assert win.end - win.begin <= window
        for t in range(win.first_target, win.end):
            scored.append(t)
            assert t - win.begin >= min(window - stride, t)  # context tokens before t
    assert scored == list(range(1, n))


def test_bad_stride_names_the_flag():
    with pytest.raises(ConfigError, match="--stride"):
        sliding_windows(10, 8, 8)


def hf_nll(hf, context: list[int], target: int) -> float:
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([context])).logits[0, -1]
    return -float(F.log_softmax(logits.double(), -1)[target])


@pytest.mark.parametrize("window,stride", [(8, 1), (32, 31)])
def test_perplexity_equals_transformers_token_by_token(models, window, stride):
    hf, ours = models
    stream = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    result = perplexity(ours, stream, window, stride, batch_size=3)
    # independent reference: token t with exactly the context its window gives it
    expected = 0.0
    for win in sliding_windows(len(stream), window, stride):
        for t in range(win.first_target, win.end):
            expected += hf_nll(hf, stream[win.begin:t], stream[t])
    assert result["tokens_scored"] == 39
    assert abs(result["nll_sum"] - expected) <= 1e-4 * 39
    assert abs(result["perplexity"] - math.exp(expected / 39)) <= 1e-4 * result["perplexity"]
    if stride == 1:  # each token after the first 7 sees exactly the 7 before it
        ref = sum(hf_nll(hf, stream[max(0, t - 7):t], stream[t]) for t in range(1, 40))
        assert abs(result["nll_sum"] - ref) <= 1e-4 * 39


def test_lambada_accuracy_equals_transformers_greedy(models):
    hf, ours = models
    generator = torch.Generator().manual_seed(4)
    examples, expected_correct, expected_nll = [], 0, 0.0
    for i in range(10):
        context = torch.randint(0, VOCAB, (5 + i,), generator=generator).tolist()
        with torch.no_grad():
            best = int(hf(input_ids=torch.tensor([context])).logits[0, -1].argmax())
        target = best if i % 2 == 0 else (best + 1) % VOCAB  # half right, half wrong
        text = " ".join(map(str, context + [target]))
        examples.append(lambada_example(text, lambda s: [int(x) for x in s.split()]))
        expected_correct += target == best
        expected_nll += hf_nll(hf, context, target)
    result = lambada_accuracy(ours, examples, max_length=32, batch_size=4)
    assert result["correct"] == expected_correct == 5 and result["accuracy"] == 0.5
    assert abs(result["target_nll_mean"] - expected_nll / 10) <= 1e-4


def test_lambada_example_splits_off_the_last_word():
    context, target = lambada_example("  the king shall speak  ", lambda s: [len(s)])
    assert context == [len("the king shall")] and target == [len(" speak")]
    with pytest.raises(ConfigError):
        lambada_example("alone", lambda s: [1])
