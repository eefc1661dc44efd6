"""Megatron's BERT dataset: masked LM plus sentence-order prediction from a sentence-split dataset.

A *samples mapping* (cached ``.npy``) lists ``(first sentence, end sentence, target length)`` spans:
consecutive sentences of one document are gathered until the target length (``seq_length - 3``;
with probability ``short_seq_prob`` a random shorter one) is reached, over as many epochs as the
requested sample count needs, then shuffled. Each sample splits its span into segments A and B at a
random sentence boundary and swaps them with probability 1/2 (``is_random`` = 1: wrong order),
truncates to the target, builds ``[CLS] A [SEP] B [SEP]`` and masks 15% of the tokens as Megatron
does (:mod:`~megatron_chimera.data.masking`): whole words (WordPiece / SentencePiece word tables)
in n-grams of up to 3 words; each masked token becomes ``[MASK]`` (80%), a random id (10%) or
stays (10%). ``word_starts=None`` masks tokens as words, ``max_ngram=1`` single words.

Sample fields (Megatron's): ``text``, ``types``, ``labels`` (the original id at masked positions,
**-1 elsewhere**), ``is_random``, ``loss_mask`` (1 at masked positions), ``padding_mask``
(1 for real tokens), ``truncated``; arrays are int64 of ``seq_length``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from megatron_chimera.config import ConfigError
from megatron_chimera.data.dataset_utils import (
    SPLIT_NAMES,
    blended_num_samples,
    cache_prefix,
    get_train_valid_test_split,
    load_npy,
    open_checked_dataset,
    parse_data_paths,
    save_npy_atomic,
)
from megatron_chimera.data.indexed_dataset import MMapIndexedDataset
from megatron_chimera.data.masking import create_masked_lm_predictions
from megatron_chimera.errors import InputFileError

LONG_SENTENCE_LEN = 512  # documents holding a longer sentence are skipped, as Megatron does
MAX_EPOCHS = 10_000


def target_length(max_num_tokens: int, short_seq_prob: float, rng: np.random.RandomState) -> int:
    """``max_num_tokens``, or with probability ``short_seq_prob`` a length in ``[2, max]``."""
    if short_seq_prob > 0 and rng.random_sample() < short_seq_prob:
        return int(rng.randint(2, max_num_tokens + 1))
    return max_num_tokens


def build_samples_mapping(
    sizes: np.ndarray, document_indices: np.ndarray, documents: range, num_samples: int,
    max_num_tokens: int, short_seq_prob: float, seed: int, binary_head: bool,
) -> np.ndarray:
    """``[n, 3]`` int64 rows (start, end, target length), shuffled; n >= samples."""
    rng = np.random.RandomState(seed)
    min_sentences = 2 if binary_head else 1
    rows: list[tuple[int, int, int]] = []
    for _epoch in range(MAX_EPOCHS):
        if len(rows) >= num_samples:
            break
        before = len(rows)
        for doc in documents:
            first, last = int(document_indices[doc]), int(document_indices[doc + 1])
            if last - first < min_sentences or np.any(sizes[first:last] > LONG_SENTENCE_LEN):
                continue
            start, seq_len, num_sent = first, 0, 0
            target = target_length(max_num_tokens, short_seq_prob, rng)
            for sent in range(first, last):
                seq_len += int(sizes[sent])
                num_sent += 1
                remaining = last - sent - 1
                if (seq_len >= target and remaining > 1 and num_sent >= min_sentences) or (
                    remaining == 0
                ):
                    if num_sent >= min_sentences:
                        rows.append((start, sent + 1, target))
                    start, seq_len, num_sent = sent + 1, 0, 0
                    target = target_length(max_num_tokens, short_seq_prob, rng)
        if len(rows) == before:  # a user error: one line, no traceback
            raise InputFileError(
                f"no BERT samples can be built from documents [{documents.start}, "
                f"{documents.stop}): each has fewer than {min_sentences} sentences or a sentence "
                f"over {LONG_SENTENCE_LEN} tokens (preprocess with --split-sentences; give this "
                "split more documents with --split)"
            )
    mapping = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
    return mapping[np.random.RandomState(seed + 1).permutation(len(mapping))]


def get_a_and_b_segments(
    sentences: Sequence[np.ndarray], rng: np.random.RandomState
) -> tuple[list[int], list[int], bool]:
    """Split the sentences at a random boundary into A and B; swap them with probability 1/2."""
    n = len(sentences)
    a_end = int(rng.randint(1, n)) if n >= 3 else 1
    tokens_a = [int(t) for s in sentences[:a_end] for t in s]
    tokens_b = [int(t) for s in sentences[a_end:] for t in s]
    is_random = bool(rng.random_sample() < 0.5)
    if is_random:
        tokens_a, tokens_b = tokens_b, tokens_a
    return tokens_a, tokens_b, is_random


def truncate_segments(tokens_a: list[int], tokens_b: list[int], max_num_tokens: int,
                      rng: np.random.RandomState) -> bool:
    """Drop tokens from the front or back (at random) of the longer segment until they fit."""
    truncated = False
    while len(tokens_a) + len(tokens_b) > max_num_tokens:
        tokens = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
        if rng.random_sample() < 0.5:
            del tokens[0]
        else:
            tokens.pop()
        truncated = True
    return truncated


def build_training_sample(
    sentences: Sequence[np.ndarray], target_seq_length: int, max_seq_length: int, vocab_size: int,
    cls_id: int, sep_id: int, mask_id: int, pad_id: int, masked_lm_prob: float,
    rng: np.random.RandomState, binary_head: bool, word_starts: np.ndarray | None = None,
    max_ngram: int = 3,
) -> dict[str, np.ndarray | int]:
    """One BERT sample from consecutive sentences (see the module docstring for the fields)."""
    if binary_head:
        tokens_a, tokens_b, is_random = get_a_and_b_segments(sentences, rng)
    else:
        tokens_a, tokens_b, is_random = [int(t) for s in sentences for t in s], [], False
    truncated = truncate_segments(tokens_a, tokens_b, target_seq_length, rng)
    tokens = [cls_id, *tokens_a, sep_id]
    types = [0] * len(tokens)
    if tokens_b:
        tokens += [*tokens_b, sep_id]
        types += [1] * (len(tokens_b) + 1)
    num_tokens = len(tokens)
    special = {0, len(tokens_a) + 1, num_tokens - 1}
    max_predictions = max(1, int(round(masked_lm_prob * target_seq_length)))
    tokens, positions, originals = create_masked_lm_predictions(
        tokens, special, word_starts, masked_lm_prob, max_predictions, max_ngram, vocab_size,
        mask_id, rng)
    labels = np.full(max_seq_length, -1, dtype=np.int64)
    loss_mask = np.zeros(max_seq_length, dtype=np.int64)
    labels[positions] = originals
    loss_mask[positions] = 1
    padding = max_seq_length - num_tokens
    return {
        "text": np.array(tokens + [pad_id] * padding, dtype=np.int64),
        "types": np.array(types + [0] * padding, dtype=np.int64),
        "labels": labels,
        "is_random": int(is_random),
        "loss_mask": loss_mask,
        "padding_mask": np.array([1] * num_tokens + [0] * padding, dtype=np.int64),
        "truncated": int(truncated),
    }


class BertDataset(torch.utils.data.Dataset):
    """BERT samples from a document range of a sentence-split indexed dataset."""

    def __init__(
        self, name: str, data_prefix: str, indexed_dataset: MMapIndexedDataset,
        documents: range, num_samples: int, seq_length: int, seed: int, vocab_size: int,
        cls_id: int, sep_id: int, mask_id: int, pad_id: int, masked_lm_prob: float = 0.15,
        short_seq_prob: float = 0.1, binary_head: bool = True, cache_dir: str | None = None,
        build_cache: bool = True, word_starts: np.ndarray | None = None, max_ngram: int = 3,
    ) -> None:
        if seq_length < 5:
            raise ConfigError("--seq-length must be at least 5 for BERT ([CLS] A [SEP] B [SEP])")
        self.indexed_dataset = indexed_dataset
        self.seq_length, self.seed, self.vocab_size = seq_length, seed, vocab_size
        self.special = (cls_id, sep_id, mask_id, pad_id)
        self.masked_lm_prob, self.binary_head = masked_lm_prob, binary_head
        self.word_starts, self.max_ngram = word_starts, max_ngram
        prefix = cache_prefix(data_prefix, cache_dir, f"{name}_bert", {
            "class": "BertDataset", "path": os.path.abspath(data_prefix),
            "sequences": len(indexed_dataset), "documents": (documents.start, documents.stop),
            "num_samples": num_samples, "seq_length": seq_length, "seed": seed,
            "short_seq_prob": short_seq_prob, "binary_head": binary_head, "format": 1,
        })
        path = f"{prefix}_samples_mapping.npy"
        if build_cache and not os.path.isfile(path):
            try:
                mapping = build_samples_mapping(
                    indexed_dataset.sequence_lengths, indexed_dataset.document_indices,
                    documents, num_samples, seq_length - 3, short_seq_prob, seed, binary_head,
                )
            except ValueError as e:
                raise ValueError(f"{data_prefix} ({name} split): {e}") from None
            save_npy_atomic(path, mapping)
        self.samples_mapping = load_npy(path, "BERT samples mapping")
        self.cache_paths = {"shuffle_idx": path}

    def __len__(self) -> int:
        return self.samples_mapping.shape[0]

    def __getitem__(self, idx: int) -> dict[str, np.ndarray | int]:
        start, end, target = (int(x) for x in self.samples_mapping[idx])
        sentences = [self.indexed_dataset.get(i) for i in range(start, end)]
        rng = np.random.RandomState((self.seed + idx) % 2**32)
        cls_id, sep_id, mask_id, pad_id = self.special
        return build_training_sample(sentences, target, self.seq_length, self.vocab_size, cls_id,
                                     sep_id, mask_id, pad_id, self.masked_lm_prob, rng,
                                     self.binary_head, self.word_starts, self.max_ngram)


class MockBertDataset(torch.utils.data.Dataset):
    """Deterministic synthetic BERT samples (``--mock-data``): random sentences, real masking."""

    def __init__(self, name: str, num_samples: int, seq_length: int, vocab_size: int, cls_id: int,
                 sep_id: int, mask_id: int, pad_id: int, seed: int, binary_head: bool = True,
                 masked_lm_prob: float = 0.15, word_starts: np.ndarray | None = None,
                 max_ngram: int = 3) -> None:
        self.split_id = SPLIT_NAMES.index(name) if name in SPLIT_NAMES else len(SPLIT_NAMES)
        self.num_samples, self.seq_length, self.vocab_size = num_samples, seq_length, vocab_size
        self.special = (cls_id, sep_id, mask_id, pad_id)
        self.seed, self.binary_head, self.masked_lm_prob = seed, binary_head, masked_lm_prob
        self.word_starts, self.max_ngram = word_starts, max_ngram
        self.ordinary = np.setdiff1d(np.arange(vocab_size), np.array(self.special))

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict[str, np.ndarray | int]:
        if not 0 <= idx < self.num_samples:
            raise IndexError(idx)
        rng = np.random.RandomState(np.random.default_rng([self.seed, self.split_id, idx])
                                    .integers(2**32))
        budget = self.seq_length - 3
        cut = int(rng.randint(1, budget))
        sentences = [rng.choice(self.ordinary, cut), rng.choice(self.ordinary, budget - cut)]
        cls_id, sep_id, mask_id, pad_id = self.special
        return build_training_sample(sentences, budget, self.seq_length, self.vocab_size, cls_id,
                                     sep_id, mask_id, pad_id, self.masked_lm_prob, rng,
                                     self.binary_head, self.word_starts, self.max_ngram)


@dataclass(frozen=True)
class BertTokens:
    """The vocabulary a BERT sample is drawn in: its size and the special token ids."""

    vocab_size: int
    cls_id: int
    sep_id: int
    mask_id: int
    pad_id: int


@dataclass(frozen=True)
class BertSampling:
    """How a BERT training sample is made: the share of masked tokens, whole-word masking
    (``word_starts``) and n-gram spans up to ``max_ngram`` (:mod:`.masking`), the chance of a
    short sequence, and whether the pair's order is a target (the binary head)."""

    masked_lm_prob: float = 0.15
    word_starts: np.ndarray | None = None
    max_ngram: int = 3
    short_seq_prob: float = 0.1
    binary_head: bool = True


def build_train_valid_test_datasets(
    data_prefix: Sequence[str] | None, splits_string: str,
    train_valid_test_num_samples: Sequence[int], seq_length: int, seed: int,
    tokens: BertTokens, sampling: BertSampling = BertSampling(),
    cache_dir: str | None = None, build_cache: bool = True, embedding_size: int | None = None,
    split_paths: Sequence[Sequence[str] | None] | None = None,
) -> tuple[torch.utils.data.Dataset | None, ...]:
    """(train, valid, test) BERT datasets of ``tokens``' vocabulary, samples made as
    ``sampling`` says; the split is over documents, as Megatron's, or with ``split_paths``
    (``--train-data-path`` ...) each split is every document of its own files. An empty
    dataset, or one with a token id ``>= embedding_size`` (padded vocabulary), is an error."""
    from megatron_chimera.data.blended_dataset import (
        blend_split_datasets,
        build_per_split_datasets,
    )

    def build(name: str, prefix: str, indexed: MMapIndexedDataset, documents: range,
              num_samples: int) -> BertDataset:
        return BertDataset(
            name, prefix, indexed, documents, num_samples, seq_length, seed, tokens.vocab_size,
            tokens.cls_id, tokens.sep_id, tokens.mask_id, tokens.pad_id,
            sampling.masked_lm_prob, sampling.short_seq_prob, sampling.binary_head, cache_dir,
            build_cache, sampling.word_starts, sampling.max_ngram)

    def opened(prefix: str) -> MMapIndexedDataset:
        return open_checked_dataset(prefix, embedding_size, cache_dir, build_cache)

    if split_paths is not None:
        def whole(name: str, prefix: str, num_samples: int) -> BertDataset:
            indexed = opened(prefix)
            return build(name, prefix, indexed, range(0, indexed.num_documents), num_samples)

        return build_per_split_datasets(split_paths, train_valid_test_num_samples, whole,
                                        cache_dir, build_cache, name_prefix="bert_")
    prefixes, weights = parse_data_paths(data_prefix)
    counts = ([train_valid_test_num_samples] if weights is None
              else blended_num_samples(weights, train_valid_test_num_samples))
    built = []
    for prefix, num_samples in zip(prefixes, counts):
        indexed = opened(prefix)
        bounds = get_train_valid_test_split(splits_string, indexed.num_documents)
        built.append([
            build(name, prefix, indexed, range(bounds[i], bounds[i + 1]), num_samples[i])
            if bounds[i + 1] > bounds[i] and num_samples[i] > 0 else None
            for i, name in enumerate(SPLIT_NAMES)])
    return blend_split_datasets(built, weights, train_valid_test_num_samples, prefixes[0],
                                cache_dir, build_cache, name_prefix="bert_")


def get_bert_batch(
    micro_batch: dict[str, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's BERT ``get_batch``: (tokens, types, sentence_order, loss_mask, lm_labels,
    padding_mask), all int64 except ``loss_mask`` (float)."""
    return (
        micro_batch["text"].long(),
        micro_batch["types"].long(),
        micro_batch["is_random"].long(),
        micro_batch["loss_mask"].float(),
        micro_batch["labels"].long(),
        micro_batch["padding_mask"].long(),
    )
