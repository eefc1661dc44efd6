"""Reading DCP checkpoints without executing a pickle, checking every block it reads.

The metadata file is unpickled by an unpickler that admits only DCP's metadata classes, torch
sizes and dtypes (:func:`read_metadata`). :class:`SafeReader` is DCP's file reader reading only
the bytes a request needs -- the byte runs of the requested box of each saved chunk: raw
row-major bytes, or the values inside a chunk's ``torch.save`` archive found through its zip
directory, never its pickle -- and checks the CRC-32 of every block it reads against the
checksums recorded at save time (:class:`ChecksumError`). Chunks saved without checksums load
unchecked. The writers are in :mod:`megatron_chimera.checkpoint.dcp_io`.
"""

from __future__ import annotations

import io
import itertools
import os
import pickle
import re
import struct
import zipfile
import zlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan
from torch.futures import Future

from megatron_chimera.checkpoint.torch_archive import BlockChecksums

METADATA_FILENAME = ".metadata"
RAW = "raw"  # the #28 format's chunk: row-major bytes (its storage info's transform descriptor)
# the attribute of a chunk's storage info holding its block checksums (a plain value: stock
# readers unpickle the metadata without us and ignore it)
CHECKSUMS = "chimera_crc32"

_ALLOWED_MODULES = ("torch.distributed.checkpoint.",)
_ALLOWED = {("collections", "OrderedDict"), ("torch", "Size"), ("builtins", "set"),
            ("builtins", "frozenset"), ("torch.serialization", "_get_layout"),
            ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata dataclasses and enums, torch sizes, dtypes, layouts and memory
    formats; anything else in the file is refused instead of executed."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(_ALLOWED_MODULES) or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from checkpoint metadata")


def read_metadata(path: str) -> Metadata:
    """The DCP metadata of checkpoint directory ``path`` (safely unpickled); a missing, truncated
    or damaged file raises ``pickle.UnpicklingError`` naming the file."""
    filename = os.path.join(path, METADATA_FILENAME)
    try:
        with open(filename, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
    except FileNotFoundError:
        raise pickle.UnpicklingError(f"checkpoint metadata {filename} is missing") from None
    except pickle.UnpicklingError as exc:
        if str(exc).startswith("refusing to load"):
            raise
        raise pickle.UnpicklingError(
            f"checkpoint metadata {filename} is corrupt or truncated ({exc})") from None
    except (EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as exc:
        raise pickle.UnpicklingError(
            f"checkpoint metadata {filename} is corrupt or truncated "
            f"({type(exc).__name__})") from None
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"checkpoint metadata {filename} is not a DCP metadata object")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader reading only the bytes a request needs: the byte runs of the requested
    box of each saved chunk (raw row-major bytes; of an older ``torch.save`` archive, its zip
    directory first, never its pickle). Counts the bytes it reads."""

    def __init__(self, path: str, metadata: Metadata | None = None) -> None:
        super().__init__(path)
        self.bytes_read = 0
        self._metadata: Metadata | None = None
        self._known = metadata  # already read from ``path`` (:func:`read_metadata`) by the caller

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._known if self._known is not None else read_metadata(str(self.path))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool,
                              *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._metadata = metadata

    def _saved_chunk(self, index: MetadataIndex) -> tuple[tuple[int, ...], torch.dtype]:
        md = self._metadata.state_dict_metadata[index.fqn]
        chunks = md.chunks
        if index.index is not None and index.index < len(chunks) and \
                chunks[index.index].offsets == index.offset:
            return tuple(chunks[index.index].sizes), md.properties.dtype
        for chunk in chunks:
            if chunk.offsets == index.offset:
                return tuple(chunk.sizes), md.properties.dtype
        raise KeyError(f"no saved chunk of {index.fqn} at {tuple(index.offset)}")

    def read_data(self, plan: LoadPlan, planner: Any):
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            relative = self.storage_data[item.storage_index].relative_path
            per_file.setdefault(relative, []).append(item)
        for relative, items in per_file.items():
            path = os.path.join(str(self.path), relative)
            with open(path, "rb") as handle:
                starts: dict[int, int] = {}
                for item in items:
                    info = self.storage_data[item.storage_index]
                    target = planner.resolve_tensor(item).detach()
                    try:
                        if info.offset not in starts:
                            starts[info.offset] = self._data_start(handle, info)
                        self._read_box(handle, starts[info.offset], item, target,
                                       getattr(info, CHECKSUMS, None))
                    except ChecksumError as exc:
                        raise ChecksumError(
                            f"{path}: {item.storage_index.fqn} (chunk at "
                            f"{tuple(item.storage_index.offset)}) of iteration "
                            f"{_iteration_of(str(self.path))} is corrupt: {exc}") from None
                    except (ValueError, KeyError, zipfile.BadZipFile, struct.error) as exc:
                        raise ValueError(f"{path}: chunk of {item.storage_index.fqn} at "
                                         f"{tuple(item.storage_index.offset)} is corrupt or "
                                         f"truncated ({exc})") from None
                    planner.commit_tensor(item, target)
        future: Future = Future()
        future.set_result(None)
        return future

    def _data_start(self, handle, info) -> int:
        """File offset of a saved chunk's tensor bytes (raw, or its zip's ``data/0`` member)."""
        encoding = list(getattr(info, "transform_descriptors", None) or [])
        if encoding == [RAW]:
            return info.offset
        if encoding:
            raise ValueError(f"unsupported chunk encoding {encoding}")
        view = _CountingView(handle, info.offset, info.length)
        with zipfile.ZipFile(view) as archive:
            member = next((m for m in archive.infolist() if m.filename.endswith("/data/0")), None)
        if member is None:
            raise ValueError("no tensor data in the chunk")
        view.seek(member.header_offset)
        header = view.read(30)
        name_length, extra_length = struct.unpack("<HH", header[26:30])
        self.bytes_read += view.count
        return info.offset + member.header_offset + 30 + name_length + extra_length

    def _read_box(self, handle, start: int, item: Any, target: torch.Tensor,
                  checksums: Any) -> None:
        """Read the requested box of a saved chunk, as byte runs from ``start``, into ``target``:
        straight into its memory when it is contiguous and of the saved dtype (no copy of the
        tensor; a tool reading tensor by tensor holds about one tensor), else through one
        buffer of the box. With ``checksums`` (the chunk's encoded :class:`BlockChecksums`) the
        blocks holding the runs are read and checked instead (through a bounded buffer)."""
        shape, dtype = self._saved_chunk(item.storage_index)
        box_offsets, box_lengths = tuple(item.storage_offsets), tuple(item.lengths)
        direct = target.is_contiguous() and target.dtype == dtype
        dest = target if direct else torch.empty(box_lengths, dtype=dtype)
        itemsize = dest.element_size()
        memory = memoryview(dest.reshape(-1).view(torch.uint8).numpy())
        runs = [(offset * itemsize, count * itemsize)
                for offset, count in _byte_runs(shape, box_offsets, box_lengths)]
        if checksums is not None:
            nbytes = itemsize
            for size in shape:
                nbytes *= size
            self.bytes_read += _read_checked(handle, start, nbytes, runs, memory,
                                             BlockChecksums.decode(checksums))
        else:
            at = 0
            for offset, size in runs:
                handle.seek(start + offset)
                if handle.readinto(memory[at:at + size]) != size:
                    raise ValueError("the file ends early")
                at += size
            self.bytes_read += at
        if not direct:
            target.copy_(dest)


class ChecksumError(ValueError):
    """Bytes read from a checkpoint chunk do not match the checksum recorded when it was saved."""


_PIECE = 1 << 20  # bytes a checked read holds at a time (or one block, if larger)


def _read_checked(handle, start: int, nbytes: int, runs: list[tuple[int, int]],
                  memory: memoryview, checksums: BlockChecksums) -> int:
    """Copy the byte ``runs`` (offset, size; ascending) of a chunk of ``nbytes`` bytes at file
    offset ``start`` into ``memory`` (one after the other), reading the whole blocks that hold
    them, a bounded piece at a time, and checking each block's CRC; returns the bytes read."""
    block, crcs = checksums.block, checksums.crcs
    if len(crcs) != -(-nbytes // block):
        raise ValueError(f"{len(crcs)} checksums recorded for {nbytes} bytes in blocks of {block}")
    if all(offset % block == 0 and ((offset + size) % block == 0 or offset + size == nbytes)
           for offset, size in runs):  # whole blocks (a whole chunk): read in place, checked
        dest_at = 0
        for offset, size in runs:
            handle.seek(start + offset)
            if handle.readinto(memory[dest_at:dest_at + size]) != size:
                raise ValueError("the file ends early")
            for at in range(0, size, block):
                _check_block(memory[dest_at + at:dest_at + min(size, at + block)],
                             crcs, (offset + at) // block, block, nbytes)
            dest_at += size
        return dest_at
    spans: list[list[int]] = []  # [first block, end block) holding the runs, merged
    for offset, size in runs:
        first, end = offset // block, -(-(offset + size) // block)
        if spans and first <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([first, end])
    piece_blocks = max(1, _PIECE // block)
    buffer = bytearray(min(nbytes, piece_blocks * block))
    view = memoryview(buffer)
    run, dest_at, total = 0, 0, 0
    for first, end in spans:
        for piece in range(first, end, piece_blocks):
            lo, hi = piece * block, min(nbytes, min(end, piece + piece_blocks) * block)
            handle.seek(start + lo)
            if handle.readinto(view[:hi - lo]) != hi - lo:
                raise ValueError("the file ends early")
            total += hi - lo
            for b in range(piece, -(-hi // block)):
                _check_block(view[b * block - lo:min(hi, (b + 1) * block) - lo], crcs, b, block,
                             nbytes)
            while run < len(runs) and runs[run][0] < hi:
                offset, size = runs[run]
                a, z = max(offset, lo), min(offset + size, hi)
                memory[dest_at + a - offset:dest_at + z - offset] = view[a - lo:z - lo]
                if offset + size > hi:
                    break
                dest_at += size
                run += 1
    return total


def _check_block(data: memoryview, crcs: tuple[int, ...], index: int, block: int,
                 nbytes: int) -> None:
    """ChecksumError when block ``index`` (``data``) does not have its saved CRC."""
    got = zlib.crc32(data)
    if got != crcs[index]:
        raise ChecksumError(f"bytes {index * block}-{min(nbytes, (index + 1) * block) - 1} of "
                            f"its values fail their CRC-32 check ({got:08x}, saved "
                            f"{crcs[index]:08x})")


def _iteration_of(path: str) -> str:
    """The iteration of a checkpoint directory ``.../iter_0000002`` ("?" for another name)."""
    match = re.search(r"iter_(\d+)", os.path.basename(os.path.normpath(path)))
    return str(int(match.group(1))) if match else "?"


class _CountingView(io.RawIOBase):
    """A seekable read-only window ``[offset, offset + length)`` of a file that counts the
    bytes read through it."""

    def __init__(self, handle, offset: int, length: int) -> None:
        super().__init__()
        self.handle, self.offset, self.length = handle, offset, length
        self.position, self.count = 0, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, position: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.position, 2: self.length}[whence]
        self.position = max(0, base + position)
        return self.position

    def tell(self) -> int:
        return self.position

    def read(self, size: int = -1) -> bytes:
        end = self.length if size is None or size < 0 else min(self.length, self.position + size)
        self.handle.seek(self.offset + self.position)
        data = self.handle.read(max(0, end - self.position))
        self.position += len(data)
        self.count += len(data)
        return data


def _byte_runs(shape: tuple[int, ...], offsets: tuple[int, ...],
               lengths: tuple[int, ...]) -> Iterator[tuple[int, int]]:
    """(element offset, element count) of the contiguous runs of a box inside a row-major
    array of ``shape``."""
    if not shape:
        yield 0, 1
        return
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    split = 0  # dims after `split` are whole: each run spans them
    for d in range(len(shape) - 1, -1, -1):
        if d == 0 or lengths[d] != shape[d] or offsets[d] != 0:
            split = d
            break
    run = lengths[split] * strides[split]
    outer = [range(offsets[d], offsets[d] + lengths[d]) for d in range(split)]
    for index in itertools.product(*outer):
        base = sum(i * strides[d] for d, i in enumerate(index)) + offsets[split] * strides[split]
        if run:
            yield base, run
