"""GPT dataset sample construction against brute-force references; blending; get_batch."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from megatron_chimera.data.blended_dataset import BlendedDataset, build_blending_indices
from megatron_chimera.data.dataset_utils import get_train_valid_test_split, parse_data_paths
from megatron_chimera.data.gpt_dataset import (
    GPTDataset,
    MockGPTDataset,
    build_gpt_indices,
    build_train_valid_test_datasets,
    get_batch,
)
from megatron_chimera.data.gpt_sample_fields import LtorOptions
from megatron_chimera.data.indexed_dataset import IndexedDatasetBuilder, MMapIndexedDataset

pytestmark = pytest.mark.timeout(60)


def _corpus(tmp_path, lengths, name="corpus", start=0):
    """Documents of the given lengths whose tokens are globally distinct (so samples are unique)."""
    prefix = str(tmp_path / name)
    builder = IndexedDatasetBuilder(prefix + ".bin", np.int32)
    token = start
    for n in lengths:
        builder.add_item(np.arange(token, token + n))
        builder.end_document()
        token += n
    builder.finalize(prefix + ".idx")
    return prefix, MMapIndexedDataset(prefix)


def _reference_sample_idx(sizes, doc_idx, seq_length, num_samples):
    """Megatron's sequential construction, written out literally as a loop."""
    out = [(0, 0)]
    doc_pos, offset = 0, 0
    while len(out) <= num_samples:
        remaining = seq_length + 1
        while remaining != 0:
            doc_length = sizes[doc_idx[doc_pos]] - offset
            remaining -= doc_length
            if remaining <= 0:
                offset += remaining + doc_length - 1
                remaining = 0
            else:
                doc_pos += 1
                offset = 0
        out.append((doc_pos, offset))
    return np.array(out)


@pytest.mark.parametrize(
    "lengths,num_samples,seq_length",
    [
        ([5, 9, 1, 0, 14, 3, 7], 4, 6),  # one epoch, an empty document
        ([5, 9, 1, 0, 14, 3, 7], 13, 6),  # several epochs, separate last epoch
        ([5, 9, 1, 4, 14, 3, 7], 20, 4),  # last epoch used for >= 80%: not separated
        ([2, 3], 40, 1),
    ],
)
def test_gpt_indices_against_reference(tmp_path, lengths, num_samples, seq_length):
    sizes = np.array(lengths)
    documents = np.arange(len(lengths))
    doc_idx, sample_idx, shuffle_idx = build_gpt_indices(sizes, documents, num_samples,
                                                         seq_length, seed=1234)
    tokens_per_epoch = sizes.sum()
    epochs = len(doc_idx) // len(documents)
    # the fewest epochs that give num_samples samples
    assert (epochs * tokens_per_epoch - 1) // seq_length >= num_samples
    assert epochs == 1 or ((epochs - 1) * tokens_per_epoch - 1) // seq_length < num_samples
    assert np.array_equal(np.sort(doc_idx), np.sort(np.tile(documents, epochs)))
    total = len(sample_idx) - 1
    assert total == (epochs * tokens_per_epoch - 1) // seq_length
    np.testing.assert_array_equal(
        sample_idx, _reference_sample_idx(sizes, doc_idx, seq_length, total))
    # separate last epoch rule
    separate = False
    if epochs > 1:
        earlier = ((epochs - 1) * tokens_per_epoch - 1) // seq_length
        separate = num_samples - earlier < int(0.8 * ((tokens_per_epoch - 1) // seq_length))
    assert sorted(shuffle_idx.tolist()) == list(range(total))
    if separate:
        assert sorted(doc_idx[-len(documents):].tolist()) == list(documents)
        assert sorted(shuffle_idx[:earlier].tolist()) == list(range(earlier))
    # deterministic in the seed
    again = build_gpt_indices(sizes, documents, num_samples, seq_length, seed=1234)
    for a, b in zip((doc_idx, sample_idx, shuffle_idx), again):
        np.testing.assert_array_equal(a, b)
    other = build_gpt_indices(sizes, documents, num_samples, seq_length, seed=99)
    assert not all(np.array_equal(a, b) for a, b in zip((doc_idx, shuffle_idx), other[::2]))


def test_gpt_samples_are_windows_of_the_shuffled_stream(tmp_path):
    lengths = [5, 9, 1, 0, 14, 3, 7, 11, 2]
    prefix, indexed = _corpus(tmp_path, lengths)
    seq = 6
    ds = GPTDataset("train", prefix, indexed, np.arange(len(lengths)), 20, seq, seed=7,
                    cache_dir=str(tmp_path / "cache"))
    assert len(ds) >= 20
    # brute force: concatenate the documents in doc_idx order, cut windows of seq + 1
    stream = np.concatenate([indexed[int(d)] for d in ds.doc_idx])
    windows = [stream[i * seq : i * seq + seq + 1] for i in range(len(ds))]
    for k in range(len(ds)):
        sample = ds[k]["text"]
        assert sample.dtype == np.int64 and sample.shape == (seq + 1,)
        np.testing.assert_array_equal(sample, windows[int(ds.shuffle_idx[k])])
    # consecutive (unshuffled) samples overlap by exactly one token
    for i in range(len(windows) - 1):
        assert windows[i][-1] == windows[i + 1][0]


def test_cache_is_reused_and_identical(tmp_path):
    prefix, indexed = _corpus(tmp_path, [4, 8, 15, 16, 23, 42])
    cache = str(tmp_path / "cache")
    docs = np.arange(6)
    first = GPTDataset("train", prefix, indexed, docs, 30, 8, seed=3, cache_dir=cache)
    stamps = {p: os.stat(p).st_mtime_ns for p in first.cache_paths.values()}
    loaded = GPTDataset("train", prefix, indexed, docs, 30, 8, seed=3, cache_dir=cache,
                        build_cache=False)
    assert {p: os.stat(p).st_mtime_ns for p in first.cache_paths.values()} == stamps
    for k in range(len(first)):
        np.testing.assert_array_equal(first[k]["text"], loaded[k]["text"])
    with pytest.raises(FileNotFoundError, match="build the dataset caches first"):
        GPTDataset("train", prefix, indexed, docs, 31, 8, seed=3, cache_dir=cache,
                   build_cache=False)
    assert not [f for f in os.listdir(cache) if ".tmp." in f]


def test_split_boundaries():
    assert get_train_valid_test_split("969,30,1", 1000) == [0, 969, 999, 1000]
    assert get_train_valid_test_split("8,2", 10) == [0, 8, 10, 10]
    assert get_train_valid_test_split("1/1/1", 10) == [0, 4, 7, 10]  # 3+3+3, then shifted by 1
    assert get_train_valid_test_split("969,30,1", 7)[-1] == 7


def test_build_train_valid_test(tmp_path):
    prefix, _ = _corpus(tmp_path, [10 + i % 7 for i in range(100)])
    train, valid, test = build_train_valid_test_datasets(
        [prefix], "90,10,0", [50, 5, 5], seq_length=16, seed=1, cache_dir=str(tmp_path))
    assert test is None and len(train) >= 50 and len(valid) >= 5
    first_valid_token = sum(10 + i % 7 for i in range(90))
    assert all(valid[k]["text"].min() >= first_valid_token for k in range(len(valid)))
    assert all(train[k]["text"].max() < first_valid_token for k in range(len(train)))


def test_blending_indices_follow_weights():
    weights = [0.5, 0.3, 0.2]
    index, sample_index = build_blending_indices(weights, 1000)
    for n in (10, 100, 1000):
        counts = np.bincount(index[:n], minlength=3)
        assert np.all(np.abs(counts - np.array(weights) * n) <= 1.0 + 1e-9)
    for d in range(3):  # each dataset is read in order 0, 1, 2, ...
        assert sample_index[index == d].tolist() == list(range(int((index == d).sum())))


def test_blended_datasets(tmp_path):
    pa, _ = _corpus(tmp_path, [20] * 30, "a", start=0)
    pb, _ = _corpus(tmp_path, [20] * 30, "b", start=10_000)
    assert parse_data_paths(["3", pa, "1", pb]) == ([pa, pb], [0.75, 0.25])
    train, _, _ = build_train_valid_test_datasets(
        ["3", pa, "1", pb], "1,0,0", [40, 0, 0], seq_length=8, seed=5, cache_dir=str(tmp_path))
    assert isinstance(train, BlendedDataset) and len(train) == 40
    from_b = sum(int(train[k]["text"][0] >= 10_000) for k in range(40))
    assert from_b == 10


def test_mock_dataset_deterministic():
    a = MockGPTDataset("train", 10, 16, vocab_size=50, eod=49, seed=1)
    b = MockGPTDataset("train", 10, 16, vocab_size=50, eod=49, seed=1)
    v = MockGPTDataset("valid", 10, 16, vocab_size=50, eod=49, seed=1)
    assert a[3]["text"].shape == (17,) and a[3]["text"].dtype == np.int64
    np.testing.assert_array_equal(a[3]["text"], b[3]["text"])
    assert not np.array_equal(a[3]["text"], v[3]["text"])
    assert (a[3]["text"] == 49).any()


def test_get_batch():
    eod = 0
    text = torch.tensor([[5, 6, 0, 7, 8, 0, 9], [1, 2, 3, 4, 5, 6, 7]])
    options = LtorOptions(eod, reset_position_ids=True, reset_attention_mask=True,
                          eod_mask_loss=True)
    batch = get_batch({"text": text}, options)
    assert batch.tokens.tolist() == [[5, 6, 0, 7, 8, 0], [1, 2, 3, 4, 5, 6]]
    assert batch.labels.tolist() == [[6, 0, 7, 8, 0, 9], [2, 3, 4, 5, 6, 7]]
    assert batch.loss_mask.tolist() == [[1, 1, 0, 1, 1, 0], [1] * 6]
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]]
    assert batch.document_ids.tolist() == [[0, 0, 0, 1, 1, 1], [0] * 6]
    plain = get_batch({"text": text})  # plain causal: no document ids, no mask of any kind
    assert plain.position_ids.tolist()[0] == list(range(6))
    assert plain.loss_mask.sum() == 12 and plain.document_ids is None
