"""Megatron's GPT dataset: fixed-length samples cut across shuffled documents, with cached indices.

Three indices, built once per (data, split, num_samples, seq_length, seed) and cached as ``.npy``:

* ``doc_idx``: the split's documents repeated for as many epochs as ``num_samples`` needs, shuffled
  per epoch block; when the last epoch is needed for less than 80% of its samples it is shuffled
  separately ("separate last epoch"), so its partial use does not bias the earlier epochs;
* ``sample_idx[i] = (position in doc_idx, token offset)`` where sample ``i`` starts; a sample is
  ``seq_length + 1`` tokens and consecutive samples share one token (a label is the next input);
* ``shuffle_idx``: a permutation of the samples (the separated last epoch is shuffled on its own).

"Documents" are the sequences of the indexed dataset (for a sentence-split dataset, sentences).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NamedTuple

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
from megatron_chimera.data.gpt_sample_fields import LtorOptions, ltor_sample_fields
from megatron_chimera.data.indexed_dataset import MMapIndexedDataset

LAST_EPOCH_FRACTION = 0.80


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Smallest number of epochs whose tokens give ``num_samples`` samples of ``seq_length``."""
    if tokens_per_epoch < 2:
        raise ValueError("the dataset split has fewer than 2 tokens; cannot build GPT samples")
    num_epochs = 1
    while (num_epochs * tokens_per_epoch - 1) // seq_length < num_samples:
        num_epochs += 1
    return num_epochs


def build_doc_idx(
    documents: np.ndarray, num_epochs: int, np_rng: np.random.RandomState, separate_last_epoch: bool
) -> np.ndarray:
    """Documents repeated ``num_epochs`` times, shuffled (the last epoch apart when separated)."""
    if not separate_last_epoch or num_epochs == 1:
        doc_idx = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
        np_rng.shuffle(doc_idx)
        return doc_idx
    first = build_doc_idx(documents, num_epochs - 1, np_rng, False)
    last = build_doc_idx(documents, 1, np_rng, False)
    return np.concatenate((first, last))


def build_sample_idx(
    sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_epochs: int, tokens_per_epoch: int
) -> np.ndarray:
    """``[num_samples + 1, 2]`` start (doc_idx position, offset) of every sample, plus the end.

    Sample ``i`` covers global tokens ``[i * seq_length, (i + 1) * seq_length]`` of the documents
    concatenated in ``doc_idx`` order; each start is located in the document that contains it.
    """
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    lengths = np.asarray(sizes, dtype=np.int64)[doc_idx]
    starts = np.cumsum(lengths) - lengths
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    where = np.searchsorted(starts, positions, side="right") - 1
    dtype = np.int32 if len(doc_idx) < np.iinfo(np.int32).max else np.int64
    sample_idx = np.empty((num_samples + 1, 2), dtype=dtype)
    sample_idx[:, 0] = where
    sample_idx[:, 1] = positions - starts[where]
    sample_idx[0] = (0, 0)
    return sample_idx


def build_shuffle_idx(
    num_samples: int, total_size: int, np_rng: np.random.RandomState
) -> np.ndarray:
    """Permutation of ``range(total_size)`` whose first ``num_samples`` are shuffled apart."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    np_rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    np_rng.shuffle(last)
    return np.concatenate((first, last))


def build_gpt_indices(
    sizes: np.ndarray, documents: np.ndarray, num_samples: int, seq_length: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(doc_idx, sample_idx, shuffle_idx) of Megatron's GPT dataset, deterministic in ``seed``."""
    tokens_per_epoch = int(np.sum(np.asarray(sizes, dtype=np.int64)[documents]))
    num_epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
    separate_last_epoch = False
    if num_epochs > 1:
        from_earlier = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        last_epoch_samples = num_samples - from_earlier
        per_epoch = (tokens_per_epoch - 1) // seq_length
        assert 0 <= last_epoch_samples <= per_epoch + 1
        separate_last_epoch = last_epoch_samples < int(LAST_EPOCH_FRACTION * per_epoch)
    np_rng = np.random.RandomState(seed=seed)
    doc_idx = build_doc_idx(documents, num_epochs, np_rng, separate_last_epoch)
    sample_idx = build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
    total = sample_idx.shape[0] - 1
    shuffled = from_earlier if separate_last_epoch else total
    shuffle_idx = build_shuffle_idx(shuffled, total, np_rng)
    return doc_idx, sample_idx, shuffle_idx


class GPTDataset(torch.utils.data.Dataset):
    """Samples ``{"text": int64[seq_length + 1]}`` from a range of documents of an indexed dataset.

    With ``build_cache=True`` the indices are built (if not cached yet) and saved atomically; with
    ``False`` they are only memory-mapped, so call it with True on one rank, barrier, then on all.
    """

    def __init__(
        self,
        name: str,
        data_prefix: str,
        indexed_dataset: MMapIndexedDataset,
        documents: np.ndarray,
        num_samples: int,
        seq_length: int,
        seed: int,
        cache_dir: str | None = None,
        build_cache: bool = True,
    ) -> None:
        if seq_length < 1:
            raise ConfigError("--seq-length must be positive")
        documents = np.asarray(documents)
        if len(documents) == 0 or documents.min() < 0 or documents.max() >= len(indexed_dataset):
            raise ValueError(f"{name}: document range out of bounds for {data_prefix}")
        self.name = name
        self.indexed_dataset = indexed_dataset
        self.seq_length = seq_length
        prefix = cache_prefix(data_prefix, cache_dir, f"{name}_gpt", {
            "class": "GPTDataset", "path": os.path.abspath(data_prefix),
            "sequences": len(indexed_dataset), "first": int(documents[0]),
            "last": int(documents[-1]), "count": len(documents), "num_samples": num_samples,
            "seq_length": seq_length, "seed": seed, "format": 1,
        })
        paths = {k: f"{prefix}_{k}.npy" for k in ("doc_idx", "sample_idx", "shuffle_idx")}
        if build_cache and not all(os.path.isfile(p) for p in paths.values()):
            indices = build_gpt_indices(indexed_dataset.sequence_lengths, documents, num_samples,
                                        seq_length, seed)
            for path, array in zip(paths.values(), indices):
                save_npy_atomic(path, array)
        self.doc_idx = load_npy(paths["doc_idx"], "GPT doc index")
        self.sample_idx = load_npy(paths["sample_idx"], "GPT sample index")
        self.shuffle_idx = load_npy(paths["shuffle_idx"], "GPT shuffle index")
        self.cache_paths = paths

    def __len__(self) -> int:
        return self.shuffle_idx.shape[0]

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        i = int(self.shuffle_idx[idx])
        (doc_f, offset_f), (doc_l, offset_l) = self.sample_idx[i], self.sample_idx[i + 1]
        get = self.indexed_dataset.get
        if doc_f == doc_l:
            parts = [get(int(self.doc_idx[doc_f]), int(offset_f), int(offset_l - offset_f + 1))]
        else:
            parts = [get(int(self.doc_idx[doc_f]), int(offset_f))]
            parts += [get(int(self.doc_idx[d])) for d in range(doc_f + 1, doc_l)]
            parts.append(get(int(self.doc_idx[doc_l]), 0, int(offset_l) + 1))
        return {"text": np.concatenate(parts).astype(np.int64)}


class MockGPTDataset(torch.utils.data.Dataset):
    """Deterministic synthetic GPT samples (``--mock-data``): learnable counting runs split by eod.

    Sample ``i`` of split ``name`` depends only on ``(seed, name, i)``: a run ``a, a+1, ...``
    (mod vocab) with an eod token at a random position.
    """

    def __init__(self, name: str, num_samples: int, seq_length: int, vocab_size: int, eod: int,
                 seed: int) -> None:
        if vocab_size < 2:
            raise ConfigError("mock data needs a vocabulary of at least 2 ids")
        self.split_id = SPLIT_NAMES.index(name) if name in SPLIT_NAMES else len(SPLIT_NAMES)
        self.num_samples, self.seq_length = num_samples, seq_length
        self.vocab_size, self.eod, self.seed = vocab_size, eod, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        if not 0 <= idx < self.num_samples:
            raise IndexError(idx)
        rng = np.random.default_rng([self.seed, self.split_id, idx])
        start = int(rng.integers(self.vocab_size))
        text = (start + np.arange(self.seq_length + 1, dtype=np.int64)) % self.vocab_size
        text[int(rng.integers(self.seq_length + 1))] = self.eod
        return {"text": text}


def _build_split_datasets(
    data_prefix: str, splits_string: str, num_samples: Sequence[int], seq_length: int, seed: int,
    cache_dir: str | None, build_cache: bool, embedding_size: int | None = None,
) -> list[GPTDataset | None]:
    indexed = open_checked_dataset(data_prefix, embedding_size, cache_dir, build_cache)
    bounds = get_train_valid_test_split(splits_string, len(indexed))
    out: list[GPTDataset | None] = []
    for i, name in enumerate(SPLIT_NAMES):
        if bounds[i + 1] <= bounds[i] or num_samples[i] <= 0:
            out.append(None)
            continue
        documents = np.arange(bounds[i], bounds[i + 1], dtype=np.int32)
        out.append(GPTDataset(name, data_prefix, indexed, documents, num_samples[i], seq_length,
                              seed, cache_dir, build_cache))
    return out


def build_train_valid_test_datasets(
    data_prefix: Sequence[str] | None,
    splits_string: str,
    train_valid_test_num_samples: Sequence[int],
    seq_length: int,
    seed: int,
    cache_dir: str | None = None,
    build_cache: bool = True,
    embedding_size: int | None = None,
    split_paths: Sequence[Sequence[str] | None] | None = None,
) -> tuple[torch.utils.data.Dataset | None, ...]:
    """(train, valid, test) GPT datasets from ``--data-path`` (one prefix or weighted prefixes)
    split by ``--split``, or with ``split_paths`` (``--train-data-path`` ...) each split from
    its own files (``data_prefix`` and ``splits_string`` unused).

    A split with no documents or no requested samples is ``None``. An empty dataset, or one
    with a token id ``>= embedding_size`` (the model's padded vocabulary), is an error.
    """
    from megatron_chimera.data.blended_dataset import (
        blend_split_datasets,
        build_per_split_datasets,
    )

    if split_paths is not None:
        def whole(name: str, prefix: str, num_samples: int) -> GPTDataset:
            indexed = open_checked_dataset(prefix, embedding_size, cache_dir, build_cache)
            return GPTDataset(name, prefix, indexed, np.arange(len(indexed), dtype=np.int32),
                              num_samples, seq_length, seed, cache_dir, build_cache)

        return build_per_split_datasets(split_paths, train_valid_test_num_samples, whole,
                                        cache_dir, build_cache)

    prefixes, weights = parse_data_paths(data_prefix)
    counts = ([train_valid_test_num_samples] if weights is None
              else blended_num_samples(weights, train_valid_test_num_samples))
    built = [
        _build_split_datasets(p, splits_string, n, seq_length, seed, cache_dir, build_cache,
                              embedding_size)
        for p, n in zip(prefixes, counts)
    ]
    return blend_split_datasets(built, weights, train_valid_test_num_samples, prefixes[0],
                                cache_dir, build_cache)


class GPTBatch(NamedTuple):
    """A GPT micro-batch in Megatron's order; every tensor is ``[b, s]``.

    ``document_ids`` (the document of each token, for per-document attention) is present only
    with ``--reset-attention-mask``; without it attention is plainly causal and no mask exists.
    Fields a stage did not ask for (``pretrain_gpt2.batch_fields``) are None.
    """

    tokens: torch.Tensor | None
    labels: torch.Tensor | None
    loss_mask: torch.Tensor | None
    document_ids: torch.Tensor | None
    position_ids: torch.Tensor


def get_batch(micro_batch: dict[str, torch.Tensor],
              options: LtorOptions | None = None) -> GPTBatch:
    """Megatron's GPT ``get_batch``: tokens = text[:, :-1], labels = text[:, 1:], and the loss
    mask, position ids (and document ids) the data workers computed (:class:`GPTSampleDataset`).

    A stage may pass only the fields it reads (the others come back None). A raw ``{"text"}``
    batch gets the derived fields computed here from ``options`` (default: plain causal). A
    packed variable-length micro-batch (``data/packed_dataset.py``) carries ``tokens`` and
    ``labels`` themselves (each document shifted on its own).
    """
    text = micro_batch.get("text")
    tokens, labels = micro_batch.get("tokens"), micro_batch.get("labels")
    tokens = None if tokens is None else tokens.long()
    labels = None if labels is None else labels.long()
    if text is not None:
        text = text.long()
        tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
        if not {"loss_mask", "position_ids", "document_ids"} & micro_batch.keys():
            options = options or LtorOptions(eod_token=-1)
            fields = [ltor_sample_fields(row, options) for row in text.cpu().numpy()]
            micro_batch = {key: torch.from_numpy(np.stack([f[key] for f in fields]))
                           .to(text.device) for key in fields[0]}
    loss_mask, positions = micro_batch.get("loss_mask"), micro_batch.get("position_ids")
    return GPTBatch(tokens, labels, None if loss_mask is None else loss_mask.float(),
                    micro_batch.get("document_ids"),
                    None if positions is None else positions.long())
