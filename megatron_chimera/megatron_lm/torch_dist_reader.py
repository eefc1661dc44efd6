"""Read a Megatron-core ``torch_dist`` iteration with torch.distributed.checkpoint's own reader.

The chunks are stock DCP (``FileSystemReader`` reads them; Megatron need not be installed); they
are read in place by our chunk reader. One tensor is loaded at a time, so a conversion holds
about one Megatron tensor. Layers are stacked on dim 0 (``decoder.layers.<suffix>`` is
``[L, ...]``); the reader yields each layer's slice (a view) under its indexed name
(``decoder.layers.{i}.<suffix>``).
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron_chimera.checkpoint.dcp_io import ChunkLoadPlanner
from megatron_chimera.checkpoint.megatron_format import (
    MegatronCheckpointError,
    damaged_zip_member,
    load_megatron_file,
)
from megatron_chimera.checkpoint.safe_reader import SafeReader
from megatron_chimera.megatron_lm.names import EXTRA_STATE, LAYER_PREFIX, layer_name

COMMON_FILE = "common.pt"
METADATA_FILE = ".metadata"


class _FileSlice(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of an open file as a seekable file of their own (one
    DCP chunk, checked in place without reading it into memory)."""

    def __init__(self, handle, offset: int, length: int) -> None:
        super().__init__()
        self._handle, self._offset, self._length, self._pos = handle, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, min(self._length, base + pos))
        return self._pos

    def readinto(self, buffer) -> int:
        count = min(len(buffer), self._length - self._pos)
        self._handle.seek(self._offset + self._pos)
        data = self._handle.read(count)
        buffer[:len(data)] = data
        self._pos += len(data)
        return len(data)


class _InPlaceReader(SafeReader):
    """Our reader of DCP chunks (each chunk's bytes read straight into the tensor: no copy of
    the chunk besides the result) over metadata the TorchDistReader has already read."""

    def __init__(self, path: str, metadata) -> None:
        super().__init__(path)
        self._given = metadata

    def read_metadata(self, *args: Any, **kwargs: Any):
        return self._given


class TorchDistReader:
    """The tensors of one Megatron-core ``torch_dist`` iteration directory."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._reader = FileSystemReader(path)
        try:
            self.metadata = self._reader.read_metadata()
        except Exception as exc:  # noqa: BLE001 - pickle / IO errors of a damaged file
            raise MegatronCheckpointError(
                f"Megatron checkpoint file {os.path.join(path, METADATA_FILE)} is corrupt, "
                f"truncated or missing ({type(exc).__name__})") from None
        self.tensors = {k: v for k, v in self.metadata.state_dict_metadata.items()
                        if isinstance(v, TensorStorageMetadata)}

    def common(self) -> dict[str, Any]:
        """``common.pt``: the saved ``args``, ``iteration``, scheduler state, ..."""
        common = load_megatron_file(os.path.join(self.path, COMMON_FILE))
        if not isinstance(common, dict):
            raise MegatronCheckpointError(f"{os.path.join(self.path, COMMON_FILE)}: not a "
                                          "Megatron common state (expected a dict)")
        return common

    def files_of(self, key: str) -> list[str]:
        """The ``.distcp`` files holding chunks of ``key``."""
        storage = self.metadata.storage_data or {}
        return sorted({os.path.join(self.path, info.relative_path)
                       for index, info in storage.items() if index.fqn == key})

    def verify(self, key: str) -> None:
        """Check the CRC-32 of every stored chunk of ``key`` (each is a ``torch.save`` zip, whose
        CRCs ``torch.load`` ignores): zeroed or flipped bytes are one line naming file and key."""
        storage = self.metadata.storage_data or {}
        for index, info in storage.items():
            if index.fqn != key or getattr(info, "transform_descriptors", None):
                continue  # a transformed (e.g. compressed) chunk is not a plain zip
            path = os.path.join(self.path, info.relative_path)
            try:
                with open(path, "rb") as handle:
                    size = os.fstat(handle.fileno()).st_size
                    damaged = ("end" if info.offset + info.length > size else
                               damaged_zip_member(_FileSlice(handle, info.offset, info.length)))
            except OSError as exc:
                raise MegatronCheckpointError(f"Megatron checkpoint file {path} cannot be read "
                                              f"({exc.strerror})") from None
            if damaged is not None:
                raise MegatronCheckpointError(
                    f"Megatron checkpoint file {path} is corrupt: tensor {key!r} fails its CRC-32 "
                    f"check (bytes {info.offset}-{info.offset + info.length})")

    def read(self, key: str) -> torch.Tensor:
        """The whole tensor ``key``, its chunks' checksums verified; a damaged chunk is one line
        naming its file and ``key``."""
        self.verify(key)
        meta = self.tensors[key]
        out = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "assuming the intent is to load in a single..."
                dcp.load({}, storage_reader=_InPlaceReader(self.path, self.metadata),
                         planner=ChunkLoadPlanner({(key, (0,) * out.dim()): out}), no_dist=True)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - a BaseException
            # (CheckpointException) wrapping the reader's error on a damaged chunk
            files = ", ".join(self.files_of(key)) or self.path
            raise MegatronCheckpointError(
                f"Megatron checkpoint file {files} is corrupt or truncated (reading tensor "
                f"{key!r}: {type(exc).__name__})") from None
        return out

    def model_keys(self) -> list[str]:
        """Tensor keys of the model (the optimizer's ``optimizer.*`` and RNG left out)."""
        return [k for k in self.tensors
                if not k.startswith(("optimizer.", "rng_state")) and EXTRA_STATE not in k]

    def optimizer_keys(self) -> list[str]:
        """Tensor keys of the optimizer state (not imported: a fresh optimizer starts)."""
        return [k for k in self.tensors if k.startswith("optimizer.")]

    def iter_model(self, num_layers: int) -> Iterator[tuple[str, torch.Tensor]]:
        """(normalised Megatron name, tensor) for every model tensor, layer by layer: a stacked
        ``decoder.layers.<suffix>`` ``[L, ...]`` becomes ``decoder.layers.{i}.<suffix>``."""
        for key in self.model_keys():
            tensor = self.read(key)
            suffix = key[len(LAYER_PREFIX):] if key.startswith(LAYER_PREFIX) else None
            if suffix is None or suffix.split(".", 1)[0].isdigit():
                yield key, tensor  # a whole-model tensor, or an unstacked per-layer one
                del tensor  # not held while the next one is read
                continue
            if tensor.dim() == 0 or tensor.shape[0] != num_layers:
                raise MegatronCheckpointError(
                    f"{self.path}: {key!r} has shape {tuple(tensor.shape)}, not stacked over the "
                    f"{num_layers} layers of args.num_layers (an unknown layout)")
            for index in range(num_layers):
                yield layer_name(index, suffix), tensor[index]  # a view: no second copy
            del tensor
