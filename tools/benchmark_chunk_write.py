"""What writing a ``torch_dist`` rank's chunks costs, by part: the values, the ``torch.save``
archive around them, the block checksums (one process, no training)::

    OMP_NUM_THREADS=1 python tools/benchmark_chunk_write.py --total-mb 64 --chunk-kb 64,1024,8192

Writes the same chunks (float32, ``--total-mb`` in all, cycling through ``--chunk-kb`` sizes)
with DCP (:func:`~megatron_chimera.checkpoint.dcp_io.save_chunks`) three ways, interleaved
``--repeats`` times: ``values`` (each chunk's row-major bytes only: the format before, #28),
``archive`` (each chunk a ``torch.save`` archive built around the values, no checksums) and
``archive+crc`` (what a save writes: the archive and a CRC-32 per block). Prints, per way, the
median wall time and the median CPU time of the writing thread (what an ``--async-save``
writer takes from the training's cores), and both against ``values``, measured in this run.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.storage import WriteResult

from megatron_chimera.checkpoint import dcp_io
from megatron_chimera.checkpoint.safe_reader import RAW
from megatron_chimera.errors import ToolArgumentParser, run_tool


class _ValuesOnly(dcp_io.ArchiveChunkWriter):
    """The chunk's bytes alone (the #28 format's work)."""

    @staticmethod
    def _write_chunk(handle, name, item, planner):
        data = memoryview(planner.resolve_data(item).detach().contiguous().reshape(-1)
                          .view(torch.uint8).numpy())
        offset = handle.tell()
        handle.write(data)
        return WriteResult(index=item.index, size_in_bytes=len(data),
                           storage_data=_StorageInfo(name, offset, len(data), [RAW]))


class _ArchiveOnly(dcp_io.ArchiveChunkWriter):
    """The archive without checksums."""

    write_checksums = False


WAYS = {"values": _ValuesOnly, "archive": _ArchiveOnly, "archive+crc": dcp_io.ArchiveChunkWriter}


def make_chunks(total_mb: float, chunk_kb: list[int], row_bytes: int = 0) -> dict:
    """float32 chunks of the given sizes (cycled) adding up to about ``total_mb``; flat, or
    matrices with rows of ``row_bytes`` (their checksum blocks follow the row size)."""
    chunks, total, index = {}, 0, 0
    while total < total_mb * 2**20:
        numel = chunk_kb[index % len(chunk_kb)] * 256
        shape = (numel // (row_bytes // 4), row_bytes // 4) if row_bytes else (numel,)
        chunks[(f"t{index}", (0,) * len(shape))] = dcp_io.SaveChunk(shape, torch.randn(shape))
        total += numel * 4
        index += 1
    return chunks


def time_way(way: str, chunks: dict, directory: str) -> tuple[float, float]:
    """(wall s, writing thread's CPU s) of one save of ``chunks`` written ``way``."""
    real = dcp_io.ArchiveChunkWriter
    dcp_io.ArchiveChunkWriter = WAYS[way]
    try:
        wall, cpu = time.perf_counter(), time.thread_time()
        dcp_io.save_chunks(directory, chunks)
        return time.perf_counter() - wall, time.thread_time() - cpu
    finally:
        dcp_io.ArchiveChunkWriter = real


def main(argv: list[str] | None = None) -> None:
    """Time the three ways and print the table."""
    parser = ToolArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total-mb", type=float, default=64.0)
    parser.add_argument("--chunk-kb", default="64,1024,8192",
                        help="comma-separated chunk sizes in KiB, cycled")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--row-bytes", type=int, default=0,
                        help="2-D chunks with rows of this many bytes (0: flat chunks)")
    args = parser.parse_args(argv)
    chunks = make_chunks(args.total_mb, [int(x) for x in args.chunk_kb.split(",")],
                         args.row_bytes)
    times: dict[str, list[tuple[float, float]]] = {way: [] for way in WAYS}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats + 1):
            for way in WAYS:
                measured = time_way(way, chunks, os.path.join(tmp, f"{way}-{repeat}"))
                if repeat:  # the first round warms the page cache and DCP's plan cache
                    times[way].append(measured)
    size = sum(c.tensor.numel() * 4 for c in chunks.values())
    print(f"{len(chunks)} chunks, {size / 2**20:.1f} MiB, {args.repeats} repeats (medians)")
    print("| way | wall (ms) | / values | writer CPU (ms) | / values |")
    print("|---|---|---|---|---|")
    base_wall = statistics.median(w for w, _ in times["values"])
    base_cpu = statistics.median(c for _, c in times["values"])
    for way, measured in times.items():
        wall = statistics.median(w for w, _ in measured)
        cpu = statistics.median(c for _, c in measured)
        print(f"| {way} | {wall * 1000:.1f} | {wall / base_wall:.2f} | {cpu * 1000:.1f} | "
              f"{cpu / base_cpu:.2f} |")


if __name__ == "__main__":
    run_tool(main)
