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
