"""A tensor chunk as a ``torch.save`` archive, written without ``torch.save``; its block checksums.

Stock readers of torch.distributed.checkpoint (``FileSystemReader``, ``dcp_to_torch_save``)
read a tensor chunk with ``torch.load(weights_only=True)``: a zip archive holding ``data.pkl``
(a pickle that rebuilds the tensor from storage ``0``), ``byteorder``, ``version`` and the
storage bytes ``data/0``. :func:`archive_parts` builds that archive around the chunk's bytes
directly: the few hundred bytes of headers and pickle before them and the zip directory after
them, so a writer writes the values straight from the tensor's memory (no archive built in
memory, no miniz CRC over the data, which costs ``torch.save`` ~10x the write here). The zip's
own CRC field of ``data/0`` is 0, as ``torch.save`` writes it with ``compute_crc32`` off
(``torch.load`` does not check it); the entry always carries zip64 sizes, so chunks over 4 GiB
take the same path. The values start 64-byte aligned, like ``torch.save``'s.

Bit rot is caught by :class:`BlockChecksums`: a CRC-32 (zlib) of every block of the chunk's
bytes, kept in the checkpoint's own metadata with the block size. The block size follows the
chunk's shape (:meth:`BlockChecksums.block_size`), so the pieces another layout reads -- whole
rows, or the last dimension cut into 2, 4 or 8 equal parts -- start and end on block boundaries:
a load that reads part of a chunk reads and checks the blocks that hold it, hardly more than
the part.
"""

from __future__ import annotations

import collections
import functools
import io
import pickle
import struct
import sys
import zlib
from array import array
from dataclasses import dataclass

import torch

ALIGNMENT = 64
MIN_BLOCK = 256  # bytes; metadata costs 4 bytes of CRC per block (1.6% at this size)
MAX_BLOCK = 64 * 1024
FLAT_BLOCKS = 4096  # a 0/1-dimensional chunk: at most this many blocks (unless MIN_BLOCK)
CUTS = 8  # the last dimension cut into this many equal parts stays block-aligned
_ARCHIVE = "archive"
_DOS_DATE = (1 << 5) | 1  # 1980-01-01
_U32 = 0xFFFFFFFF


@dataclass(frozen=True)
class BlockChecksums:
    """CRC-32 of every ``block``-byte block of a chunk's ``nbytes`` bytes (the last one
    shorter)."""

    block: int
    crcs: tuple[int, ...]

    @staticmethod
    def block_size(shape: tuple[int, ...], itemsize: int) -> int:
        """The block size (a power of two, MIN_BLOCK..MAX_BLOCK) for a chunk of ``shape``: the
        largest dividing the last dimension's bytes that is at most 1/CUTS of them, so rows and
        the last dimension cut into 2..CUTS equal parts are whole blocks; a 0/1-dimensional chunk
        (read as element ranges) has at most FLAT_BLOCKS blocks."""
        nbytes = itemsize
        for size in shape:
            nbytes *= size
        if len(shape) < 2:
            block = MIN_BLOCK
            while block < MAX_BLOCK and block * FLAT_BLOCKS < nbytes:
                block *= 2
            return block
        last = shape[-1] * itemsize
        block = last & -last if last else MIN_BLOCK  # the largest power of two dividing it
        while block > 1 and block * CUTS > last:
            block //= 2
        return min(MAX_BLOCK, max(MIN_BLOCK, block))

    @classmethod
    def of(cls, data: memoryview, shape: tuple[int, ...], itemsize: int) -> BlockChecksums:
        """The checksums of ``data``: the row-major bytes of a chunk of ``shape`` (elements of
        ``itemsize`` bytes)."""
        block = cls.block_size(shape, itemsize)
        return cls(block, tuple(zlib.crc32(data[i:i + block])
                                for i in range(0, len(data), block)))

    def encode(self) -> tuple[int, bytes]:
        """A plain value for the metadata pickle (no class of ours): (block, little-endian
        uint32 CRCs)."""
        crcs = array("I", self.crcs)
        if sys.byteorder != "little":
            crcs.byteswap()
        return self.block, crcs.tobytes()

    @classmethod
    def decode(cls, value: object) -> BlockChecksums:
        """The inverse of :meth:`encode`; ValueError for anything else."""
        if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], int)
                and isinstance(value[1], bytes) and value[0] > 0 and len(value[1]) % 4 == 0):
            raise ValueError("malformed chunk checksums in the metadata")
        crcs = array("I")
        crcs.frombytes(value[1])
        if sys.byteorder != "little":
            crcs.byteswap()
        return cls(value[0], tuple(crcs))


class _StorageRef:
    """Stands for storage ``0`` in the pickle (a persistent id, as torch.save writes it)."""

    def __init__(self, dtype: torch.dtype, numel: int) -> None:
        self.dtype, self.numel = dtype, numel


class _Tensor:
    """Pickles as ``torch._utils._rebuild_tensor_v2`` of storage 0: what torch.save writes for
    a contiguous tensor owning its storage."""

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        numel = 1
        for size in shape:
            numel *= size
        stride, step = [], 1
        for size in reversed(shape):
            stride.append(step)
            step *= size
        self.storage = _StorageRef(dtype, numel)
        self.shape, self.stride = tuple(shape), tuple(reversed(stride))

    def __reduce__(self):
        return (torch._utils._rebuild_tensor_v2,
                (self.storage, 0, self.shape, self.stride, False, collections.OrderedDict()))


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: object):
        if isinstance(obj, _StorageRef):
            name = torch.storage._dtype_to_storage_type_map()[obj.dtype]
            return ("storage", getattr(torch, name), "0", "cpu", obj.numel)
        return None


def _pickle(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=2).dump(_Tensor(dtype, shape))
    return buffer.getvalue()


def _local_header(name: bytes, crc: int, size: int, extra: bytes, zip64: bool) -> bytes:
    stored = _U32 if zip64 else size
    return struct.pack("<IHHHHHIIIHH", 0x04034B50, 45 if zip64 else 20, 0, 0, 0, _DOS_DATE,
                       crc, stored, stored, len(name), len(extra)) + name + extra


def _central_header(name: bytes, crc: int, size: int, offset: int, zip64: bool) -> bytes:
    extra = struct.pack("<HHQQQ", 1, 24, size, size, offset) if zip64 else b""
    size32, offset32 = (_U32, _U32) if zip64 else (size, offset)
    return struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45, 45 if zip64 else 20, 0, 0, 0,
                       _DOS_DATE, crc, size32, size32, len(name), len(extra), 0, 0, 0, 0,
                       offset32) + name + extra


@functools.lru_cache(maxsize=1 << 16)
def archive_parts(dtype: torch.dtype, shape: tuple[int, ...], nbytes: int, data_crc: int = 0
                  ) -> tuple[bytes, bytes]:
    """``(head, tail)``: head + the chunk's ``nbytes`` row-major bytes + tail is a file that
    ``torch.load(weights_only=True)`` reads as the tensor (dtype, shape); ``data_crc``: the zip
    CRC-32 recorded for the bytes (0: none, as training's saves write it; a converter writing
    for Megatron, whose checks read it, gives the real one). Cached: the next save has the same
    chunks."""
    small = [("data.pkl", _pickle(dtype, shape)),
             ("byteorder", sys.byteorder.encode()),
             (".format_version", b"1"),
             (".storage_alignment", str(ALIGNMENT).encode())]
    head, central = bytearray(), bytearray()
    for name, payload in small:
        full = f"{_ARCHIVE}/{name}".encode()
        crc = zlib.crc32(payload)
        central += _central_header(full, crc, len(payload), len(head), False)
        head += _local_header(full, crc, len(payload), b"", False) + payload
    data_name = f"{_ARCHIVE}/data/0".encode()
    data_at = len(head)
    sizes = struct.pack("<HHQQ", 1, 16, nbytes, nbytes)  # zip64: the sizes are here
    bare = 30 + len(data_name) + len(sizes) + 4  # 4: the padding field's own header
    pad = (-(data_at + bare)) % ALIGNMENT
    extra = sizes + struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # "FB", as torch.save pads
    head += _local_header(data_name, data_crc, nbytes, extra, True)
    central += _central_header(data_name, data_crc, nbytes, data_at, True)
    tail = bytearray()
    version = f"{_ARCHIVE}/version".encode()
    at = len(head) + nbytes
    tail += _local_header(version, zlib.crc32(b"3\n"), 2, b"", False) + b"3\n"
    central_at = at + len(tail)
    central += _central_header(version, zlib.crc32(b"3\n"), 2, at, False)
    # the directory sits after the values: a zip64 end record (offsets may pass 4 GiB)
    entries, end64_at = len(small) + 2, central_at + len(central)
    tail += central
    tail += struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, entries, entries,
                        len(central), central_at)
    tail += struct.pack("<IIQI", 0x07064B50, 0, end64_at, 1)
    tail += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, entries, entries, _U32, _U32, 0)
    return bytes(head), bytes(tail)
