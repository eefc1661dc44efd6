"""Tokenizers against hand-computed ids, on tiny files written by
:mod:`tests.helpers.tokenizer_files` (no downloads)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron_chimera.config import ConfigError
from megatron_chimera.data.tokenizers import build_tokenizer, padded_vocab_size
from tests.helpers import REPO_ROOT
from tests.helpers.tokenizer_files import (
    TEXTS,
    WORDPIECE_VOCAB,
    byte_to_unicode,
    train_sentencepiece,
    write_gpt2_files,
    write_wordpiece_vocab,
)

pytestmark = pytest.mark.timeout(60)


def test_gpt2_bpe_hand_computed(tmp_path):
    vocab_file, merge_file, vocab = write_gpt2_files(str(tmp_path))
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    g = byte_to_unicode()[ord(" ")]
    # "hello" -> h e l l o -> he ll o -> hell o; " world" -> Ġw o r l d
    expected = [vocab["hell"], vocab["o"], vocab[g], vocab["hell"], vocab["o"], vocab[g + "w"],
                vocab["o"], vocab["r"], vocab["l"], vocab["d"]]
    assert tok.tokenize("hello hello world") == expected
    assert tok.detokenize(expected) == "hello hello world"
    assert tok.eod == vocab["<|endoftext|>"] == 260
    assert tok.vocab_size == 261
    assert tok.padded_vocab_size == 384
    text = "naïve — ünïcode ✓"
    assert tok.detokenize(tok.tokenize(text)) == text  # byte level: lossless


def test_wordpiece_lower_and_cased(tmp_path):
    vocab_file = write_wordpiece_vocab(str(tmp_path))
    ids = {t: i for i, t in enumerate(WORDPIECE_VOCAB)}
    lower = build_tokenizer("BertWordPieceLowerCase", vocab_file=vocab_file)
    assert lower.tokenize("The cats sat.") == [ids["the"], ids["cat"], ids["##s"], ids["sat"],
                                               ids["."]]
    assert lower.detokenize(lower.tokenize("the cats sat.")) == "the cats sat ."
    cased = build_tokenizer("BertWordPieceCase", vocab_file=vocab_file)
    assert cased.tokenize("The Dog") == [ids["The"], ids["[UNK]"]]
    # Megatron appends [BOS] and [EOS]; eod is [EOS]
    assert lower.vocab_size == len(WORDPIECE_VOCAB) + 2
    assert lower.eod == len(WORDPIECE_VOCAB) + 1
    assert (lower.cls, lower.sep, lower.mask, lower.pad) == (2, 3, 4, 0)


def test_sentencepiece(tmp_path):
    import sentencepiece

    model = train_sentencepiece(str(tmp_path))
    sp = sentencepiece.SentencePieceProcessor(model_file=model)
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=model,
                          make_vocab_size_divisible_by=8)
    text = "The cat sat on the mat."
    assert tok.tokenize(text) == sp.encode(text)
    assert tok.detokenize(tok.tokenize(text)) == text
    n = sp.get_piece_size()
    # <CLS> <SEP> <EOD> <MASK> <PAD> appended (the model has unk/bos/eos but no pad)
    assert (tok.cls, tok.sep, tok.eod, tok.mask, tok.pad) == (n, n + 1, n + 2, n + 3, n + 4)
    assert tok.vocab_size == n + 5
    assert tok.padded_vocab_size == -(-(n + 5) // 8) * 8
    assert tok.tokenize("a<EOD>b") == sp.encode("a") + [tok.eod] + sp.encode("b")
    gpt = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=model)
    assert gpt.vocab_size == n and gpt.eod == sp.eos_id()
    assert gpt.tokenize(text) == sp.encode(text)


def test_null_tokenizer():
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert tok.tokenize("5 17  99") == [5, 17, 99]
    assert tok.detokenize([5, 17]) == "5 17"
    assert tok.eod == 100 and tok.vocab_size == 101
    assert padded_vocab_size(tok, 64) == 128


def test_errors_name_the_flag(tmp_path):
    with pytest.raises(ConfigError, match="--tokenizer-type"):
        build_tokenizer("NoSuchTokenizer")
    with pytest.raises(ConfigError, match="--merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=write_gpt2_files(str(tmp_path))[0])
    with pytest.raises(ConfigError, match="--vocab-file .*not found"):
        build_tokenizer("BertWordPieceCase", vocab_file=str(tmp_path / "missing.txt"))
    with pytest.raises(ConfigError, match="--vocab-size"):
        build_tokenizer("NullTokenizer")
    with pytest.raises(ConfigError, match="--tokenizer-model"):
        build_tokenizer("SentencePieceTokenizer")
    with pytest.raises(NotImplementedError, match="mask"):
        _ = build_tokenizer("NullTokenizer", vocab_size=3).mask


def test_train_tokenizer_tool(tmp_path):
    import sentencepiece

    data = tmp_path / "corpus.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 10))
    tool = str(REPO_ROOT / "tools" / "train_tokenizer.py")
    for model_type in ("bpe", "unigram"):
        prefix = str(tmp_path / model_type)
        subprocess.run([sys.executable, tool, "--input", str(data), "--model-prefix", prefix,
                        "--vocab-size", "40", "--model-type", model_type], check=True,
                       capture_output=True, timeout=60)
        sp = sentencepiece.SentencePieceProcessor(model_file=prefix + ".model")
        assert sp.get_piece_size() == 40
        assert sp.decode(sp.encode(TEXTS[0])) == TEXTS[0]
        assert len(open(prefix + ".vocab").read().splitlines()) == 40
