"""Zero-shot evaluation of a GPT model: sliding-window perplexity and LAMBADA last-word accuracy.

Perplexity: the token stream is cut into windows of ``window`` tokens whose starts are ``stride``
apart; every token after the first is scored exactly once, in the first window where it is new,
with all the window's earlier tokens as context (so at least ``window - stride`` of them once past
the start). LAMBADA (strict, as Megatron's ``zeroshot_gpt``): the context is the text before the
last word, the target is the tokens of ``" " + last word``; an example is correct when greedy
prediction reproduces every target token.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from megatron_chimera.config import ConfigError
from megatron_chimera.model.gpt2 import GPTModel


@dataclass(frozen=True)
class Window:
    """Tokens ``[begin, end)`` run together; targets ``[first_target, end)`` are scored."""

    begin: int
    end: int
    first_target: int


def sliding_windows(num_tokens: int, window: int, stride: int) -> list[Window]:
    """The windows that score tokens ``1 .. num_tokens - 1`` once each."""
    if window < 2:
        raise ConfigError(f"--seq-length must be >= 2 for perplexity, got {window}")
    if not 1 <= stride <= window - 1:
        raise ConfigError(f"--stride must be in [1, --seq-length - 1 = {window - 1}] (each "
                          f"window must overlap the last by a token), got {stride}")
    windows, begin, scored_until = [], 0, 1
    while scored_until < num_tokens:
        end = min(begin + window, num_tokens)
        if end > scored_until:
            windows.append(Window(begin, end, max(scored_until, begin + 1)))
            scored_until = end
        begin += stride
    return windows


@torch.no_grad()
def token_nll(model: GPTModel, batch: torch.Tensor) -> torch.Tensor:
    """Per-token negative log-likelihood ``[b, s-1]`` of ``batch[:, 1:]`` given its prefix."""
    tokens, labels = batch[:, :-1], batch[:, 1:]
    positions = torch.arange(tokens.shape[1], device=batch.device).expand_as(tokens)
    return model(tokens, positions, labels=labels).float()


def _batches(windows: list[Window], batch_size: int) -> Iterator[list[Window]]:
    """Consecutive windows of equal length, at most ``batch_size`` at a time."""
    group: list[Window] = []
    for win in windows:
        if group and (len(group) == batch_size
                      or win.end - win.begin != group[0].end - group[0].begin):
            yield group
            group = []
        group.append(win)
    if group:
        yield group


def perplexity(model: GPTModel, tokens: Sequence[int] | torch.Tensor, window: int, stride: int,
               batch_size: int = 8) -> dict[str, float]:
    """Sliding-window perplexity of a token stream: ``{"nll", "tokens", "perplexity", ...}``."""
    stream = torch.as_tensor(tokens, dtype=torch.long)
    if stream.numel() < 2:
        raise ConfigError("perplexity needs at least 2 tokens of input")
    if batch_size < 1:
        raise ConfigError(f"--batch-size must be positive, got {batch_size}")
    device = next(model.parameters()).device
    windows = sliding_windows(stream.numel(), window, stride)
    total, count = 0.0, 0
    for group in _batches(windows, batch_size):
        batch = torch.stack([stream[w.begin:w.end] for w in group]).to(device)
        nll = token_nll(model, batch)  # position j predicts token begin + j + 1
        for row, win in zip(nll, group):
            scored = row[win.first_target - win.begin - 1:]
            total += float(scored.double().sum())
            count += scored.numel()
    mean = total / count
    return {"tokens_scored": count, "nll_sum": total, "nll_mean": mean,
            "perplexity": math.exp(mean), "window": window, "stride": stride}


def lambada_example(text: str, tokenize: Callable[[str], list[int]]) -> tuple[list[int],
                                                                               list[int]]:
    """(context ids, target ids) of one LAMBADA text: target = the last word, with its space."""
    text = text.strip()
    words = text.split()
    if len(words) < 2:
        raise ConfigError(f"LAMBADA example needs a context and a last word: {text!r}")
    last = words[-1]
    context = text[:text.rfind(last)].strip()
    return tokenize(context), tokenize(" " + last)


@torch.no_grad()
def lambada_accuracy(model: GPTModel, examples: list[tuple[list[int], list[int]]],
                     max_length: int, batch_size: int = 8) -> dict[str, float]:
    """Last-word accuracy (all target tokens predicted greedily) and the targets' perplexity."""
    if batch_size < 1:
        raise ConfigError(f"--batch-size must be positive, got {batch_size}")
    device = next(model.parameters()).device
    correct, nll, target_tokens = 0, 0.0, 0
    for first in range(0, len(examples), batch_size):
        chunk = examples[first:first + batch_size]
        seqs = []
        for context, target in chunk:
            if not target or len(target) >= max_length:
                raise ConfigError(f"LAMBADA target of {len(target)} tokens does not fit "
                                  f"{max_length} positions")
            seqs.append((context + target)[-max_length - 1:])  # +1: the last is only a label
        longest = max(len(s) for s in seqs)
        batch = torch.zeros(len(seqs), longest, dtype=torch.long)
        for i, seq in enumerate(seqs):  # right padding: causal attention never sees it
            batch[i, :len(seq)] = torch.tensor(seq)
        tokens = batch[:, :-1].to(device)
        positions = torch.arange(tokens.shape[1], device=device).expand_as(tokens)
        logits = model(tokens, positions).float()
        logprobs = torch.log_softmax(logits, dim=-1)
        for i, ((_, target), seq) in enumerate(zip(chunk, seqs)):
            span = range(len(seq) - 1 - len(target), len(seq) - 1)  # positions predicting target
            want = torch.tensor(target, device=device)
            got = logits[i, list(span)].argmax(-1)
            correct += bool(torch.equal(got, want))
            nll -= float(logprobs[i, list(span)].gather(-1, want[:, None]).double().sum())
            target_tokens += len(target)
    return {"examples": len(examples), "correct": correct,
            "accuracy": correct / max(len(examples), 1), "target_tokens": target_tokens,
            "target_nll_mean": nll / max(target_tokens, 1),
            "target_perplexity": math.exp(nll / max(target_tokens, 1))}
