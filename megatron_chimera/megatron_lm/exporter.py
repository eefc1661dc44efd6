"""``export_megatron``: our checkpoint -> a Megatron-core ``torch_dist`` checkpoint.

Writes what ``megatron.core.dist_checkpointing.load`` of Megatron's ``GPTModel`` (local or
Transformer-Engine spec, same ``torch_dist`` keys) expects, with no missing or unexpected key:
the layers stacked on dim 0 under ``decoder.layers.<suffix>``, one empty ``_extra_state`` object
per layer and linear (``<key>/shard_{i}_{L}``), ``common.pt`` with Megatron's ``args`` (so
``--use-checkpoint-args`` works), ``metadata.json``, and the tracker, written last. Tensors are
stock DCP chunks (torch.save archives, as ``FileSystemWriter`` writes them), bitwise our weights;
the vocabulary keeps our padded rows (``args.padded_vocab_size``). From our ``torch_dist`` format
the export streams: the model is built on the ``meta`` device (names, shapes, dtypes) and each
Megatron tensor is read from our chunks (a stacked one's layers straight into its rows) and
written before the next is read, so it holds about one (stacked) tensor, not the model.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

import torch

from megatron_chimera.atomic import atomic_write, fsync_dir
from megatron_chimera.checkpoint.checkpointing import FORMAT_TORCH_DIST, CheckpointError, StageSlice
from megatron_chimera.checkpoint.dcp_io import SaveChunk, load_chunks, save_chunks
from megatron_chimera.checkpoint.loading import resolve_checkpoint_dir
from megatron_chimera.checkpoint.megatron_format import (
    METADATA_JSON,
    TRACKER_FILENAME,
    MegatronCheckpointError,
)
from megatron_chimera.checkpoint.saved_args import read_common, saved_model_config
from megatron_chimera.checkpoint.sharded import stored_names
from megatron_chimera.inference.loader import build_model, detect_family, load_model
from megatron_chimera.megatron_lm.args import args_from_model_config
from megatron_chimera.megatron_lm.names import (
    EXTRA_STATE,
    LAYER_PREFIX,
    from_ours,
    split_layer_name,
)
from megatron_chimera.model.family import GPT2

CHECKPOINT_VERSION = 3.0  # Megatron-LM's checkpoint_version
_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
            "mlp.linear_fc2")
_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
             "common_backend": "torch", "common_backend_version": 1}


@dataclass(frozen=True)
class MegatronExportResult:
    """What ``export_megatron`` wrote."""

    path: str  # the iteration directory
    iteration: int
    tensors: int


def _megatron_keys(model: torch.nn.Module, num_layers: int
                   ) -> dict[str, tuple[tuple[int, ...], torch.dtype, list[str]]]:
    """Megatron key -> (its shape, dtype, our global names in its order: one per layer of a
    stacked key) of our whole model's state dict (``meta`` tensors will do)."""
    out: dict[str, tuple[tuple[int, ...], torch.dtype, list[str]]] = {}
    layers: dict[str, list[str | None]] = {}
    state = model.state_dict(keep_vars=True)
    for name, tensor in state.items():
        megatron = from_ours(name)
        parsed = split_layer_name(megatron)
        if parsed is None:
            out[megatron] = (tuple(tensor.shape), tensor.dtype, [name])
            continue
        layers.setdefault(parsed[1], [None] * num_layers)[parsed[0]] = name
    for suffix, names in layers.items():
        first = state[names[0]]
        out[LAYER_PREFIX + suffix] = ((num_layers, *first.shape), first.dtype, names)
    return out


def _streamed_tensors(path: str, keys, stored: dict[str, str]):
    """((Megatron key, zero offsets), tensor) of every key, read from our ``torch_dist``
    checkpoint at ``path`` one key at a time: a stacked key's layers are read straight into
    the rows of one ``[L, ...]`` tensor (no other copy)."""
    for key, (shape, dtype, names) in keys.items():
        out = torch.empty(shape, dtype=dtype)
        views = list(out) if key.startswith(LAYER_PREFIX) else [out]
        requests = {(f"model/{stored[name]}", (0,) * view.dim()): view
                    for name, view in zip(names, views)}
        load_chunks(path, requests, collective=False)
        yield (key, (0,) * out.dim()), out
        del out, views, requests


def _extra_states(num_layers: int) -> dict[str, object]:
    """One empty ``_extra_state`` object per layer and linear (Megatron packs a key's objects as
    the list of their data: each ``[None]`` is one bytes item, ``torch.save`` of the list)."""
    return {f"{LAYER_PREFIX}{linear}.{EXTRA_STATE}/shard_{index}_{num_layers}": [None]
            for linear in _LINEARS for index in range(num_layers)}


def export_megatron(load: str, save: str, overwrite: bool = False) -> MegatronExportResult:
    """Write the latest checkpoint under ``load`` as a Megatron-core ``torch_dist`` checkpoint
    under ``save`` (``iter_<same iteration>``); the model's dtype is kept. Our ``torch_dist``
    checkpoints stream (one Megatron tensor in memory at a time); the ``torch`` format's files
    are loaded whole."""
    common = read_common(load) if os.path.isdir(load) else None
    if common is None:
        raise CheckpointError(f"--load {load}: no checkpoint (no latest_checkpointed_iteration"
                              ".txt)" if os.path.isdir(load) else f"--load {load}: not a directory")
    family = detect_family(load, common)
    if family is not GPT2:
        raise MegatronCheckpointError(f"export-megatron: {load} holds a {family.name} "
                                      "model; only the GPT family maps to Megatron's GPTModel")
    if os.path.exists(save) and os.listdir(save) and not overwrite:
        raise MegatronCheckpointError(f"--save {save} is not empty (pass --overwrite)")
    iteration = int(common["iteration"])
    streamed = common.get("format") == FORMAT_TORCH_DIST
    if streamed:
        config = saved_model_config(common, load)
        with torch.device("meta"):
            model = build_model(GPT2, config)  # names, shapes and dtypes only
    else:
        loaded = load_model(load, "cpu")
        config, model = loaded.model_config, loaded.model
    if config.moe.enabled:  # refused before anything is created under --save
        raise MegatronCheckpointError(
            f"export-megatron: {load} holds a mixture-of-experts model "
            f"({config.moe.num_experts} experts); Megatron's MoE layout is not mapped yet, so "
            "only dense GPT-family checkpoints export (export-hf writes Mixtral/Qwen2-MoE)")
    keys = _megatron_keys(model, config.num_layers)
    final = os.path.join(save, f"iter_{iteration:07d}")
    staging = final + ".tmp"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    if streamed:
        source = resolve_checkpoint_dir(load, iteration)
        stored = stored_names(StageSlice(0, (0, config.num_layers), model))
        tensors = _streamed_tensors(source, keys, stored)
    else:
        state = model.state_dict()
        tensors = (((key, (0,) * len(shape)),
                    torch.stack([state[n] for n in names]) if key.startswith(LAYER_PREFIX)
                    else state[names[0]])
                   for key, (shape, _, names) in keys.items())
    plan = {(key, (0,) * len(shape)): SaveChunk(shape, torch.empty(shape, dtype=dtype,
                                                                  device="meta"))
            for key, (shape, dtype, _) in keys.items()}
    try:
        save_chunks(staging, plan, tensors=tensors, objects=_extra_states(config.num_layers))
    except BaseException:  # nothing half-written stays behind
        shutil.rmtree(staging, ignore_errors=True)
        raise
    common_out = {"args": args_from_model_config(config, iteration),
                  "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
                  "num_floating_point_operations_so_far": 0}
    atomic_write(os.path.join(staging, "common.pt"), lambda h: torch.save(common_out, h))
    atomic_write(os.path.join(staging, METADATA_JSON),
                 lambda h: h.write(json.dumps(_METADATA).encode()))
    fsync_dir(staging)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staging, final)
    fsync_dir(save)
    atomic_write(os.path.join(save, TRACKER_FILENAME), lambda h: h.write(f"{iteration}".encode()))
    return MegatronExportResult(final, iteration, len(keys))
