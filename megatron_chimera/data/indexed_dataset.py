"""Megatron's memory-mapped indexed dataset (MMIDIDX version 1), byte for byte.

A dataset is a pair of files sharing a path prefix:

* ``{prefix}.bin`` -- the tokens of every sequence, concatenated, little-endian, in the index dtype;
* ``{prefix}.idx`` -- ``b"MMIDIDX\\x00\\x00"`` (9 bytes), version ``<Q`` = 1, dtype code ``<B``,
  sequence count ``<Q``, document count ``<Q`` (= documents + 1), then ``int32`` sequence lengths,
  ``int64`` byte offsets of the sequences in ``.bin`` and ``int64`` document indices (starting
  with 0; document ``d`` is sequences ``[document_indices[d], document_indices[d + 1])``).

A "sequence" is a document, or a sentence when the corpus was preprocessed with
``--split-sentences``.
"""

from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Iterable, Sequence
from functools import cached_property

import numpy as np

from megatron_chimera.atomic import replace_atomically, temp_path_beside
from megatron_chimera.errors import InputFileError

_INDEX_HEADER = b"MMIDIDX\x00\x00"
_INDEX_VERSION = 1
_HEADER_SIZE = len(_INDEX_HEADER) + 8 + 1 + 8 + 8

DTYPE_CODES: dict[int, type[np.number]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}


class IndexedDatasetError(InputFileError):
    """A missing, truncated or corrupt ``.bin``/``.idx`` file; the message names the file."""


def dtype_code(dtype: np.dtype | type) -> int:
    """The MMIDIDX code of a numpy dtype."""
    dtype = np.dtype(dtype)
    for code, candidate in DTYPE_CODES.items():
        if np.dtype(candidate) == dtype:
            return code
    raise ValueError(f"dtype {dtype} cannot be stored in an MMIDIDX dataset")


def optimal_dtype(vocab_size: int | None) -> type[np.number]:
    """Megatron's token dtype: uint16 when the vocabulary has fewer than 65500 ids, else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def data_file_path(prefix: str) -> str:
    """Path of the ``.bin`` file of a dataset prefix."""
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    """Path of the ``.idx`` file of a dataset prefix."""
    return prefix + ".idx"


def write_index(
    idx_path: str,
    dtype: np.dtype | type,
    sequence_lengths: np.ndarray,
    document_indices: np.ndarray,
) -> None:
    """Write an ``.idx`` file atomically from the sequence lengths and document indices."""
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    docs = np.asarray(document_indices, dtype=np.int64)
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * itemsize, out=pointers[1:])
    tmp = temp_path_beside(idx_path)
    try:
        with open(tmp, "wb") as f:
            f.write(_INDEX_HEADER)
            f.write(struct.pack("<Q", _INDEX_VERSION))
            f.write(struct.pack("<B", dtype_code(dtype)))
            f.write(struct.pack("<Q", len(lengths)))
            f.write(struct.pack("<Q", len(docs)))
            f.write(lengths.astype("<i4").tobytes(order="C"))
            f.write(pointers.astype("<i8").tobytes(order="C"))
            f.write(docs.astype("<i8").tobytes(order="C"))
        replace_atomically(tmp, idx_path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class _GrowableArray:
    """An append-only numpy buffer (amortised doubling), so an index of N entries costs 8N bytes."""

    def __init__(self, dtype: type, initial: Iterable[int] = ()) -> None:
        self._data = np.zeros(1024, dtype=dtype)
        self._size = 0
        for value in initial:
            self.append(value)

    def append(self, value: int) -> None:
        if self._size == len(self._data):
            self._data = np.resize(self._data, 2 * len(self._data))
        self._data[self._size] = value
        self._size += 1

    def extend(self, values: np.ndarray) -> None:
        needed = self._size + len(values)
        if needed > len(self._data):
            self._data = np.resize(self._data, max(needed, 2 * len(self._data)))
        self._data[self._size : needed] = values
        self._size = needed

    def __len__(self) -> int:
        return self._size

    def view(self) -> np.ndarray:
        return self._data[: self._size]


class IndexedDatasetBuilder:
    """Streams sequences into ``.bin`` and keeps the index in numpy arrays until ``finalize``.

    The ``.bin`` is written to a temporary file and renamed into place by ``finalize``.
    """

    def __init__(self, bin_path: str, dtype: np.dtype | type = np.int32) -> None:
        dtype_code(dtype)  # reject dtypes the format cannot hold
        self.dtype = np.dtype(dtype)
        self.bin_path = bin_path
        self._tmp_bin = temp_path_beside(bin_path)
        self._data_file = open(self._tmp_bin, "wb")  # closed by finalize or abort
        self._sequence_lengths = _GrowableArray(np.int32)
        self._document_indices = _GrowableArray(np.int64, [0])

    @property
    def sequence_count(self) -> int:
        """Sequences added so far."""
        return len(self._sequence_lengths)

    def add_item(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one sequence (a document, or a sentence of the current document)."""
        array = np.asarray(tokens)
        if array.ndim != 1:
            raise ValueError(f"add_item expects a 1-d sequence, got shape {array.shape}")
        self._data_file.write(array.astype(self.dtype.newbyteorder("<"), copy=False).tobytes())
        self._sequence_lengths.append(len(array))

    def end_document(self) -> None:
        """Close the current document: the sequences added since the last call form one document."""
        self._document_indices.append(len(self._sequence_lengths))

    def add_document(self, tokens: Sequence[int] | np.ndarray, lengths: Sequence[int]) -> None:
        """Append a whole document given as its concatenated tokens and its sequence lengths."""
        array = np.asarray(tokens)
        if int(np.sum(lengths)) != len(array):
            raise ValueError("add_document: lengths do not sum to the number of tokens")
        self._data_file.write(array.astype(self.dtype.newbyteorder("<"), copy=False).tobytes())
        self._sequence_lengths.extend(np.asarray(lengths, dtype=np.int32))
        self.end_document()

    def add_index(self, path_prefix: str) -> None:
        """Append a whole existing dataset (same dtype), as ``tools/merge_datasets.py`` does."""
        other = MMapIndexedDataset(path_prefix)
        if other.dtype != self.dtype:
            raise IndexedDatasetError(
                f"{index_file_path(path_prefix)}: dtype {other.dtype} differs from {self.dtype}"
            )
        offset = len(self._sequence_lengths)
        self._sequence_lengths.extend(other.sequence_lengths)
        self._document_indices.extend(other.document_indices[1:] + offset)
        with open(data_file_path(path_prefix), "rb") as f:
            shutil.copyfileobj(f, self._data_file)

    def finalize(self, idx_path: str) -> None:
        """Write the ``.idx`` and move the ``.bin`` into place (both atomically)."""
        self._data_file.close()
        replace_atomically(self._tmp_bin, self.bin_path)
        write_index(idx_path, self.dtype, self._sequence_lengths.view(),
                    self._document_indices.view())

    def abort(self) -> None:
        """Discard the partial ``.bin`` (on error)."""
        self._data_file.close()
        if os.path.exists(self._tmp_bin):
            os.unlink(self._tmp_bin)


class _Index:
    """The parsed ``.idx`` file, memory-mapped."""

    def __init__(self, idx_path: str) -> None:
        self.path = idx_path
        if not os.path.isfile(idx_path):
            raise IndexedDatasetError(f"{idx_path}: index file not found")
        file_size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            header = f.read(_HEADER_SIZE)
        if len(header) < len(_INDEX_HEADER) or header[: len(_INDEX_HEADER)] != _INDEX_HEADER:
            raise IndexedDatasetError(
                f"{idx_path}: not an MMIDIDX index (bad magic {header[:9]!r}, expected "
                f"{_INDEX_HEADER!r})"
            )
        if len(header) < _HEADER_SIZE:
            raise IndexedDatasetError(f"{idx_path}: truncated header ({file_size} bytes)")
        offset = len(_INDEX_HEADER)
        (version,) = struct.unpack_from("<Q", header, offset)
        if version != _INDEX_VERSION:
            raise IndexedDatasetError(
                f"{idx_path}: unsupported index version {version} (expected {_INDEX_VERSION})"
            )
        (code,) = struct.unpack_from("<B", header, offset + 8)
        if code not in DTYPE_CODES:
            raise IndexedDatasetError(f"{idx_path}: unknown dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        self.sequence_count, self.document_count = struct.unpack_from("<QQ", header, offset + 9)
        expected = _HEADER_SIZE + self.sequence_count * (4 + 8) + self.document_count * 8
        if file_size < expected:
            raise IndexedDatasetError(
                f"{idx_path}: truncated index: {file_size} bytes, the header promises {expected} "
                f"({self.sequence_count} sequences, {self.document_count} document indices)"
            )
        if self.document_count < 1:
            raise IndexedDatasetError(f"{idx_path}: document count is 0 (must be documents + 1)")
        self._buffer = np.memmap(idx_path, mode="r", order="C")
        pos = _HEADER_SIZE
        self.sequence_lengths = np.frombuffer(
            self._buffer, dtype="<i4", count=self.sequence_count, offset=pos
        )
        pos += self.sequence_lengths.nbytes
        self.sequence_pointers = np.frombuffer(
            self._buffer, dtype="<i8", count=self.sequence_count, offset=pos
        )
        pos += self.sequence_pointers.nbytes
        self.document_indices = np.frombuffer(
            self._buffer, dtype="<i8", count=self.document_count, offset=pos
        )
        if self.document_indices[0] != 0 or self.document_indices[-1] > self.sequence_count:
            raise IndexedDatasetError(
                f"{idx_path}: corrupt document indices (first {self.document_indices[0]}, last "
                f"{self.document_indices[-1]}, {self.sequence_count} sequences)"
            )


class MMapIndexedDataset:
    """Read-only, memory-mapped view of a Megatron ``.bin``/``.idx`` dataset."""

    def __init__(self, path_prefix: str) -> None:
        self.path_prefix = path_prefix
        self._index = _Index(index_file_path(path_prefix))
        bin_path = data_file_path(path_prefix)
        if not os.path.isfile(bin_path):
            raise IndexedDatasetError(f"{bin_path}: data file not found")
        needed = 0
        if self._index.sequence_count:
            needed = int(self._index.sequence_pointers[-1]) + int(
                self._index.sequence_lengths[-1]
            ) * self.dtype.itemsize
        size = os.path.getsize(bin_path)
        if size != needed:
            what = "truncated or mismatched" if size < needed else "from another corpus?"
            raise IndexedDatasetError(
                f"{bin_path}: data file is {size} bytes but {index_file_path(path_prefix)} "
                f"indexes exactly {needed} bytes ({what} .bin)"
            )
        self._bin = np.memmap(bin_path, mode="r", order="C") if size else np.zeros(0, np.uint8)

    @property
    def dtype(self) -> np.dtype:
        """Token dtype of the ``.bin``."""
        return self._index.dtype

    @property
    def sequence_lengths(self) -> np.ndarray:
        """int32 length of every sequence."""
        return self._index.sequence_lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        """int64 byte offset of every sequence in the ``.bin``."""
        return self._index.sequence_pointers

    @property
    def document_indices(self) -> np.ndarray:
        """int64 sequence index where each document starts, followed by the sequence count."""
        return self._index.document_indices

    # Megatron's legacy names
    sizes = sequence_lengths
    doc_idx = document_indices

    @cached_property
    def num_documents(self) -> int:
        """Number of documents."""
        return len(self.document_indices) - 1

    def __len__(self) -> int:
        return self._index.sequence_count

    def __getitem__(self, idx: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            return [self.get(i) for i in range(start, stop, step)]
        return self.get(idx)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (a read-only view)."""
        n = len(self)
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError(f"sequence {idx} out of range for {n} sequences in {self.path_prefix}")
        seq_len = int(self.sequence_lengths[idx])
        if length is None:
            length = seq_len - offset
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(
                f"tokens [{offset}, {offset + length}) out of range for sequence {idx} "
                f"of length {seq_len}"
            )
        pointer = int(self.sequence_pointers[idx]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, dtype=self.dtype.newbyteorder("<"), count=length,
                             offset=pointer)

    def max_token_id(self, chunk_bytes: int = 1 << 26) -> int:
        """The largest token id in the ``.bin`` (-1 when empty), read ``chunk_bytes`` at a time."""
        tokens = np.frombuffer(self._bin, dtype=self.dtype.newbyteorder("<"))
        step = max(1, chunk_bytes // self.dtype.itemsize)
        return max((int(tokens[i:i + step].max()) for i in range(0, len(tokens), step)),
                   default=-1)

    def get_document(self, doc: int) -> list[np.ndarray]:
        """The sequences (sentences) of document ``doc``."""
        start, stop = int(self.document_indices[doc]), int(self.document_indices[doc + 1])
        return [self.get(i) for i in range(start, stop)]


def dataset_exists(path_prefix: str) -> bool:
    """True when both ``.bin`` and ``.idx`` exist for the prefix."""
    return os.path.isfile(index_file_path(path_prefix)) and os.path.isfile(
        data_file_path(path_prefix)
    )
