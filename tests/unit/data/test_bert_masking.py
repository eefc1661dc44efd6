"""BERT whole-word and n-gram masking: word tables, masking statistics, no split words.

Statistical bounds are 5 standard deviations of a binomial (the seeds are fixed, so the tests are
deterministic; the bounds say how far a correct implementation may drift if the RNG changes).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from megatron_chimera.data.bert_dataset import MockBertDataset, build_training_sample
from megatron_chimera.data.masking import create_masked_lm_predictions, word_start_table
from megatron_chimera.data.tokenizers import build_tokenizer
from tests.helpers.tokenizer_files import (
    WORDPIECE_VOCAB,
    train_sentencepiece,
    write_wordpiece_vocab,
)

pytestmark = pytest.mark.timeout(120)

PAD, CLS, SEP, MASK = 0, 2, 3, 4
VOCAB = 100
STARTS = range(5, 50)  # word-start ids of the synthetic vocabulary
CONTINUATIONS = range(50, VOCAB)  # "##" pieces
TABLE = np.array([not 50 <= i < VOCAB for i in range(VOCAB)])


def _words_sentence(rng: np.random.RandomState, num_words: int) -> tuple[list[int], list[int]]:
    """A sentence of words of 1-3 pieces, and the word number of every piece (the reference)."""
    tokens, word_of = [], []
    for w in range(num_words):
        pieces = 1 + rng.binomial(2, 0.4)
        tokens.append(int(rng.choice(STARTS)))
        tokens += [int(rng.choice(CONTINUATIONS)) for _ in range(pieces - 1)]
        word_of += [w] * pieces
    return tokens, word_of


def _samples(num: int, word_starts, max_ngram: int = 3, seed: int = 0):
    """``num`` BERT samples of two sentences, with the reference word of every position."""
    rng = np.random.RandomState(seed)
    out = []
    for k in range(num):
        a, words_a = _words_sentence(rng, rng.randint(4, 12))
        b, words_b = _words_sentence(rng, rng.randint(4, 12))
        sample = build_training_sample(
            [np.array(a), np.array(b)], 200, 200, VOCAB, CLS, SEP, MASK, PAD, 0.15,
            np.random.RandomState(1000 + k), binary_head=False, word_starts=word_starts,
            max_ngram=max_ngram)
        n = int(sample["padding_mask"].sum())
        # binary_head=False: [CLS] a b [SEP]; word ids continue across the sentences
        word_of = [-1] + words_a + [len(set(words_a)) + w for w in words_b] + [-1]
        assert n == len(word_of)
        out.append((sample, n, word_of))
    return out


def test_word_start_tables(tmp_path):
    wordpiece = build_tokenizer("BertWordPieceLowerCase",
                                vocab_file=write_wordpiece_vocab(str(tmp_path)))
    table = word_start_table(wordpiece)
    assert table.shape == (wordpiece.vocab_size,)
    assert [piece for piece, start in zip(WORDPIECE_VOCAB, table) if not start] == ["##s"]
    spm = build_tokenizer("SentencePieceTokenizer", tokenizer_model=train_sentencepiece(
        str(tmp_path)))
    table = word_start_table(spm)
    pieces = spm.pieces()
    assert table.shape == (spm.vocab_size,) == (len(pieces),)
    for (piece, ordinary), start in zip(pieces, table):
        assert start == (not ordinary or piece.startswith("\u2581")), piece
    assert table[[spm.cls, spm.sep, spm.mask, spm.pad, spm.eod]].all()
    ids = spm.tokenize("The cats sat on the mat.")
    words = [[ids[0]]]
    for i in ids[1:]:
        (words.append([i]) if table[i] else words[-1].append(i))
    assert ["".join(spm._sp.id_to_piece(i) for i in w) for w in words] == [
        "\u2581The", "\u2581cats", "\u2581sat", "\u2581on", "\u2581the", "\u2581mat."]
    assert word_start_table(build_tokenizer("NullTokenizer", vocab_size=10)) is None


@pytest.mark.parametrize("word_starts", [TABLE, None])
def test_masking_statistics_and_whole_words(word_starts):
    samples = _samples(3000, word_starts)
    shown = {"mask": 0, "kept": 0, "random": 0}
    tokens = masked = target = split_words = 0
    for sample, n, word_of in samples:
        is_masked = sample["loss_mask"][:n] == 1
        assert not is_masked[0] and not is_masked[n - 1]  # [CLS] / [SEP] never
        expected = min(max(1, round(0.15 * 200)), max(1, round(0.15 * n)))
        assert is_masked.sum() <= expected  # Megatron's num_to_predict is an upper bound
        tokens, masked, target = tokens + n, masked + int(is_masked.sum()), target + expected
        labels, text = sample["labels"][:n], sample["text"][:n]
        assert np.all((labels >= 0) == is_masked)
        for pos in np.flatnonzero(is_masked):
            kind = ("mask" if text[pos] == MASK else "kept" if text[pos] == labels[pos]
                    else "random")
            shown[kind] += 1
        for w in set(word_of) - {-1}:
            status = {bool(is_masked[i]) for i in range(n) if word_of[i] == w}
            split_words += len(status) == 2
    # ~15% of the tokens ([CLS]/[SEP] included, as Megatron counts them); whole words and
    # n-grams that do not fit may leave a sample a few tokens short of its target
    assert 0.97 * target <= masked <= target
    assert abs(masked / tokens - 0.15) < 0.01

    def within(count, p):
        return abs(count - masked * p) <= 5 * math.sqrt(masked * p * (1 - p)) + 1

    # a random replacement may draw the original id (1/VOCAB) or [MASK] (1/VOCAB)
    assert within(shown["mask"], 0.8 + 0.1 / VOCAB)
    assert within(shown["kept"], 0.1 + 0.1 / VOCAB)
    assert within(shown["random"], 0.1 * (VOCAB - 2) / VOCAB)
    if word_starts is not None:
        assert split_words == 0  # a word is masked whole or not at all
    else:
        assert split_words > 100  # per-token masking does split words: the check can fail


def test_ngrams_mask_runs_of_words():
    """n-grams of up to 3 words put masked words next to each other far more often than single
    words do (there only by chance: about 1/4 here). With ~4.5 tokens to mask per sample and
    words of 1.8 pieces, long n-grams often do not fit and shrink, so about half, not the
    unconstrained 2/3, of the masked words end up in runs."""
    def fraction_in_runs(max_ngram: int) -> float:
        in_runs = total = 0
        for sample, n, word_of in _samples(1500, TABLE, max_ngram=max_ngram, seed=5):
            is_masked = sample["loss_mask"][:n] == 1
            words = sorted({word_of[i] for i in range(n) if is_masked[i]})
            chosen = set(words)
            in_runs += sum((w - 1 in chosen) or (w + 1 in chosen) for w in words)
            total += len(words)
        return in_runs / total

    assert fraction_in_runs(3) > 0.4  # measured 0.47 (0.41 with --masking-max-ngram 2)
    assert fraction_in_runs(1) < 0.3  # measured 0.24


def test_ngram_length_distribution():
    """The first n-gram drawn at a start word has n with probability proportional to 1/n."""
    counts = np.zeros(4)
    for seed in range(3000):
        tokens = list(range(5, 45))  # 40 one-token words, target 6 tokens: the first never shrinks
        _, positions, _ = create_masked_lm_predictions(
            tokens, set(), None, 0.15, 100, 3, VOCAB, MASK, np.random.RandomState(seed))
        rng = np.random.RandomState(seed)
        start = int(rng.permutation(40)[0])
        run = 0
        while start + run < 40 and start + run in positions:
            run += 1
        counts[min(run, 3)] += 1
    assert counts[0] == 0
    # the run at the first start is its n-gram, unless a later pick landed right after it
    p = np.array([6, 3, 2]) / 11
    observed = counts[1:] / counts.sum()
    assert observed[0] == pytest.approx(p[0], abs=0.05)
    assert observed[1] + observed[2] == pytest.approx(p[1] + p[2], abs=0.05)


def test_mock_bert_whole_words_and_provider_flag(tmp_path):
    import pretrain_bert
    from megatron_chimera.training.arguments import parse_args

    vocab = write_wordpiece_vocab(str(tmp_path))
    base = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 24 "
            "--micro-batch-size 2 --lr 1e-3 --train-iters 2 --mock-data "
            f"--tokenizer-type BertWordPieceLowerCase --vocab-file {vocab}").split()
    from megatron_chimera.training.training import build_tokenizer_for

    for extra, whole in (([], True), (["--no-whole-word-masking"], False),
                         (["--masking-max-ngram", "1"], True)):
        tokenizer, config = build_tokenizer_for(parse_args(base + extra, world_size=1))
        train, _, _ = pretrain_bert.train_valid_test_datasets_provider(config, tokenizer,
                                                                       [4, 0, 0])
        assert isinstance(train, MockBertDataset)
        assert (train.word_starts is not None) == whole
        assert train.max_ngram == (1 if "--masking-max-ngram" in extra else 3)
