"""MMIDIDX v1 indexed dataset: round trips, exact bytes, corruption errors."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from megatron_chimera.data.indexed_dataset import (
    DTYPE_CODES,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    MMapIndexedDataset,
    optimal_dtype,
)

pytestmark = pytest.mark.timeout(60)


def _build(prefix, dtype, documents):
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype)
    for doc in documents:
        for seq in doc:
            builder.add_item(np.asarray(seq))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")


@pytest.mark.parametrize("code", sorted(DTYPE_CODES))
def test_round_trip_every_dtype(tmp_path, code):
    dtype = np.dtype(DTYPE_CODES[code])
    rng = np.random.default_rng(code)
    high = 100 if dtype.kind in "iu" else 1.0
    docs = [
        [rng.uniform(0, high, size=n).astype(dtype) for n in lengths]
        for lengths in ([3, 0, 5], [1], [], [7, 2])
    ]
    prefix = str(tmp_path / "ds")
    _build(prefix, dtype, docs)
    ds = MMapIndexedDataset(prefix)
    flat = [seq for doc in docs for seq in doc]
    assert ds.dtype == dtype
    assert len(ds) == len(flat)
    assert ds.sequence_lengths.tolist() == [len(s) for s in flat]
    assert ds.document_indices.tolist() == [0, 3, 4, 4, 6]
    for i, seq in enumerate(flat):
        np.testing.assert_array_equal(ds[i], seq)
        assert ds[i].dtype == dtype
    np.testing.assert_array_equal(ds.get(0, offset=1, length=2), flat[0][1:3])
    np.testing.assert_array_equal(ds.get(5, offset=1), flat[5][1:])
    assert [a.tolist() for a in ds.get_document(0)] == [s.tolist() for s in docs[0]]
    with open(f"{prefix}.idx", "rb") as f:
        assert f.read(18)[9:17] == struct.pack("<Q", 1)


def test_exact_index_bytes(tmp_path):
    """Two documents [[5, 6, 7], [8]] and [[9, 10]] as uint16, byte by byte."""
    prefix = str(tmp_path / "tiny")
    _build(prefix, np.uint16, [[[5, 6, 7], [8]], [[9, 10]]])
    expected = (
        b"MMIDIDX\x00\x00"
        + (1).to_bytes(8, "little")  # version
        + bytes([8])  # uint16
        + (3).to_bytes(8, "little")  # sequences
        + (3).to_bytes(8, "little")  # documents + 1
        + b"".join(n.to_bytes(4, "little") for n in (3, 1, 2))  # int32 lengths
        + b"".join(n.to_bytes(8, "little") for n in (0, 6, 8))  # int64 byte offsets
        + b"".join(n.to_bytes(8, "little") for n in (0, 2, 3))  # int64 document indices
    )
    assert open(f"{prefix}.idx", "rb").read() == expected
    assert open(f"{prefix}.bin", "rb").read() == b"".join(
        n.to_bytes(2, "little") for n in (5, 6, 7, 8, 9, 10)
    )


def test_optimal_dtype():
    assert optimal_dtype(50257) is np.uint16
    assert optimal_dtype(65500) is np.int32
    assert optimal_dtype(None) is np.int32


def test_add_index_merges(tmp_path):
    a, b, m = (str(tmp_path / n) for n in "abm")
    _build(a, np.int32, [[[1, 2]], [[3], [4, 5]]])
    _build(b, np.int32, [[[6]]])
    builder = IndexedDatasetBuilder(f"{m}.bin", np.int32)
    builder.add_index(a)
    builder.add_index(b)
    builder.finalize(f"{m}.idx")
    ds = MMapIndexedDataset(m)
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2], [3], [4, 5], [6]]
    assert ds.document_indices.tolist() == [0, 1, 3, 4]


@pytest.fixture
def good(tmp_path):
    prefix = str(tmp_path / "good")
    _build(prefix, np.int32, [[[1, 2, 3]], [[4, 5]]])
    return prefix


def _rewrite(path, fn):
    data = bytearray(open(path, "rb").read())
    open(path, "wb").write(bytes(fn(data)))


def test_bad_magic(good):
    _rewrite(f"{good}.idx", lambda d: b"XXXXXXXXX" + d[9:])
    with pytest.raises(IndexedDatasetError, match=r"good\.idx.*magic"):
        MMapIndexedDataset(good)


def test_bad_version(good):
    _rewrite(f"{good}.idx", lambda d: d[:9] + struct.pack("<Q", 2) + d[17:])
    with pytest.raises(IndexedDatasetError, match=r"good\.idx.*version 2"):
        MMapIndexedDataset(good)


def test_truncated_index(good):
    _rewrite(f"{good}.idx", lambda d: d[:-5])
    with pytest.raises(IndexedDatasetError, match=r"good\.idx.*truncated"):
        MMapIndexedDataset(good)


def test_truncated_header(good):
    _rewrite(f"{good}.idx", lambda d: d[:20])
    with pytest.raises(IndexedDatasetError, match=r"good\.idx.*truncated"):
        MMapIndexedDataset(good)


def test_short_bin(good):
    _rewrite(f"{good}.bin", lambda d: d[:-1])
    with pytest.raises(IndexedDatasetError, match=r"good\.bin.*truncated"):
        MMapIndexedDataset(good)


def test_missing_files(tmp_path, good):
    with pytest.raises(IndexedDatasetError, match=r"nothere\.idx.*not found"):
        MMapIndexedDataset(str(tmp_path / "nothere"))
    (tmp_path / "good.bin").unlink()
    with pytest.raises(IndexedDatasetError, match=r"good\.bin.*not found"):
        MMapIndexedDataset(good)


def test_bad_dtype_code(good):
    _rewrite(f"{good}.idx", lambda d: d[:17] + bytes([42]) + d[18:])
    with pytest.raises(IndexedDatasetError, match=r"good\.idx.*dtype code 42"):
        MMapIndexedDataset(good)


def test_no_temp_files_left(tmp_path, good):
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.bin", "good.idx"]
