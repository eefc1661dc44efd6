"""Helpers shared by the GPT, BERT and blended datasets: data paths, splits and the index cache."""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Sequence

import numpy as np

from megatron_chimera.atomic import atomic_write
from megatron_chimera.config import ConfigError
from megatron_chimera.data.indexed_dataset import (
    IndexedDatasetError,
    MMapIndexedDataset,
    data_file_path,
    index_file_path,
)

SPLIT_NAMES = ("train", "valid", "test")


def parse_data_paths(data_path: Sequence[str], flag: str = "--data-path"
                     ) -> tuple[list[str], list[float] | None]:
    """``--data-path p`` or ``w1 p1 w2 p2 ...`` -> (prefixes, normalised weights or None);
    ``flag`` (``--data-path``, ``--train-data-path``, ...) is the one the errors name."""
    items = list(data_path)
    if not items:
        raise ConfigError(f"{flag} is empty")
    if len(items) == 1:
        return items, None
    if len(items) % 2:
        raise ConfigError(
            f"{flag} takes one prefix or weight-prefix pairs (w1 p1 w2 p2 ...), "
            f"got {len(items)} items"
        )
    weights, prefixes = [], []
    for weight, prefix in zip(items[0::2], items[1::2]):
        try:
            value = float(weight)
        except ValueError:
            raise ConfigError(
                f"{flag}: weight {weight!r} (before {prefix}) is not a number"
            ) from None
        if value < 0 or not math.isfinite(value):
            raise ConfigError(f"{flag}: weight {weight} must be a finite number >= 0")
        weights.append(value)
        prefixes.append(prefix)
    total = sum(weights)
    if total <= 0:
        raise ConfigError(f"{flag}: the weights sum to 0")
    return prefixes, [w / total for w in weights]


def blended_num_samples(
    weights: Sequence[float], train_valid_test_num_samples: Sequence[int]
) -> list[list[int]]:
    """Samples to build from each blended dataset: ``ceil(n * w * 1.005)`` (Megatron's margin)."""
    return [
        [int(math.ceil(n * w * 1.005)) for n in train_valid_test_num_samples] for w in weights
    ]


def parse_split(splits_string: str) -> list[float]:
    """Megatron's ``--split 969,30,1`` (or ``969/30/1``) -> three non-negative weights."""
    sep = "," if "," in splits_string else "/"
    try:
        splits = [float(s) for s in splits_string.split(sep) if s.strip()]
    except ValueError:
        raise ConfigError(f"--split {splits_string!r}: expected numbers such as 969,30,1") from None
    if any(s < 0 for s in splits) or len(splits) > 3:
        raise ConfigError(f"--split {splits_string!r}: at most three non-negative numbers")
    while len(splits) < 3:
        splits.append(0.0)
    if sum(splits) <= 0:
        raise ConfigError(f"--split {splits_string!r}: the parts sum to 0")
    return splits


def get_train_valid_test_split(splits_string: str, size: int) -> list[int]:
    """Megatron's ``--split 969,30,1``: boundaries ``[0, a, b, size]`` of the three ranges."""
    splits = parse_split(splits_string)
    total = sum(splits)
    index = [0]
    for split in splits:
        index.append(index[-1] + int(round(split / total * float(size))))
    diff = index[-1] - size
    for i in range(1, len(index)):
        index[i] -= diff
    return index


def cache_prefix(
    data_prefix: str, cache_dir: str | None, kind: str, description: dict[str, object]
) -> str:
    """File prefix of a dataset's cached indices: ``cache_dir`` (or next to the data) + a hash.

    The hash covers every parameter that changes the indices, so stale caches are never reused.
    """
    text = repr(sorted(description.items()))
    digest = hashlib.md5(text.encode("utf-8")).hexdigest()
    directory = cache_dir
    if directory is None:
        directory = os.path.dirname(os.path.abspath(data_prefix))
    os.makedirs(directory, exist_ok=True)
    return os.path.join(directory, f"{os.path.basename(data_prefix)}_{kind}_{digest}")


def save_npy_atomic(path: str, array: np.ndarray) -> None:
    """``np.save`` to a temporary file renamed onto ``path`` (safe with concurrent builders)."""
    atomic_write(path, lambda f: np.save(f, array, allow_pickle=False))


def load_npy(path: str, what: str) -> np.ndarray:
    """Memory-map a cached index; a missing file says which builder should have made it."""
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path}: cached {what} not found; build the dataset caches first "
            "(build_cache=True on one rank, then a barrier)"
        )
    return np.load(path, allow_pickle=False, mmap_mode="r")


def open_checked_dataset(data_prefix: str, embedding_size: int | None = None,
                         cache_dir: str | None = None, build_cache: bool = True
                         ) -> MMapIndexedDataset:
    """Open a ``--data-path`` dataset for training: it must hold at least one document, and
    (given ``embedding_size``, the model's padded vocabulary) every token id must be below it.

    The largest token id is computed once (a pass over the ``.bin``) and cached like the
    indices, keyed by the file's path, size and modification time.
    """
    dataset = MMapIndexedDataset(data_prefix)
    if dataset.num_documents == 0 or len(dataset) == 0:
        raise IndexedDatasetError(
            f"{index_file_path(data_prefix)}: the dataset is empty (0 documents): was the corpus "
            "empty when it was preprocessed?")
    if embedding_size is None:
        return dataset
    bin_path = data_file_path(data_prefix)
    stat = os.stat(bin_path)
    path = cache_prefix(data_prefix, cache_dir, "max_token_id", {
        "path": os.path.abspath(bin_path), "size": stat.st_size, "mtime": stat.st_mtime_ns,
        "format": 1}) + ".npy"
    if os.path.isfile(path):
        largest = int(np.load(path, allow_pickle=False))
    else:  # built by the caching rank; a rank that finds no cache computes it itself
        largest = dataset.max_token_id()
        if build_cache:
            save_npy_atomic(path, np.asarray(largest, dtype=np.int64))
    if largest >= embedding_size:
        raise IndexedDatasetError(
            f"{bin_path}: token id {largest} is outside the model's vocabulary of "
            f"{embedding_size} ids (padded): tokenized with another tokenizer or vocabulary?")
    return dataset
