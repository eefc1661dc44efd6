"""Supervised fine-tuning samples: whole conversations packed into ``--seq-length`` positions.

The data is ``tools/preprocess_data.py --sft`` output: ``PREFIX_text_document`` (token ids, one
conversation per document, ``--data-path PREFIX_text_document``) and, next to it,
``PREFIX_loss_mask_document`` (1 per token trained as a target). Every epoch the split's
conversations are shuffled (``seed``) and packed in that order, whole, by
:func:`~megatron_chimera.data.packing.pack_documents` (next-fit) into samples of at most
``seq_length`` positions; a conversation of ``n`` tokens takes ``n`` positions (its last one
predicts nothing). A sample holds ``text`` (``seq_length + 1`` ids, padded with the end-of-document
id), ``loss_mask`` (the label's mask, 0 across a document boundary and on padding),
``position_ids`` restarting in every conversation and ``document_ids`` (the padding is a document
of its own), so no token attends to or predicts another conversation: each conversation trains
exactly as it would alone.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch

from megatron_chimera.config import ConfigError
from megatron_chimera.data.dataset_utils import (
    SPLIT_NAMES,
    get_train_valid_test_split,
    open_checked_dataset,
    parse_data_paths,
)
from megatron_chimera.data.indexed_dataset import MMapIndexedDataset, dataset_exists
from megatron_chimera.data.packing import pack_documents

TEXT_SUFFIX, MASK_SUFFIX = "_text_document", "_loss_mask_document"


def loss_mask_prefix(text_prefix: str) -> str:
    """The loss-mask dataset written next to ``text_prefix`` by ``preprocess_data.py --sft``."""
    if not text_prefix.endswith(TEXT_SUFFIX):
        raise ConfigError(f"--sft: --data-path {text_prefix} is not a preprocess_data.py --sft "
                          f"output (PREFIX{TEXT_SUFFIX}, with PREFIX{MASK_SUFFIX} next to it)")
    return text_prefix[:-len(TEXT_SUFFIX)] + MASK_SUFFIX


def check_sft_data(data_path: Sequence[str] | None, per_split: Sequence[str],
                   mock_data: bool) -> None:
    """``--sft`` flag checks before any process group: one ``--data-path`` prefix whose loss
    mask dataset exists (one clear error otherwise)."""
    if mock_data:
        raise ConfigError("--sft trains on a preprocess_data.py --sft dataset; --mock-data has "
                          "no loss masks")
    if per_split:
        raise ConfigError(f"--sft reads one --data-path split by --split; {per_split[0]} is "
                          "not supported with it")
    if data_path is None:
        raise ConfigError("--sft needs --data-path PREFIX_text_document "
                          "(tools/preprocess_data.py --sft output)")
    prefixes, weights = parse_data_paths(data_path)
    if weights is not None:
        raise ConfigError("--sft takes one --data-path prefix (blends are not supported)")
    mask = loss_mask_prefix(prefixes[0])
    if dataset_exists(prefixes[0]) and not dataset_exists(mask):
        raise ConfigError(f"--sft: no loss mask dataset {mask}.bin/.idx next to {prefixes[0]} "
                          "(preprocess the data with tools/preprocess_data.py --sft)")


def pack_sft_samples(sizes: np.ndarray, documents: np.ndarray, num_samples: int,
                     seq_length: int, seed: int, overlong: str = "error",
                     where: str = "--sft") -> tuple[list[tuple[tuple[int, ...], tuple[int, ...]]],
                                                    int, int]:
    """``(samples, truncated, skipped)``: at least ``num_samples`` samples, each (documents,
    their packed lengths), epoch after epoch (each shuffled by ``seed``, packed next-fit), and
    how many conversations of one epoch are truncated or skipped (``overlong``)."""
    documents = np.asarray(documents, dtype=np.int64)
    lengths = np.asarray(sizes, dtype=np.int64)[documents]
    if overlong == "error" and lengths.size and lengths.max() > seq_length:
        first = int(np.argmax(lengths > seq_length))
        raise ConfigError(f"{where}: conversation {int(documents[first])} has "
                          f"{int(lengths[first])} tokens, more than --seq-length {seq_length} "
                          "(--sft-overlong truncate or skip)")
    rng = np.random.RandomState(seed=seed)
    samples: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    truncated = skipped = 0
    while len(samples) < num_samples:
        permutation = rng.permutation(len(documents))
        order = documents[permutation]
        plan = pack_documents(lengths[permutation], seq_length, overlong)
        if not plan.micro_batches:
            raise ConfigError(f"{where}: every conversation was skipped (longer than "
                              f"--seq-length {seq_length} or empty)")
        truncated, skipped = len(plan.truncated), len(plan.skipped)
        samples += [(tuple(int(order[i]) for i in mb.documents), mb.lengths)
                    for mb in plan.micro_batches]
    return samples[:num_samples], truncated, skipped


class SFTDataset(torch.utils.data.Dataset):
    """Packed SFT samples (module docstring) of a range of conversations."""

    def __init__(self, name: str, text: MMapIndexedDataset, masks: MMapIndexedDataset,
                 documents: np.ndarray, num_samples: int, seq_length: int, seed: int,
                 pad_id: int, overlong: str = "error") -> None:
        self.text, self.masks = text, masks
        self.seq_length, self.pad_id = seq_length, pad_id
        self.samples, self.truncated, self.skipped = pack_sft_samples(
            text.sequence_lengths, documents, num_samples, seq_length, seed, overlong,
            f"--sft {name} split")
        self.conversations = len(documents)

    def __len__(self) -> int:
        return len(self.samples)

    def real_tokens(self, idx: int) -> int:
        """Positions of sample ``idx`` that hold conversations (the padding left out)."""
        return sum(self.samples[idx][1])

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        docs, lengths = self.samples[idx]
        seq = self.seq_length
        text = np.full(seq + 1, self.pad_id, dtype=np.int64)
        loss_mask = np.zeros(seq + 1, dtype=np.float32)
        positions = np.zeros(seq + 1, dtype=np.int64)
        document_ids = np.full(seq + 1, len(docs), dtype=np.int32)
        start = 0
        for k, (doc, n) in enumerate(zip(docs, lengths)):
            end = start + n
            text[start:end] = self.text.get(doc, 0, n)
            # position j predicts j + 1: trained where that token is, inside the conversation
            loss_mask[start:end - 1] = self.masks.get(doc, 1, n - 1)
            positions[start:end] = np.arange(n)
            document_ids[start:end] = k
            start = end
        positions[start:] = np.arange(seq + 1 - start)  # the padding: one more document
        return {"text": text, "loss_mask": loss_mask[:seq], "position_ids": positions[:seq],
                "document_ids": document_ids[:seq]}


def open_sft_masks(data_prefix: str, text: MMapIndexedDataset) -> MMapIndexedDataset:
    """The loss-mask dataset next to ``data_prefix`` (opened as ``text``), refused in one line
    unless it has exactly the text's conversations and lengths."""
    mask_prefix = loss_mask_prefix(data_prefix)
    masks = MMapIndexedDataset(mask_prefix)
    if not np.array_equal(masks.sequence_lengths, text.sequence_lengths):
        raise ConfigError(f"--sft: {mask_prefix} does not match {data_prefix} (other "
                          "conversations or lengths: preprocess them together)")
    return masks


def build_sft_datasets(data_prefix: str, splits_string: str, num_samples: Sequence[int],
                       seq_length: int, seed: int, pad_id: int, overlong: str = "error",
                       embedding_size: int | None = None, cache_dir: str | None = None,
                       log: bool = True) -> tuple[SFTDataset | None, ...]:
    """(train, valid, test) :class:`SFTDataset` of ``--data-path`` split by ``--split``; the
    truncated / skipped conversations of each split are counted in the log (``log``)."""
    text = open_checked_dataset(data_prefix, embedding_size, cache_dir)
    masks = open_sft_masks(data_prefix, text)
    bounds = get_train_valid_test_split(splits_string, len(text))
    out: list[SFTDataset | None] = []
    for i, name in enumerate(SPLIT_NAMES):
        if bounds[i + 1] <= bounds[i] or num_samples[i] <= 0:
            out.append(None)
            continue
        documents = np.arange(bounds[i], bounds[i + 1], dtype=np.int64)
        dataset = SFTDataset(name, text, masks, documents, num_samples[i], seq_length, seed,
                             pad_id, overlong)
        if log and (dataset.truncated or dataset.skipped):
            print(f" --sft {name}: {dataset.truncated} of {dataset.conversations} conversations "
                  f"truncated, {dataset.skipped} skipped (longer than --seq-length "
                  f"{seq_length}; --sft-overlong {overlong})", flush=True)
        out.append(dataset)
    return tuple(out)


def is_logging_process() -> bool:
    """Rank 0 of a torchrun job (or a single process)."""
    return os.environ.get("RANK", "0") == "0"
