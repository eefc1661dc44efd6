"""Checks when a dataset is opened for training: exact .bin size, non-empty, token ids < vocab."""

from __future__ import annotations

import os

import numpy as np
import pytest

from megatron_chimera.data.dataset_utils import open_checked_dataset
from megatron_chimera.data.gpt_dataset import build_train_valid_test_datasets
from megatron_chimera.data.indexed_dataset import (
    IndexedDatasetBuilder,
    IndexedDatasetError,
    MMapIndexedDataset,
)
from megatron_chimera.errors import UserError


def write(prefix, docs, dtype=np.uint16) -> str:
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype)
    for doc in docs:
        builder.add_document(np.asarray(doc), [len(doc)])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def test_a_longer_bin_from_another_corpus_is_refused(tmp_path):
    small = write(tmp_path / "small", [[1, 2, 3]])
    big = write(tmp_path / "big", [[1, 2, 3], [4, 5, 6, 7]])
    os.replace(f"{big}.bin", f"{small}.bin")  # the .idx of `small` with a longer .bin
    with pytest.raises(IndexedDatasetError, match="indexes exactly 6 bytes"):
        MMapIndexedDataset(small)


def test_errors_are_user_errors():
    assert issubclass(IndexedDatasetError, UserError)


def test_empty_dataset_is_named(tmp_path):
    empty = write(tmp_path / "empty", [])
    MMapIndexedDataset(empty)  # opening is fine (merging may meet empty parts) ...
    with pytest.raises(IndexedDatasetError, match=r"empty\.idx: the dataset is empty"):
        open_checked_dataset(empty)  # ... training on it is not


def test_token_ids_checked_against_the_padded_vocabulary(tmp_path):
    prefix = write(tmp_path / "ids", [[1, 2, 3], [5, 700, 9]])
    assert MMapIndexedDataset(prefix).max_token_id() == 700
    assert MMapIndexedDataset(prefix).max_token_id(chunk_bytes=2) == 700
    open_checked_dataset(prefix, 701, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(IndexedDatasetError, match=r"ids\.bin: token id 700 is outside .* 640"):
        open_checked_dataset(prefix, 640, cache_dir=str(tmp_path / "cache"))
    cached = list((tmp_path / "cache").glob("*max_token_id*.npy"))
    assert len(cached) == 1 and int(np.load(cached[0])) == 700


def test_gpt_builder_checks_token_ids(tmp_path):
    prefix = write(tmp_path / "ids", [list(range(10, 60)), list(range(200, 300))])
    build_train_valid_test_datasets([prefix], "100,0,0", [4, 0, 0], 8, 1, embedding_size=384)
    with pytest.raises(IndexedDatasetError, match="token id 299"):
        build_train_valid_test_datasets([prefix], "100,0,0", [4, 0, 0], 8, 1,
                                        embedding_size=256)
