"""host_memory: the peak resident memory a phase adds, from the kernel's high-water mark."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_chimera.checkpoint.host_memory import PeakHostMemory

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"),
                                reason="needs Linux's /proc/self/clear_refs")


def test_a_freed_allocation_still_counts_and_a_later_meter_starts_afresh():
    meter = PeakHostMemory()
    block = torch.ones(64 * 2**20, dtype=torch.uint8)  # touched: resident
    del block
    assert meter.added_bytes() >= 60 * 2**20
    assert PeakHostMemory().added_bytes() < 16 * 2**20  # the high-water mark was reset


def test_a_save_job_reports_its_peak(tmp_path):
    from megatron_chimera.checkpoint.checkpointing import CheckpointContents, prepare_sharded_save

    from .test_checkpointing import build

    stages, opt, sched = build([(0, 4)])
    job = prepare_sharded_save(str(tmp_path), CheckpointContents(1, stages, [(0, 4)], opt, sched),
                               rank=0, world_size=1, copy=True)
    job.run(lambda: None)
    assert len(job.peak_bytes_per_rank) == 1 and job.peak_bytes_per_rank[0] >= 0


def test_reads_hold_about_one_tensor_and_nothing_when_in_place(tmp_path):
    from megatron_chimera.checkpoint.dcp_io import SaveChunk, load_chunks, save_chunks
    from megatron_chimera.checkpoint.sharded import read_full_tensors

    rows, mb = 2048, 2**20  # a 16 MB tensor saved as two chunks, and a small one
    big = torch.randn(rows, 2048)
    save_chunks(str(tmp_path), {("big", (0, 0)): SaveChunk((rows, 2048), big[:1000].clone()),
                                ("big", (1000, 0)): SaveChunk((rows, 2048), big[1000:].clone()),
                                ("small", (0,)): SaveChunk((10,), torch.ones(10))})
    meter = PeakHostMemory()
    for name, tensor in read_full_tensors(str(tmp_path)):  # one tensor at a time
        assert torch.equal(tensor, big if name == "big" else torch.ones(10))
        del tensor
    assert meter.added_bytes() <= 20 * mb  # the 16 MB tensor, not two copies of it
    into = torch.zeros(rows, 2048)
    meter = PeakHostMemory()
    load_chunks(str(tmp_path), {("big", (0, 0)): into}, collective=False)
    assert meter.added_bytes() <= 4 * mb and torch.equal(into, big)  # read in place
