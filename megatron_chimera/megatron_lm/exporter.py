"""``export_megatron``: our checkpoint -> a Megatron-core ``torch_dist`` checkpoint.

Writes what ``megatron.core.dist_checkpointing.load`` of Megatron's ``GPTModel`` (local or
Transformer-Engine spec, same ``torch_dist`` keys) expects, with no missing or unexpected key:
the layers stacked on dim 0 under ``decoder.layers.<suffix>``, one empty ``_extra_state`` object
per layer and linear (``<key>/shard_{i}_{L}``), ``common.pt`` with Megatron's ``args`` (so
``--use-checkpoint-args`` works), ``metadata.json``, and the tracker, written last. Tensors are
stock DCP chunks (``FileSystemWriter``), bitwise our weights; the vocabulary keeps our padded rows
(``args.padded_vocab_size``).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from dataclasses import dataclass

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

from megatron_chimera.atomic import atomic_write, fsync_dir
from megatron_chimera.checkpoint.megatron_format import (
    METADATA_JSON,
    TRACKER_FILENAME,
    MegatronCheckpointError,
)
from megatron_chimera.inference.loader import load_model
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


def megatron_state(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, object]:
    """Our whole-model state dict -> Megatron-core's ``torch_dist`` state (stacked layers and
    empty ``_extra_state`` objects)."""
    out: dict[str, object] = {}
    layers: dict[str, list[torch.Tensor | None]] = {}
    for name, tensor in state.items():
        megatron = from_ours(name)
        parsed = split_layer_name(megatron)
        if parsed is None:
            out[megatron] = tensor.detach().contiguous()
            continue
        index, suffix = parsed
        layers.setdefault(suffix, [None] * num_layers)[index] = tensor.detach()
    for suffix, per_layer in layers.items():
        out[LAYER_PREFIX + suffix] = torch.stack(per_layer)
    for linear in _LINEARS:  # Megatron packs a key's objects as the list of their data
        for index in range(num_layers):
            out[f"{LAYER_PREFIX}{linear}.{EXTRA_STATE}/shard_{index}_{num_layers}"] = [None]
    return out


def export_megatron(load: str, save: str, overwrite: bool = False) -> MegatronExportResult:
    """Write the latest checkpoint under ``load`` as a Megatron-core ``torch_dist`` checkpoint
    under ``save`` (``iter_<same iteration>``); the model's dtype is kept."""
    loaded = load_model(load, "cpu")
    if loaded.family is not GPT2:
        raise MegatronCheckpointError(f"export-megatron: {load} holds a {loaded.family.name} "
                                      "model; only the GPT family maps to Megatron's GPTModel")
    config = loaded.model_config
    if os.path.exists(save) and os.listdir(save) and not overwrite:
        raise MegatronCheckpointError(f"--save {save} is not empty (pass --overwrite)")
    iteration = loaded.iteration
    final = os.path.join(save, f"iter_{iteration:07d}")
    staging = final + ".tmp"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    state = megatron_state(loaded.model.state_dict(), config.num_layers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # single-process DCP warns that it assumes no_dist
        # not flattened: each [None] is one bytes item (torch.save of the list), as Megatron's
        dcp.save(state, storage_writer=FileSystemWriter(staging), no_dist=True,
                 planner=DefaultSavePlanner(flatten_state_dict=False))
    common = {"args": args_from_model_config(config, iteration),
              "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
              "num_floating_point_operations_so_far": 0}
    atomic_write(os.path.join(staging, "common.pt"), lambda h: torch.save(common, h))
    atomic_write(os.path.join(staging, METADATA_JSON),
                 lambda h: h.write(json.dumps(_METADATA).encode()))
    fsync_dir(staging)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staging, final)
    fsync_dir(save)
    atomic_write(os.path.join(save, TRACKER_FILENAME), lambda h: h.write(f"{iteration}".encode()))
    tensors = sum(isinstance(v, torch.Tensor) for v in state.values())
    return MegatronExportResult(final, iteration, tensors)
