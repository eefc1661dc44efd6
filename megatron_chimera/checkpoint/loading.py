"""Loading a checkpoint of :mod:`megatron_chimera.checkpoint.checkpointing` into any layout.

Each of this rank's stage modules is assembled from every saved stage file (``torch`` format) or
saved chunk (``torch_dist``) that overlaps it, so a checkpoint written with one (D, schedule,
pipes, W, T, EP) loads into another; the optimizer state, the LR scheduler, the progress counters
and this rank's RNG states follow. Files are read with ``weights_only=True`` or as tensor bytes
(never a pickle), and a missing, corrupt or incompatible file raises :class:`CheckpointError`
naming it before any tensor of this rank changes where that can be checked up front.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_chimera.checkpoint.checkpointing import (
    CHECKPOINT_VERSION,
    COMMON_FILENAME,
    FORMAT_TORCH,
    FORMAT_TORCH_DIST,
    TRACKER_FILENAME,
    CheckpointError,
    checkpoint_dir,
    read_tracker,
    safe_torch_load,
    set_rng_state,
)
from megatron_chimera.checkpoint.stages import (
    StageSlice,
    global_name,
    shared_embedding_name,
    stage_named_parameters,
)
from megatron_chimera.checkpoint.write_errors import failure_message
from megatron_chimera.optimizer.param_state import ParamStateError
from megatron_chimera.tensor_parallel.checkpoint_shards import split_tensor_parallel_state


@dataclass(frozen=True)
class CheckpointTarget:
    """What one rank restores a checkpoint into (the mirror of :class:`CheckpointContents`): its
    stage slices out of ``num_stages``, the optimizer (its state loaded when ``load_optim``; None:
    weights only) and the LR scheduler (None: not restored), the RNG state when ``load_rng``.
    ``finetune`` loads weights only and restarts at iteration 0 with no consumed samples
    (Megatron's ``--finetune``); ``check_args(saved args, checkpoint dir)`` may refuse the
    checkpoint before any tensor is read."""

    stages: list[StageSlice]
    num_stages: int
    optimizer: Any | None = None
    scheduler: Any | None = None
    load_optim: bool = True
    load_rng: bool = True
    finetune: bool = False
    check_args: Callable[[dict[str, Any], str], None] | None = None


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What ``load_checkpoint`` restored besides the module and optimizer tensors."""

    iteration: int
    consumed_train_samples: int
    consumed_valid_samples: int
    path: str
    bytes_read: int = 0  # tensor bytes this rank read (its checkpoint I/O)


def resolve_checkpoint_dir(root: str, iteration: int) -> str:
    """The directory of iteration ``iteration`` under ``root``; a missing one is reported with
    the iterations that are present."""
    path = checkpoint_dir(root, iteration)
    if not os.path.isdir(path) and os.path.isdir(path + ".old"):
        return path + ".old"  # crashed while replacing a re-saved iteration
    if not os.path.isdir(path):
        present = sorted(int(m.group(1)) for name in os.listdir(root)
                         if (m := re.fullmatch(r"iter_(\d{7})", name)) and
                         os.path.isdir(os.path.join(root, name)))
        raise CheckpointError(
            f"{os.path.join(root, TRACKER_FILENAME)} names iteration {iteration}, but {path} "
            f"does not exist (iterations present: {', '.join(map(str, present)) or 'none'}); "
            "write one of them into the tracker file"
        )
    return path


def _overlapping_files(common: dict[str, Any], stage: StageSlice, num_stages: int) -> list[str]:
    start, end = stage.layer_range
    saved = common["stages"]
    files = []
    for index, entry in enumerate(saved):
        lo, hi = entry["layer_range"]
        overlaps = lo < end and start < hi
        first_needed = index == 0 and stage.stage == 0
        last_needed = index == len(saved) - 1 and stage.stage == num_stages - 1
        if overlaps or first_needed or last_needed:
            files.append(entry["file"])
    if stage.stage == num_stages - 1 and saved[0]["file"] not in files:
        files.append(saved[0]["file"])  # the tied embedding may live only in the first file
    return files


def load_checkpoint(root: str, target: CheckpointTarget, *, rank: int,
                    world_size: int) -> LoadedCheckpoint | None:
    """Restore this rank's stage modules (and optimizer, scheduler, RNG) from ``root`` into
    ``target`` (the mirror of :func:`save_checkpoint`'s contents).

    Returns None when ``root`` has no tracker file. A release checkpoint
    (``save_checkpoint(release=True)``) is always loaded as ``finetune`` does.
    """
    stages, num_stages, optimizer = target.stages, target.num_stages, target.optimizer
    check_args = target.check_args
    iteration = read_tracker(root)
    if iteration is None:
        return None
    path = resolve_checkpoint_dir(root, iteration)
    common = safe_torch_load(os.path.join(path, COMMON_FILENAME))
    if common.get("checkpoint_version") != CHECKPOINT_VERSION:
        raise CheckpointError(f"{path}/{COMMON_FILENAME}: unsupported checkpoint version")
    if check_args is not None:
        check_args(common.get("args") or {}, path)
    finetune = target.finetune or bool(common.get("release", False))
    load_optim = target.load_optim and not finetune and optimizer is not None
    if common.get("format", FORMAT_TORCH) == FORMAT_TORCH_DIST:
        bytes_read = _load_sharded(path, common, stages, optimizer if load_optim else None)
    else:
        bytes_read = _load_stage_files(path, common, stages, num_stages, optimizer, load_optim)
    if load_optim:
        optimizer.load_collected_state(common.get("optimizer") or {})
    if finetune:
        return LoadedCheckpoint(0, 0, 0, path, bytes_read)
    if target.scheduler is not None and common.get("opt_param_scheduler") is not None:
        target.scheduler.load_state_dict(common["opt_param_scheduler"])
    if target.load_rng:
        _load_rng(path, rank, world_size, common)
    return LoadedCheckpoint(int(common["iteration"]), int(common["consumed_train_samples"]),
                            int(common["consumed_valid_samples"]), path, bytes_read)


def _load_sharded(path: str, common: dict[str, Any], stages: list[StageSlice],
                  optimizer: Any | None) -> int:
    """Read this rank's pieces of a ``torch_dist`` checkpoint into its stages (and optimizer);
    returns the bytes read."""
    from torch.distributed.checkpoint import CheckpointException

    from megatron_chimera.checkpoint.sharded import load_sharded_tensors

    if optimizer is not None and common.get("optimizer") is None:
        raise CheckpointError(f"{path}: saved without optimizer state (--no-save-optim); "
                              "use --no-load-optim or --finetune")
    # the distributed optimizer reads its own fragments of the weights and gathers the rest
    gather = getattr(optimizer, "gather_loaded_params", None)
    try:
        models, optims, bytes_read = load_sharded_tensors(path, stages, optimizer,
                                                          owned_only=gather is not None)
    except KeyError as exc:
        raise CheckpointError(f"{exc.args[0]}; was it written for another model?") from None
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP wraps every failure
        raise CheckpointError(f"{path}: {failure_message(exc)[:400]}") from None
    for stage in stages:
        try:
            if models[stage.stage]:  # entries not read in place
                stage.module.load_state_dict(models[stage.stage], strict=False)
        except RuntimeError as exc:
            raise CheckpointError(f"{path}: stage {stage.stage} does not match: {exc}") from None
        if optimizer is not None:
            try:
                optimizer.collect_state_fragments(stage_named_parameters(stage),
                                                  optims[stage.stage])
            except ParamStateError as exc:
                raise CheckpointError(f"{path}: {exc}") from None
    if gather is not None:
        gather()
    return bytes_read


def _load_stage_files(path: str, common: dict[str, Any], stages: list[StageSlice],
                      num_stages: int, optimizer: Any | None, load_optim: bool) -> int:
    """Read the ``torch`` format's stage files overlapping this rank's stages; returns the
    bytes of the files read."""
    cache: dict[str, dict[str, Any]] = {}

    def read(name: str) -> dict[str, Any]:
        if name not in cache:
            cache[name] = safe_torch_load(os.path.join(path, name))
        return cache[name]

    for stage in stages:
        _refuse_expert_shards(path, stage)
        files = _overlapping_files(common, stage, num_stages)
        model: dict[str, torch.Tensor] = {}
        optim: dict[str, Any] = {}
        shared: tuple[torch.Tensor, Any] | None = None
        for name in files:
            payload = read(name)
            model.update(payload["model"])
            if payload.get("optimizer"):
                optim.update(payload["optimizer"])
            key = payload.get("shared_embedding")
            if key is not None and shared is None:
                shared = (payload["model"][key], (payload.get("optimizer") or {}).get(key))
        _alias_shared_embedding(stage, model, optim, shared)
        params = stage_named_parameters(stage)
        model, optim = split_tensor_parallel_state(model, optim, params)
        _load_stage_module(stage, model, path)
        if load_optim:
            if not optim:
                raise CheckpointError(
                    f"{path}: saved without optimizer state (--no-save-optim); "
                    "use --no-load-optim or --finetune"
                )
            try:
                optimizer.collect_param_state(params, optim)
            except ParamStateError as exc:
                raise CheckpointError(f"{path}: {exc}") from None
    return sum(os.path.getsize(os.path.join(path, name)) for name in cache)


def _refuse_expert_shards(path: str, stage: StageSlice) -> None:
    """A ``torch`` checkpoint holds whole MoE layers; a stage holding only some experts
    (expert parallelism) cannot load it."""
    for name, param in stage_named_parameters(stage).items():
        if getattr(param, "num_experts", None) not in (None, param.shape[0]):
            raise CheckpointError(
                f"{path}: a --ckpt-format torch checkpoint does not load with "
                f"--expert-model-parallel-size > 1 ({name} holds {param.shape[0]} of "
                f"{param.num_experts} experts); load it with --expert-model-parallel-size 1 "
                "and save it as --ckpt-format torch_dist, which loads into any EP")


def _alias_shared_embedding(stage: StageSlice, model: dict[str, torch.Tensor],
                            optim: dict[str, Any], shared: tuple[torch.Tensor, Any] | None) -> None:
    """Fill this stage's tied-embedding key from whichever saved stage held the embedding."""
    name = shared_embedding_name(stage)
    if name is None or name in model or shared is None:
        return
    model[name] = shared[0]
    if shared[1] is not None:
        optim[name] = shared[1]


def _load_stage_module(stage: StageSlice, model: dict[str, torch.Tensor], path: str) -> None:
    start = stage.layer_range[0]
    local = {}
    for name in stage.module.state_dict():
        key = global_name(name, start)
        if key not in model:
            raise CheckpointError(
                f"{path}: no saved tensor {key} for stage {stage.stage} "
                f"(layers {stage.layer_range}); was it written for another model?"
            )
        local[name] = model[key]
    try:
        stage.module.load_state_dict(local, strict=True)
    except RuntimeError as exc:
        raise CheckpointError(f"{path}: stage {stage.stage} does not match: {exc}") from None


def _load_rng(path: str, rank: int, world_size: int, common: dict[str, Any]) -> None:
    if common.get("world_size") != world_size:
        if rank == 0:
            print(f"note: {path} was saved with world size {common.get('world_size')}; "
                  f"RNG states are not restored for world size {world_size}", flush=True)
        return
    set_rng_state(safe_torch_load(os.path.join(path, "rng", f"rank_{rank:05d}.pt")))
