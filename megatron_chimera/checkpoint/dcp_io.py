"""Chunked tensor I/O through ``torch.distributed.checkpoint`` (DCP).

A rank hands DCP its chunks -- ``(fqn, offsets) -> tensor`` of a global tensor of a given size
-- and DCP writes each rank's chunks to its own files in parallel; a chunk several ranks hold
(replicas) is written once, by the holder with the least to write so far (DCP's deduplication).
The metadata records every chunk's global offsets, so a load asks for the rectangles it needs and
reads only the saved chunks that overlap them.

Our planners describe the chunks directly (DCP's default planner only knows whole tensors,
DTensors and ShardedTensors); the save planner caches DCP's global plan, so a save whose chunks
are those of the previous one sends no plan to the coordinator. Each rank writes its chunks into
one file, each a ``torch.save`` archive that stock readers load (``dcp.load``,
``dcp_to_torch_save``; :class:`ArchiveChunkWriter`), built around the values without
``torch.save``; the CRC-32 of every block of a chunk's values goes into its storage info in the
metadata (:data:`CHECKSUMS`) and a load checks every block it reads (:mod:`safe_reader`).

Loading never executes a pickle: chunks are read as bytes (a ``torch.save`` archive through its
zip directory only; the ``raw`` chunks of the format before, row-major bytes, as they are) and
the metadata file with an unpickler that admits only DCP's metadata classes, torch sizes and
dtypes. Chunks saved without checksums (both earlier formats) load unchecked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
)
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import (
    _compare_save_plans,
    create_read_items_for_chunk_list,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from megatron_chimera.checkpoint.chunks import Rect
from megatron_chimera.checkpoint.safe_reader import CHECKSUMS, SafeReader
from megatron_chimera.checkpoint.torch_archive import BlockChecksums, archive_parts
from megatron_chimera.checkpoint.write_errors import (  # noqa: F401 - re-exported
    CheckpointWriteError,
    failure_message,
    write_errors_reported,
)

ChunkKey = tuple[str, tuple[int, ...]]  # (fqn, offsets)


@dataclasses.dataclass
class SaveChunk:
    """One chunk to write: the global tensor's size and this piece's values."""

    global_size: tuple[int, ...]
    tensor: torch.Tensor


def _index(key: ChunkKey) -> MetadataIndex:
    return MetadataIndex(key[0], torch.Size(key[1]))


class ChunkSavePlanner(DefaultSavePlanner):
    """Plans the writes of explicitly placed chunks (DCP deduplicates replicas globally)."""

    def __init__(self, chunks: dict[ChunkKey, SaveChunk],
                 objects: dict[str, Any] | None = None) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False,
                         enable_plan_caching=True)
        self.chunks = chunks
        self.objects = objects or {}  # fqn -> a non-tensor value (one torch.save'd bytes item)
        self._by_index = {_index(k): c.tensor for k, c in chunks.items()}

    def create_local_plan(self) -> SavePlan:
        items = []
        for (fqn, offsets), chunk in self.chunks.items():
            tensor = chunk.tensor
            items.append(WriteItem(
                index=_index((fqn, offsets)), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(tensor.shape)),
                    properties=TensorProperties.create_from_tensor(tensor),
                    size=torch.Size(chunk.global_size))))
        items += [WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)
                  for fqn in self.objects]
        self.plan = SavePlan(items)
        # DCP's plan caching (as DefaultSavePlanner.create_local_plan does it): a plan equal to
        # the last successful one is not sent; the coordinator reuses the cached global plan
        cached = SavePlanner._cached_save_plan.get(self._cached_plans_key)
        if cached is not None and _compare_save_plans(self.plan, cached):
            return SavePlan([], usable=False)
        self._chunk_plan_pending = self.plan  # cached by finish_plan once the plan succeeds
        return self.plan

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        # the local plan is cached only once the global plan succeeded (torch 2.13's own rule;
        # 2.11 cached it in create_local_plan): done here, so every supported torch does it
        finished = super().finish_plan(new_plan)
        pending = self.__dict__.pop("_chunk_plan_pending", None)
        if pending is not None:
            SavePlanner._cached_save_plan[self._cached_plans_key] = pending
        return finished

    def lookup_object(self, index: MetadataIndex) -> Any:
        if index.offset is None:
            return self.objects[index.fqn]
        return self._by_index[dataclasses.replace(index, index=None)]


class ArchiveChunkWriter(FileSystemWriter):
    """DCP's file writer storing each chunk as a ``torch.save`` archive (what stock DCP readers
    read) built around the chunk's bytes (:func:`.torch_archive.archive_parts`: the values are
    written straight from the tensor), one file per rank (fsynced), with the CRC-32 of its
    blocks in the chunk's storage info (:data:`CHECKSUMS`). A failed write names the file."""

    def __init__(self, path: str) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        return self._write_rank_file(plan, lambda handle, name: [
            self._write_chunk(handle, name, item, planner) for item in plan.items])

    def _write_rank_file(self, plan: SavePlan,
                         write_items: Callable[[Any, str], list[WriteResult]]) -> Future:
        """This rank's one file: ``write_items(handle, file name)`` writes it and returns the
        results, then it is fsynced; a failed write names the file."""
        name = f"{plan.storage_data.prefix}0.distcp"
        path = os.path.join(str(self.path), name)
        try:
            with open(path, "wb") as handle:
                results = write_items(handle, name)
                handle.flush()
                os.fsync(handle.fileno())
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, path) from None
        future: Future = Future()
        future.set_result(results)
        return future

    write_checksums = True  # a CRC-32 per block in the storage info (off only to measure them)

    @classmethod
    def _write_chunk(cls, handle, name: str, item: WriteItem, planner: SavePlanner) -> WriteResult:
        if item.type == WriteItemType.BYTE_IO:
            raise ValueError(f"{item.index.fqn}: only tensors are written as chunks")
        return cls._write_tensor(handle, name, item.index, planner.resolve_data(item))

    @classmethod
    def _write_tensor(cls, handle, name: str, index: MetadataIndex, tensor: torch.Tensor,
                      zip_crc: bool = False) -> WriteResult:
        tensor = tensor.detach().contiguous()
        data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
        head, tail = archive_parts(tensor.dtype, tuple(tensor.shape), len(data),
                                   zlib.crc32(data) if zip_crc else 0)
        offset = handle.tell()
        handle.write(head)
        handle.write(data)
        handle.write(tail)
        length = len(head) + len(data) + len(tail)
        info = _StorageInfo(name, offset, length)
        if cls.write_checksums:
            setattr(info, CHECKSUMS, BlockChecksums.of(data, tuple(tensor.shape),
                                                        tensor.element_size()).encode())
        return WriteResult(index=index, size_in_bytes=length, storage_data=info)


class StreamedChunkWriter(ArchiveChunkWriter):
    """An :class:`ArchiveChunkWriter` (one process) whose chunk values come from ``tensors`` --
    ``((fqn, offsets), tensor)`` in any order, each written as it arrives and then dropped, so a
    save holds one chunk at a time -- instead of from the planner: the plan (built from chunks of
    the same shapes and dtypes, e.g. on the ``meta`` device) must name each of them once; its
    bytes items (non-tensor objects) are written after them, as DCP's writer does. Each chunk's
    zip records the CRC-32 of its values, as ``torch.save`` does (Megatron files are checked
    with it), besides our block checksums. An error
    raised while iterating ``tensors`` is kept in ``error`` (DCP wraps it in a
    CheckpointException; :func:`save_chunks` raises it as it was)."""

    def __init__(self, path: str,
                 tensors: Iterator[tuple[ChunkKey, torch.Tensor]]) -> None:
        super().__init__(path)
        self._tensors = tensors
        self.error: BaseException | None = None

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        try:
            return self._write_stream(plan, planner)
        except Exception as exc:  # noqa: BLE001 - kept to be re-raised unwrapped
            self.error = exc
            raise

    def _write_stream(self, plan: SavePlan, planner: SavePlanner) -> Future:
        planned = {(i.index.fqn, tuple(i.index.offset)): i for i in plan.items
                   if i.type != WriteItemType.BYTE_IO}

        def write(handle: Any, name: str) -> list[WriteResult]:
            results = []
            for key, tensor in self._tensors:
                item = planned.pop((key[0], tuple(key[1])), None)
                if item is None:
                    raise ValueError(f"{key[0]} at {tuple(key[1])}: not a chunk of the plan "
                                     "(or given twice)")
                data = item.tensor_data
                if (tuple(tensor.shape) != tuple(data.chunk.sizes)
                        or tensor.dtype != data.properties.dtype):
                    raise ValueError(f"{key[0]}: {tuple(tensor.shape)} {tensor.dtype}, "
                                     f"planned {tuple(data.chunk.sizes)} "
                                     f"{data.properties.dtype}")
                results.append(self._write_tensor(handle, name, item.index, tensor,
                                                  zip_crc=True))
                del tensor  # the next one is read only after this one is dropped
            if planned:
                raise ValueError(f"{', '.join(sorted(k[0] for k in planned)[:4])}: "
                                 "planned, never given")
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    value = planner.resolve_data(item).getvalue()
                    offset = handle.tell()
                    handle.write(value)
                    results.append(WriteResult(index=item.index, size_in_bytes=len(value),
                                               storage_data=_StorageInfo(name, offset,
                                                                         len(value))))
            return results

        return self._write_rank_file(plan, write)


class ChunkLoadPlanner(DefaultLoadPlanner):
    """Plans the reads that fill ``requests[(fqn, offsets)]`` (destination tensors, possibly
    views) from whichever saved chunks overlap them."""

    def __init__(self, requests: dict[ChunkKey, torch.Tensor]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.requests = requests
        self._by_index = {_index(k): t for k, t in requests.items()}

    def create_local_plan(self) -> LoadPlan:
        items = []
        for (fqn, offsets), tensor in self.requests.items():
            md = self.metadata.state_dict_metadata[fqn]
            chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(tensor.shape))
            items += create_read_items_for_chunk_list(fqn, md, [chunk])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self._by_index[MetadataIndex(index.fqn, index.offset)]


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Silence DCP's warning that a tool without process groups saves or loads alone."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_chunks(path: str, chunks: dict[ChunkKey, SaveChunk], process_group=None,
                tensors: Iterator[tuple[ChunkKey, torch.Tensor]] | None = None,
                objects: dict[str, Any] | None = None) -> None:
    """Collectively write every rank's ``chunks`` under directory ``path`` (DCP files plus
    ``.metadata``; every file fsynced). ``tensors`` (one process): the chunks' values, streamed
    one at a time (:class:`StreamedChunkWriter`); ``chunks`` then only plan them; ``objects``
    (with ``tensors``): non-tensor values by fqn, each written as a bytes item."""
    if objects and tensors is None:
        raise ValueError("save_chunks writes objects only with streamed tensors")
    writer = (ArchiveChunkWriter(path) if tensors is None
              else StreamedChunkWriter(path, tensors))
    try:
        with _single_process_quiet():
            dcp.save({}, storage_writer=writer, planner=ChunkSavePlanner(chunks, objects),
                     process_group=process_group,  # streamed: this process alone
                     no_dist=tensors is not None or not dist.is_initialized())
    except BaseException:  # noqa: BLE001 - DCP's CheckpointException wraps the stream's error
        error = getattr(writer, "error", None)
        if error is not None and not isinstance(error, OSError):
            raise error from None
        raise


def check_requests(path: str, metadata: Metadata, requests: dict[ChunkKey, torch.Tensor]) -> None:
    """A clear error when a requested tensor is missing or its saved chunks do not cover the
    request (a checkpoint of another model, or an incomplete one)."""
    for (fqn, offsets), tensor in requests.items():
        md = metadata.state_dict_metadata.get(fqn)
        if not isinstance(md, TensorStorageMetadata):
            raise KeyError(f"{path}: no saved tensor {fqn}")
        want = (offsets, tuple(tensor.shape))
        if any(o + s > g for o, s, g in zip(offsets, tensor.shape, md.size)) or \
                len(offsets) != len(md.size):
            raise KeyError(f"{path}: saved tensor {fqn} has shape {tuple(md.size)}, which does "
                           f"not hold the piece at {offsets} of size {tuple(tensor.shape)}")
        if _covered(want, [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]) < \
                tensor.numel():
            raise KeyError(f"{path}: the saved chunks of {fqn} do not cover the piece at "
                           f"{offsets} of size {tuple(tensor.shape)}")


def _covered(want: Rect, saved: list[Rect]) -> int:
    """Elements of ``want`` covered by the (disjoint) ``saved`` rectangles."""
    total = 0
    for offsets, sizes in saved:
        count = 1
        for wo, ws, so, ss in zip(want[0], want[1], offsets, sizes):
            count *= max(0, min(wo + ws, so + ss) - max(wo, so))
        total += count
    return total


def load_chunks(path: str, requests: dict[ChunkKey, torch.Tensor], process_group=None,
                collective: bool = True, metadata: Metadata | None = None) -> int:
    """Fill ``requests`` from the checkpoint in ``path`` (collectively over every rank, unless
    ``collective`` is False or there are no process groups); returns the bytes read.
    ``metadata``: the checkpoint's, already read (a caller loading piece by piece reads it once
    instead of once per load)."""
    reader = SafeReader(path, metadata)
    with _single_process_quiet():
        dcp.load({}, storage_reader=reader, planner=ChunkLoadPlanner(requests),
                 process_group=process_group,
                 no_dist=not (collective and dist.is_initialized()))
    return reader.bytes_read

