"""Layout-independent, atomic checkpoints in Megatron's directory layout.

::

    <save>/latest_checkpointed_iteration.txt      the last complete iteration (written last)
    <save>/iter_0000100/common.pt                 iteration, args, consumed samples, LR scheduler,
                                                  grad scaler, the stage manifest (rank 0)
    <save>/iter_0000100/layers_000-002.pt         one file per model stage: weights and optimizer
                                                  state keyed by *global* parameter names
    <save>/iter_0000100/rng/rank_00003.pt         per-rank RNG states

A stage file holds the parameters of global layers ``[start, end)`` (``layers.{i}`` renamed to the
global layer index) plus the embedding (first stage) or the final layer norm and head (last
stage). Loading (:mod:`.loading`) assembles each of this rank's stage modules from every saved
stage file that overlaps it, so a checkpoint written with one (D, schedule, pipes, W) loads into
any other.
Files are written to a staging directory (temp file, fsync, rename) and the staging directory is
renamed into place after a barrier; only then is the tracker updated, so a crash at any point
leaves the previous checkpoint loadable and the tracker pointing at it.

Stage files hold full tensors whatever the tensor-parallel size T: the shards of a stage are
joined on tensor rank 0 of the writing group before it writes, and split again on load
(:mod:`megatron_chimera.tensor_parallel.checkpoint_shards`), so T is part of the layout too.
"""

from __future__ import annotations

import copy as copy_module
import os
import random
import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_chimera.atomic import atomic_write, fsync_dir
from megatron_chimera.checkpoint.host_memory import PeakHostMemory
from megatron_chimera.checkpoint.stages import (  # noqa: F401 - re-exported
    StageSlice,
    global_name,
    shared_embedding_name,
    stage_named_parameters,
)
from megatron_chimera.checkpoint.write_errors import write_errors_reported
from megatron_chimera.errors import UserError
from megatron_chimera.tensor_parallel import get_cuda_rng_tracker
from megatron_chimera.tensor_parallel.checkpoint_shards import (
    join_tensor_parallel_state,
)

if TYPE_CHECKING:
    from megatron_chimera.checkpoint.dcp_io import ChunkKey

# torch.distributed.checkpoint (about 1 s to import) is imported by the torch_dist paths only,
# so a rank that never saves in that format starts without it.

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
COMMON_FILENAME = "common.pt"
CHECKPOINT_VERSION = 1
FORMAT_TORCH = "torch"  # one file per stage, full tensors (Megatron's legacy layout)
FORMAT_TORCH_DIST = "torch_dist"  # every rank's own pieces through DCP (.sharded)
CKPT_FORMATS = (FORMAT_TORCH, FORMAT_TORCH_DIST)


class CheckpointError(UserError, RuntimeError):
    """A missing, corrupt, truncated or incompatible checkpoint; the message names the file."""


@dataclass(frozen=True)
class CheckpointContents:
    """What one rank contributes to checkpoint ``iteration``: its stage slices, every stage's
    layer range (the manifest), the optimizer (its state saved when ``save_optim``) and the LR
    scheduler (None: not saved), the progress counters and the run's arguments. ``release``
    marks weights from elsewhere (Megatron's release checkpoint, e.g. an imported Hugging Face
    model): ``--load`` starts from them at iteration 0 with a fresh optimizer."""

    iteration: int
    stages: list[StageSlice]
    partition: list[tuple[int, int]]
    optimizer: Any | None = None
    scheduler: Any | None = None
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    args: dict[str, Any] | None = None
    save_optim: bool = True
    release: bool = False


# ---------------------------------------------------------------------------- names and files
def checkpoint_dir(root: str, iteration: int) -> str:
    """``<root>/iter_0000100``: Megatron's directory name of one iteration."""
    return os.path.join(root, f"iter_{iteration:07d}")


def stage_filename(layer_range: tuple[int, int]) -> str:
    """File name of the stage holding global layers ``[start, end)``."""
    return f"layers_{layer_range[0]:03d}-{layer_range[1]:03d}.pt"


def read_tracker(root: str) -> int | None:
    """The iteration in ``latest_checkpointed_iteration.txt``, or None when there is none."""
    path = os.path.join(root, TRACKER_FILENAME)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path}: expected an iteration number, found {text!r}")
    return int(text)


def atomic_torch_save(obj: Any, path: str) -> None:
    """``torch.save`` made atomic (temp file, fsync, rename); a failed write names ``path``."""
    try:
        atomic_write(path, lambda handle: torch.save(obj, handle))
    except OSError as exc:
        if exc.filename is not None or exc.errno is None:
            raise
        raise OSError(exc.errno, exc.strerror, path) from None


def safe_torch_load(path: str) -> Any:
    """``torch.load(weights_only=True)`` on CPU; a failure is a CheckpointError naming ``path``."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises many types for corrupt files
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        if len(detail) > 120:  # torch's unpickler explains weights_only at length
            detail = detail[:117] + "..."
        raise CheckpointError(
            f"checkpoint file {path} is corrupt or truncated ({type(exc).__name__}: {detail})"
        ) from None


# ---------------------------------------------------------------------------- RNG
def get_rng_state() -> dict[str, Any]:
    """Python, numpy, torch CPU (and CUDA) RNG states and the tensor-parallel tracker's, as
    weights-only-loadable objects."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    state["tensor_parallel"] = {
        name: {"cpu": cpu, **({"cuda": cuda} if cuda is not None else {})}
        for name, (cpu, cuda) in get_cuda_rng_tracker().get_states().items()}
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`get_rng_state`."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "tensor_parallel" in state:
        get_cuda_rng_tracker().set_states({
            name: (entry["cpu"], entry.get("cuda"))
            for name, entry in state["tensor_parallel"].items()})


# ---------------------------------------------------------------------------- save
def save_checkpoint(root: str, contents: CheckpointContents, *, rank: int, world_size: int,
                    barrier: Callable[[], None] | None = None, ckpt_format: str = "torch") -> str:
    """Collectively write ``contents`` (iteration ``contents.iteration``) under ``root``; every
    rank must call it. ``torch``: each stage's file is written by its ``writer`` rank;
    ``torch_dist``: every rank writes its own pieces (:mod:`.sharded`). RNG states are written
    by every rank, ``common.pt`` by rank 0; the directory is published once every part is written.
    """
    barrier = barrier or (lambda: None)
    if ckpt_format == FORMAT_TORCH_DIST:
        return prepare_sharded_save(root, contents, rank=rank, world_size=world_size).run(barrier)
    stages, optimizer, iteration = list(contents.stages), contents.optimizer, contents.iteration
    final = checkpoint_dir(root, iteration)
    staging = _make_staging(root, final, rank, barrier)
    if optimizer is not None:
        optimizer.finish_param_sync()  # the weights saved are the updated ones
    optimizer = optimizer if contents.save_optim else None
    with write_errors_reported(staging, iteration, remove=False):
        _save_stage_files(staging, stages, optimizer)
        atomic_torch_save(get_rng_state(), os.path.join(staging, "rng", f"rank_{rank:05d}.pt"))
        if rank == 0:
            atomic_torch_save(_common_payload(contents, optimizer, world_size, FORMAT_TORCH),
                              os.path.join(staging, COMMON_FILENAME))
    barrier()
    if rank == 0:
        _publish(root, staging, final, iteration)
    barrier()
    return final


def _make_staging(root: str, final: str, rank: int, barrier: Callable[[], None]) -> str:
    """A fresh ``<final>.staging`` directory (made by rank 0; every rank waits for it)."""
    staging = final + ".staging"
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(os.path.join(staging, "rng"))
    barrier()
    return staging


@dataclass
class SaveJob:
    """A ``torch_dist`` checkpoint captured at its iteration -- this rank's chunks, RNG state
    and (rank 0) ``common.pt`` -- to be written now or in the background (``--async-save``).
    ``memory`` measures this rank's peak host memory from the capture to the publish; ``run``
    sets ``peak_bytes_per_rank`` (every rank's, None where not measurable)."""

    root: str
    iteration: int
    rank: int
    chunks: dict[Any, Any]
    rng: dict[str, Any]
    common: dict[str, Any] | None
    memory: PeakHostMemory | None = None
    peak_bytes_per_rank: list[int | None] | None = None
    tensors: Iterator[tuple[ChunkKey, torch.Tensor]] | None = None  # streamed values (one process)

    @property
    def final(self) -> str:
        """The directory the checkpoint is published as."""
        return checkpoint_dir(self.root, self.iteration)

    def run(self, barrier: Callable[[], None], process_group: Any = None) -> str:
        """Collectively write and publish (``barrier`` and DCP's collectives on
        ``process_group``; None: the default group)."""
        from megatron_chimera.checkpoint.dcp_io import save_chunks

        staging = _make_staging(self.root, self.final, self.rank, barrier)
        with write_errors_reported(staging, self.iteration, remove=self.rank == 0):
            save_chunks(staging, self.chunks, process_group, tensors=self.tensors)
        with write_errors_reported(staging, self.iteration, remove=False):
            atomic_torch_save(self.rng, os.path.join(staging, "rng",
                                                     f"rank_{self.rank:05d}.pt"))
            if self.common is not None:
                atomic_torch_save(self.common, os.path.join(staging, COMMON_FILENAME))
        barrier()
        if self.rank == 0:
            _publish(self.root, staging, self.final, self.iteration)
        self.peak_bytes_per_rank = self._gather_peaks(process_group)  # also the last barrier
        return self.final

    def _gather_peaks(self, process_group: Any) -> list[int | None]:
        mine = self.memory.added_bytes() if self.memory is not None else None
        if not dist.is_initialized():
            return [mine]
        peaks: list[Any] = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(peaks, mine, group=process_group)
        return peaks


def prepare_sharded_save(root: str, contents: CheckpointContents, *, rank: int,
                         world_size: int, copy: bool = False) -> SaveJob:
    """Capture ``contents`` for a ``torch_dist`` save; ``copy``: stage every tensor in host
    memory of its own (training may go on while the job writes)."""
    from megatron_chimera.checkpoint.sharded import collect_save_chunks

    memory = PeakHostMemory()
    optimizer = contents.optimizer
    if optimizer is not None:
        optimizer.finish_param_sync()  # the weights saved are the updated ones
    optimizer = optimizer if contents.save_optim else None
    chunks = collect_save_chunks(list(contents.stages), optimizer, copy=copy)
    common = (copy_module.deepcopy(_common_payload(contents, optimizer, world_size,
                                                   FORMAT_TORCH_DIST))
              if rank == 0 else None)
    return SaveJob(root, contents.iteration, rank, chunks, get_rng_state(), common, memory)


def save_streamed(root: str, contents: CheckpointContents,
                  tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A one-process ``torch_dist`` save of one whole-model stage without an optimizer whose
    values stream from ``tensors`` -- (global name, whole tensor), every tensor of the stage's
    state dict once, in any order -- so the save holds one tensor at a time (a converter's
    bounded memory); the stage's module gives only names, shapes and dtypes (it may live on the
    ``meta`` device). The files are those ``save_checkpoint`` writes."""
    from megatron_chimera.checkpoint.dcp_io import SaveChunk
    from megatron_chimera.checkpoint.sharded import stored_names

    (stage,) = contents.stages
    if contents.optimizer is not None and contents.save_optim:
        raise ValueError("save_streamed writes model tensors only")
    names = stored_names(stage)
    chunks = {}
    for local, tensor in stage.module.state_dict(keep_vars=True).items():
        name = global_name(local, stage.layer_range[0])
        chunks[(f"model/{names[name]}", (0,) * tensor.dim())] = SaveChunk(
            tuple(tensor.shape), tensor.detach())

    def stream() -> Iterator[tuple[ChunkKey, torch.Tensor]]:
        for name, tensor in tensors:
            yield (f"model/{names[name]}", (0,) * tensor.dim()), tensor
            del tensor  # not held while the next one is read

    common = _common_payload(contents, None, 1, FORMAT_TORCH_DIST)
    job = SaveJob(root, contents.iteration, 0, chunks, get_rng_state(), common, tensors=stream())
    try:
        return job.run(lambda: None)
    except BaseException:  # a tensor refused mid-stream: nothing half-written stays behind
        shutil.rmtree(job.final + ".staging", ignore_errors=True)
        raise


def _save_stage_files(staging: str, stages: list[StageSlice], optimizer: Any | None) -> None:
    """The ``torch`` format: each stage's writer joins its tensor-parallel shards and writes
    the stage's file."""
    optim_states = (optimizer.param_state_to_save(
        [(st.stage, stage_named_parameters(st), st.writer) for st in stages])
        if optimizer is not None else {})
    for stage in stages:
        if not stage.writer:
            continue
        optim_state = optim_states.get(stage.stage) if optimizer is not None else None
        start = stage.layer_range[0]
        joined = join_tensor_parallel_state(  # a collective of the stage's tensor-parallel group
            {global_name(n, start): t.detach().cpu()
             for n, t in stage.module.state_dict().items()},
            optim_state, stage_named_parameters(stage))
        if joined is None:
            continue  # not tensor rank 0: its shards went to the writer
        payload = {
            "stage": stage.stage,
            "layer_range": list(stage.layer_range),
            "model": joined[0],
            "shared_embedding": shared_embedding_name(stage),
            "optimizer": joined[1],
        }
        atomic_torch_save(payload, os.path.join(staging, stage_filename(stage.layer_range)))


def _common_payload(contents: CheckpointContents, optimizer: Any | None, world_size: int,
                    ckpt_format: str) -> dict[str, Any]:
    """What ``common.pt`` records once for the whole checkpoint."""
    return {
        "checkpoint_version": CHECKPOINT_VERSION,
        "format": ckpt_format,
        "iteration": contents.iteration,
        "release": contents.release,
        "world_size": world_size,
        "args": contents.args or {},
        "consumed_train_samples": contents.consumed_train_samples,
        "consumed_valid_samples": contents.consumed_valid_samples,
        "stages": [{"layer_range": list(r), "file": stage_filename(r)}
                   for r in contents.partition],
        "opt_param_scheduler": (contents.scheduler.state_dict()
                                if contents.scheduler is not None else None),
        "optimizer": optimizer.common_state() if optimizer is not None else None,
    }


def _publish(root: str, staging: str, final: str, iteration: int) -> None:
    """Rename the complete staging directory into place, then point the tracker at it."""
    fsync_dir(staging)
    previous = final + ".old"
    if os.path.isdir(final):
        shutil.rmtree(previous, ignore_errors=True)
        os.replace(final, previous)
    os.replace(staging, final)
    fsync_dir(root)
    atomic_write(os.path.join(root, TRACKER_FILENAME),
                 lambda handle: handle.write(f"{iteration}\n".encode()))
    shutil.rmtree(previous, ignore_errors=True)
