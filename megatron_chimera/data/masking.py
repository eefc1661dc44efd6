"""BERT's masked-LM targets with Megatron's whole-word and n-gram masking.

Semantics of Megatron-LM's ``create_masked_lm_predictions`` (BERT defaults: whole words, n-grams
of up to 3 words, no permutation):

* The tokens other than ``[CLS]``/``[SEP]`` are grouped into *words*: a token that does not start
  a word joins the word of the token just before it (WordPiece: pieces starting with ``##``
  continue a word; SentencePiece: pieces without the ``▁`` word-start marker do). A continuation
  right after a separator or at a truncated segment start begins a word of its own. Without a
  word table (or ``--no-whole-word-masking``) every token is a word.
* ``num_to_predict = min(max_predictions, max(1, round(len(tokens) * masked_lm_prob)))`` where
  ``tokens`` includes ``[CLS]`` and the ``[SEP]`` s.
* Every word is a candidate start, visited in random order. At a start, ``n`` is drawn from
  ``1..min(max_ngram, words left)`` with probability proportional to ``1/n``; while the n-gram
  (n consecutive words, all their tokens) would exceed ``num_to_predict`` a shorter one is tried;
  an n-gram that still does not fit, or touches an already masked token, is skipped.
* Each selected token independently becomes ``[MASK]`` (80%), stays (10%) or becomes a random id
  (10%); its label is the original token.

So a word is either masked entirely or not at all. Megatron draws ``n`` from numpy's global RNG;
here every draw comes from the sample's own generator, so samples are reproducible.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

WORDPIECE_CONTINUATION = "##"
SENTENCEPIECE_WORD_START = "\u2581"  # "▁"


def word_start_table(tokenizer: object) -> np.ndarray | None:
    """``bool[vocab_size]``: whether each id starts a word, for WordPiece and SentencePiece
    tokenizers; None (every token its own word) for any other tokenizer."""
    from megatron_chimera.data.tokenizers import (
        BertWordPieceTokenizer,
        GPTSentencePieceTokenizer,
        SentencePieceTokenizer,
    )

    if isinstance(tokenizer, BertWordPieceTokenizer):
        table = np.ones(tokenizer.vocab_size, dtype=bool)
        for piece, index in tokenizer.vocab.items():
            table[index] = not piece.startswith(WORDPIECE_CONTINUATION)
        return table
    if isinstance(tokenizer, (SentencePieceTokenizer, GPTSentencePieceTokenizer)):
        table = np.ones(tokenizer.vocab_size, dtype=bool)
        for index, (piece, ordinary) in enumerate(tokenizer.pieces()):
            # control, unknown and appended special pieces stand alone
            table[index] = not ordinary or piece.startswith(SENTENCEPIECE_WORD_START)
        return table
    return None


def group_words(tokens: Sequence[int], special_positions: Collection[int],
                word_starts: np.ndarray | None) -> list[list[int]]:
    """Positions of ``tokens`` (specials excluded) grouped into words, in order."""
    words: list[list[int]] = []
    previous = -2
    for position, token in enumerate(tokens):
        if position in special_positions:
            continue
        continues = (word_starts is not None and words and previous == position - 1
                     and not word_starts[token])
        if continues:
            words[-1].append(position)
        else:
            words.append([position])
        previous = position
    return words


def create_masked_lm_predictions(
    tokens: Sequence[int], special_positions: Collection[int], word_starts: np.ndarray | None,
    masked_lm_prob: float, max_predictions: int, max_ngram: int, vocab_size: int,
    mask_id: int, rng: np.random.RandomState,
) -> tuple[list[int], list[int], list[int]]:
    """(masked tokens, sorted masked positions, their original ids); see the module docstring."""
    output = list(tokens)
    if masked_lm_prob <= 0:
        return output, [], []
    words = group_words(tokens, special_positions, word_starts)
    num_to_predict = min(max_predictions, max(1, int(round(len(tokens) * masked_lm_prob))))
    weights = 1.0 / np.arange(1, max_ngram + 1)
    covered: set[int] = set()
    for start in rng.permutation(len(words)):
        if len(covered) >= num_to_predict:
            break
        longest = min(max_ngram, len(words) - int(start))
        probabilities = weights[:longest] / weights[:longest].sum()
        n = int(rng.choice(np.arange(1, longest + 1), p=probabilities))
        span = _ngram(words, int(start), n)
        while len(covered) + len(span) > num_to_predict and n > 1:
            n -= 1
            span = _ngram(words, int(start), n)
        if len(covered) + len(span) > num_to_predict or covered.intersection(span):
            continue
        for position in span:
            covered.add(position)
            if rng.random_sample() < 0.8:
                output[position] = mask_id
            elif rng.random_sample() >= 0.5:
                output[position] = int(rng.randint(0, vocab_size))
            # else: keep the original token
    positions = sorted(covered)
    return output, positions, [int(tokens[p]) for p in positions]


def _ngram(words: list[list[int]], start: int, n: int) -> list[int]:
    return [position for word in words[start:start + n] for position in word]
