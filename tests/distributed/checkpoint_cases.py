"""Per-rank bodies of the sharded-checkpoint tests: who writes and reads how much, and whether a
checkpoint loaded into another layout comes back bitwise.

T=2 x Chimera D=2 x W=2 with the distributed optimizer (8 ranks) trains two Adam steps and saves
in the ``torch_dist`` format; T=1 x 1F1B D=4 x W=2 (distributed optimizer) loads it and saves at
once. Each rank reports the bytes of the checkpoint files it wrote and the bytes it read; rank 0
compares the two checkpoints tensor by tensor (weights, Adam moments, steps): the second is
derived only from what the second layout loaded, so equality means the load was exact.
"""

from __future__ import annotations

import errno
import glob
import json
import os
import signal

import torch
import torch.distributed as dist

from megatron_chimera.checkpoint import dcp_io
from megatron_chimera.checkpoint.async_save import AsyncCheckpointer
from megatron_chimera.checkpoint.checkpointing import (
    CheckpointContents,
    checkpoint_dir,
    prepare_sharded_save,
)
from megatron_chimera.checkpoint.dcp_io import CheckpointWriteError
from megatron_chimera.checkpoint.sharded import read_full_tensors
from megatron_chimera.config import DDPConfig
from megatron_chimera.schedules import build_schedule

from .tp_cases import (
    ADAM,
    TPCase,
    _init_groups,
    _layout_run,
    _stage_slices,
    build_run,
    make_batch,
)

# Megatron's default buckets (small buckets cut each parameter into many tiny fragments)
SHARDED = DDPConfig(use_distributed_optimizer=True)
SOURCE = TPCase("gpt2", "chimera", 2, 2, 4, (("pipes", 2),), num_layers=8, ddp=SHARDED)
TARGET = TPCase("gpt2", "1f1b", 1, 4, 4, num_layers=8, ddp=SHARDED)


def written_bytes(directory: str, rank: int) -> int:
    """Bytes of the DCP data files ``rank`` wrote in a checkpoint directory."""
    return sum(os.path.getsize(p) for p in glob.glob(os.path.join(directory, f"__{rank}_*")))


def checkpoint_bytes(directory: str) -> int:
    """Bytes of every DCP data file of a checkpoint directory."""
    return sum(os.path.getsize(p) for p in glob.glob(os.path.join(directory, "__*.distcp")))


def _run(case: TPCase, config, steps: int, root_in: str | None, root_out: str) -> int:
    """Build ``case``, load ``root_in`` (when given), train ``steps`` steps, save ``root_out``
    (torch_dist); returns the bytes this rank read."""
    return _layout_run(case, config, steps, root_in, root_out, ckpt_format="torch_dist",
                       keep_states=False)["read"]


def run_sharded_io(rank: int, world_size: int, root: str) -> None:
    """Save on SOURCE, load on TARGET and save again; rank 0 checks the two checkpoints are
    equal and writes the per-rank byte counts to ``root/io.json``."""
    config = SOURCE.model_config(hidden_size=128)
    first, second = os.path.join(root, "source"), os.path.join(root, "target")
    _run(SOURCE, config, 2, None, first)
    read = _run(TARGET, config, 0, first, second)
    counts = [None] * world_size
    dist.all_gather_object(counts, (written_bytes(checkpoint_dir(first, 1), rank), read))
    if rank != 0:
        return
    a, b = dict(read_full_tensors(checkpoint_dir(first, 1))), \
        dict(read_full_tensors(checkpoint_dir(second, 1)))
    if a.keys() != b.keys():
        raise AssertionError(f"tensor names differ: {sorted(a.keys() ^ b.keys())[:5]}")
    if not any(k.endswith("/exp_avg") for k in a):
        raise AssertionError("no Adam moments saved")
    for name, value in a.items():
        if not torch.equal(value, b[name]):
            raise AssertionError(f"{name} differs after loading into T=1 1F1B D=4")
    with open(os.path.join(root, "io.json"), "w") as handle:
        json.dump({"size": checkpoint_bytes(checkpoint_dir(first, 1)),
                   "written": [c[0] for c in counts], "read": [c[1] for c in counts]}, handle)


def _async_job(root: str, iteration: int, stages, partition, optimizer):
    return prepare_sharded_save(root, CheckpointContents(iteration, stages, partition,
                                                         optimizer=optimizer),
                                rank=dist.get_rank(), world_size=dist.get_world_size(),
                                copy=True)


def _first_save(root: str):
    """Two ranks (1F1B D=2) train a step and save iteration 1 with --async-save's checkpointer;
    rank 0 snapshots what it holds. Returns (checkpointer, step, job maker)."""
    case = TPCase("gpt2", "1f1b", 1, 2, 2)
    schedule = build_schedule(case.schedule, case.pipeline_size, case.num_microbatches)
    _init_groups(case, schedule)
    modules, optimizer, executor, partition = build_run(case, case.model_config(), schedule,
                                                        optimizer_config=ADAM)
    stages = _stage_slices(modules, partition)
    saver = AsyncCheckpointer(dist.new_group(backend="gloo"))

    def step(index: int) -> None:
        optimizer.zero_grad()
        executor.run([make_batch(case.family, index, 0, m) for m in range(2)])
        optimizer.step()

    def job(iteration: int):
        return _async_job(root, iteration, stages, partition, optimizer)

    step(0)
    saver.start(job(1))
    saver.wait()
    if dist.get_rank() == 0:  # what the previous checkpoint holds, to compare afterwards
        torch.save(dict(read_full_tensors(checkpoint_dir(root, 1))),
                   os.path.join(root, "snapshot.pt"))
    dist.barrier()
    return saver, step, job


def run_disk_full(rank: int, world_size: int, root: str) -> None:
    """After iteration 1 is saved, rank 1's disk is full while the async save of iteration 2
    writes its chunks; every rank writes the error it gets to ``root/error_<rank>.txt``."""
    saver, step, job = _first_save(root)
    step(1)
    if rank == 1:
        def full(*_args, **_kwargs):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        dcp_io.ArchiveChunkWriter._write_chunk = staticmethod(full)
    saver.start(job(2))
    step(2)
    try:
        saver.wait()
    except CheckpointWriteError as exc:
        with open(os.path.join(root, f"error_{rank}.txt"), "w") as handle:
            handle.write(str(exc))
    else:
        raise AssertionError("the save on a full disk did not fail")


def run_async_save_killed(rank: int, world_size: int, root: str, victim: int,
                          moment: str) -> None:
    """Two ranks save iteration 1 with --async-save's checkpointer, then start saving
    iteration 2 while training on; rank ``victim`` is killed (SIGKILL) at ``moment``: right
    after the save started, inside the tensor write, or when publishing the directory."""
    saver, step, job = _first_save(root)
    step(1)
    die = lambda *_args, **_kwargs: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
    if rank == victim and moment == "write":
        dcp_io.save_chunks = die  # looked up when the save job runs
    if rank == victim and moment == "publish":
        real = os.replace
        os.replace = lambda src, dst: die() if str(dst).endswith("iter_0000002") \
            else real(src, dst)
    saver.start(job(2))
    if rank == victim and moment == "start":
        die()
    step(2)  # training goes on while the save is in flight
    saver.wait()
