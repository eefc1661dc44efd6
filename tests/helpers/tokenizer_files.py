"""Tiny tokenizer files written in the test (no downloads): GPT-2 BPE, WordPiece, SentencePiece,
shared by the tokenizer, preprocessing and BERT masking tests."""

from __future__ import annotations

import io
import json
import os

TEXTS = [
    "The cat sat on the mat. The dog ran far away!",
    "Hello world. Hello again, world? Yes.",
    "Birds sang loud songs in the trees. The cat sat.",
    "A single line without a boundary",
]


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of the 256 bytes to printable characters."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\u00a1"), ord("\u00ac") + 1))
        + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    )
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


GPT2_MERGES = [("h", "e"), ("l", "l"), ("he", "ll"), ("\u0120", "w")]


def write_gpt2_files(directory: str) -> tuple[str, str, dict[str, int]]:
    """vocab.json (256 byte symbols, 4 merges, <|endoftext|>) and merges.txt; returns the vocab."""
    symbols = [byte_to_unicode()[b] for b in range(256)]
    vocab = {s: i for i, s in enumerate(symbols)}
    for a, b in GPT2_MERGES:
        vocab[a + b] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    vocab_file = os.path.join(directory, "vocab.json")
    merge_file = os.path.join(directory, "merges.txt")
    with open(vocab_file, "w", encoding="utf-8") as f:
        json.dump(vocab, f)
    with open(merge_file, "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        for a, b in GPT2_MERGES:
            f.write(f"{a} {b}\n")
    return vocab_file, merge_file, vocab


WORDPIECE_VOCAB = [
    "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "##s", "sat", "on", "mat", ".",
    "dog", "ran", "far", "away", "!", "hello", "world", ",", "?", "yes", "again", "a", "The",
]


def write_wordpiece_vocab(directory: str) -> str:
    """A small BERT vocab.txt."""
    path = os.path.join(directory, "vocab.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(WORDPIECE_VOCAB) + "\n")
    return path


def train_sentencepiece(directory: str, vocab_size: int = 48) -> str:
    """Train a tiny BPE SentencePiece model on ``TEXTS`` in memory; returns the .model path."""
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXTS * 20), model_writer=model, vocab_size=vocab_size,
        model_type="bpe", character_coverage=1.0, num_threads=1, minloglevel=2,
    )
    path = os.path.join(directory, "spm.model")
    with open(path, "wb") as f:
        f.write(model.getvalue())
    return path
