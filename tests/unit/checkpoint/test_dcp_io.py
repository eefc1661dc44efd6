"""dcp_io: chunks written as torch.save archives (read back by box, by us and by stock torch),
checksummed (a flipped or zeroed byte is refused by name), both earlier formats (raw bytes; DCP's
own torch.save chunks) still read, the cached save plan followed when the chunks change."""

from __future__ import annotations

import errno
import os
import re

import pytest  # noqa: F401
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from megatron_chimera.checkpoint import dcp_io
from megatron_chimera.checkpoint.dcp_io import (
    CHECKSUMS,
    ChunkSavePlanner,
    SaveChunk,
    failure_message,
    load_chunks,
    save_chunks,
)
from megatron_chimera.checkpoint.safe_reader import RAW, read_metadata
from megatron_chimera.checkpoint.torch_archive import MIN_BLOCK, BlockChecksums


def _chunks(seed: int, rows: int = 6) -> dict:
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(rows, 5, generator=g)
    return {("w", (0, 0)): SaveChunk((rows, 5), full[:2].clone()),
            ("w", (2, 0)): SaveChunk((rows, 5), full[2:].clone()),
            ("b", (0,)): SaveChunk((7,), torch.randn(7, generator=g).to(torch.bfloat16)),
            ("step", ()): SaveChunk((), torch.tensor(3.0))}


def _read_back(path: str, chunks: dict) -> dict:
    """Every saved tensor whole, plus a box straddling the two chunks of ``w``."""
    rows = chunks[("w", (0, 0))].global_size[0]
    out = {"w": torch.zeros(rows, 5), "b": torch.zeros(7, dtype=torch.bfloat16),
           "step": torch.zeros(()), "box": torch.zeros(3, 2)}
    load_chunks(path, {("w", (0, 0)): out["w"], ("b", (0,)): out["b"],
                       ("step", ()): out["step"]})
    load_chunks(path, {("w", (1, 2)): out["box"]})
    return out


def _check(out: dict, chunks: dict) -> None:
    full = torch.cat([chunks[("w", (0, 0))].tensor, chunks[("w", (2, 0))].tensor])
    assert torch.equal(out["w"], full)
    assert torch.equal(out["box"], full[1:4, 2:4])
    assert torch.equal(out["b"], chunks[("b", (0,))].tensor)
    assert out["step"].item() == 3.0


def test_chunks_are_torch_save_archives_that_stock_dcp_reads(tmp_path):
    chunks = _chunks(0)
    save_chunks(str(tmp_path), chunks)
    infos = read_metadata(str(tmp_path)).storage_data.values()
    assert not any(getattr(info, "transform_descriptors", None) for info in infos)
    assert all(getattr(info, CHECKSUMS, None) for info in infos)
    # each chunk is a torch.save archive: its values plus well under a KiB of zip and pickle
    values = sum(c.tensor.numel() * c.tensor.element_size() for c in chunks.values())
    assert values < os.path.getsize(tmp_path / "__0_0.distcp") < values + 1024 * len(chunks)
    _check(_read_back(str(tmp_path), chunks), chunks)
    # stock DCP (its own reader, torch.load(weights_only=True) per chunk)
    stock = {"w": torch.zeros(6, 5), "b": torch.zeros(7, dtype=torch.bfloat16),
             "step": torch.zeros(())}
    dcp.load(stock, storage_reader=FileSystemReader(str(tmp_path)), no_dist=True)
    full = torch.cat([chunks[("w", (0, 0))].tensor, chunks[("w", (2, 0))].tensor])
    assert torch.equal(stock["w"], full) and torch.equal(stock["b"], chunks[("b", (0,))].tensor)
    assert stock["step"].item() == 3.0


class _RawChunkWriter(FileSystemWriter):
    """The format before (#28): every chunk as its row-major bytes, marked ``raw`` (what
    RawChunkWriter wrote then)."""

    def __init__(self, path: str) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1)

    def write_data(self, plan, planner):
        name = f"{plan.storage_data.prefix}0.distcp"
        results = []
        with open(os.path.join(str(self.path), name), "wb") as handle:
            for item in plan.items:
                assert item.type != WriteItemType.BYTE_IO
                data = planner.resolve_data(item).detach().contiguous().reshape(-1)
                data = data.view(torch.uint8).numpy()
                offset = handle.tell()
                handle.write(memoryview(data))
                results.append(WriteResult(index=item.index, size_in_bytes=data.size,
                                           storage_data=_StorageInfo(name, offset, data.size,
                                                                     [RAW])))
        future = Future()
        future.set_result(results)
        return future


def test_raw_chunks_of_the_format_before_still_load(tmp_path):
    chunks = _chunks(7)
    dcp.save({}, storage_writer=_RawChunkWriter(str(tmp_path)),
             planner=ChunkSavePlanner(chunks), no_dist=True)
    infos = read_metadata(str(tmp_path)).storage_data.values()
    assert all(list(info.transform_descriptors) == [RAW] for info in infos)
    _check(_read_back(str(tmp_path), chunks), chunks)


def _data_at(path, chunks) -> int:
    """File offset of the values of ``w``'s first chunk (found by its bytes)."""
    blob = (path / "__0_0.distcp").read_bytes()
    at = blob.find(chunks[("w", (0, 0))].tensor.numpy().tobytes())
    assert at > 0
    return at


@pytest.mark.parametrize("damage", ["flip", "zero"])
def test_a_damaged_chunk_is_refused_naming_file_tensor_and_iteration(tmp_path, damage):
    root = tmp_path / "iter_0000002"
    g = torch.Generator().manual_seed(9)
    chunks = {("w", (0, 0)): SaveChunk((64, 256), torch.randn(64, 256, generator=g)),
              ("b", (0,)): SaveChunk((7,), torch.randn(7, generator=g))}
    save_chunks(str(root), chunks)
    at, size = _data_at(root, chunks), os.path.getsize(root / "__0_0.distcp")
    with open(root / "__0_0.distcp", "r+b") as handle:  # same size, in place
        handle.seek(at + 5000)
        if damage == "flip":
            byte = handle.read(1)
            handle.seek(at + 5000)
            handle.write(bytes([byte[0] ^ 0x10]))
        else:
            handle.write(bytes(4096))
    assert os.path.getsize(root / "__0_0.distcp") == size
    out = torch.zeros(64, 256)
    load_chunks(str(root), {("b", (0,)): torch.zeros(7)})  # an intact chunk still loads
    for box, key in ((out, ("w", (0, 0))), (torch.zeros(2, 8), ("w", (4, 224)))):
        with pytest.raises(BaseException) as info:  # DCP wraps it in a CheckpointException
            load_chunks(str(root), {key: box})
        line = failure_message(info.value)
        assert "\n" not in line
        assert re.search(r"iter_0000002/__0_0.distcp: w \(chunk at \(0, 0\)\) of iteration 2 "
                         r"is corrupt: bytes \d+-\d+ of its values fail their CRC-32 check", line)
    # a box away from the damage reads (only its blocks are checked), and reads about its size
    box = torch.zeros(4, 256)
    read = load_chunks(str(root), {("w", (60, 0)): box})
    assert torch.equal(box, chunks[("w", (0, 0))].tensor[60:])
    slack = ZIP + 2 * BlockChecksums.block_size((64, 256), 4)
    assert box.numel() * 4 <= read <= box.numel() * 4 + slack


ZIP = 1024  # a read of a chunk also reads its archive's zip directory (~550 bytes)


def test_a_resharded_read_reads_its_share_checked(tmp_path):
    # blocks follow the shape: another D's rows and another T's columns (the last dimension cut
    # in 2, 4, 8) are whole blocks, so such a read reads exactly its bytes, every one checked
    w = torch.randn(96, 1024)
    chunks = {("w", (0, 0)): SaveChunk((96, 1024), w),
              ("v", (0,)): SaveChunk((5000,), torch.randn(5000))}
    save_chunks(str(tmp_path), chunks)
    for cuts in (2, 4, 8):
        width = 1024 // cuts
        part = torch.zeros(96 // 3, width)
        read = load_chunks(str(tmp_path), {("w", (32, width)): part})
        assert torch.equal(part, w[32:64, width:2 * width])
        assert part.numel() * 4 <= read <= part.numel() * 4 + ZIP
    # a flat chunk's element range reads at most two blocks more than it needs
    piece = torch.zeros(1234)
    read = load_chunks(str(tmp_path), {("v", (777,)): piece})
    assert torch.equal(piece, chunks[("v", (0,))].tensor[777:2011])
    assert read <= piece.numel() * 4 + ZIP + 2 * BlockChecksums.block_size((5000,), 4)
    # a column cut off the block grid (3 of 1024 columns) still reads and checks whole blocks
    strip = torch.zeros(96, 3)
    assert 96 * 512 <= load_chunks(str(tmp_path), {("w", (0, 100)): strip}) <= 96 * 512 + ZIP
    assert torch.equal(strip, w[:, 100:103])


def test_block_sizes_follow_the_shape():
    size = BlockChecksums.block_size
    assert size((4096, 4096), 2) == 1024  # a row of 8 KiB cut in 8: 1 KiB
    assert size((64, 4096), 4) == 2048 and size((64, 4096), 2) == 1024
    assert size((50, 384), 4) == 256  # 1536 B rows: halves and thirds are whole blocks
    assert size((1000, 128), 4) == MIN_BLOCK  # small rows: the minimum, still dividing them
    assert size((7,), 4) == MIN_BLOCK and size((), 4) == MIN_BLOCK
    assert size((1 << 22,), 4) == 4096  # a flat chunk: at most 4096 blocks


def test_a_full_disk_names_the_file(tmp_path, monkeypatch):
    real_open = open

    class _Full:
        def __init__(self, handle):
            self.handle = handle

        def __getattr__(self, name):
            return getattr(self.handle, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(dcp_io, "open", lambda p, mode="r", *a: _Full(real_open(p, mode, *a)),
                        raising=False)
    with pytest.raises(BaseException) as info:
        save_chunks(str(tmp_path), _chunks(0))
    assert failure_message(info.value) == \
        f"rank 0: [Errno 28] No space left on device: '{tmp_path}/__0_0.distcp'"


def test_older_torch_save_chunks_still_load(tmp_path):
    chunks = _chunks(1)
    dcp.save({}, storage_writer=FileSystemWriter(str(tmp_path)),
             planner=ChunkSavePlanner(chunks), no_dist=True)
    assert not any(getattr(i, "transform_descriptors", None)
                   for i in read_metadata(str(tmp_path)).storage_data.values())
    _check(_read_back(str(tmp_path), chunks), chunks)


def test_an_unknown_chunk_encoding_is_refused(tmp_path):
    import pickle

    chunks = _chunks(2)
    save_chunks(str(tmp_path), chunks)
    metadata = read_metadata(str(tmp_path))
    for info in metadata.storage_data.values():
        info.transform_descriptors = ["zstd"]
    with open(tmp_path / ".metadata", "wb") as handle:
        pickle.dump(metadata, handle)
    with pytest.raises(BaseException) as info:  # DCP wraps it in a CheckpointException
        _read_back(str(tmp_path), chunks)
    assert re.search(r"__0_0.distcp: chunk of w .* \(unsupported chunk encoding \['zstd'\]\)",
                     failure_message(info.value))


def test_a_save_like_the_last_reuses_its_plan_and_a_changed_one_is_planned(tmp_path,
                                                                           monkeypatch):
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    planned = []
    real = DefaultSavePlanner._create_global_plan
    monkeypatch.setattr(DefaultSavePlanner, "_create_global_plan",
                        lambda self, plans: planned.append(1) or real(self, plans))
    first, same, other = _chunks(3), _chunks(4), _chunks(5, rows=8)
    counts = []
    for name, chunks in (("a", first), ("b", same), ("c", other), ("d", first)):
        save_chunks(str(tmp_path / name), chunks)
        counts.append(len(planned))
        _check(_read_back(str(tmp_path / name), chunks), chunks)
    # "b" has the chunks of "a" (other values): no plan sent, none made
    assert counts[1] == counts[0] and counts[2] == counts[1] + 1 and counts[3] == counts[2] + 1
