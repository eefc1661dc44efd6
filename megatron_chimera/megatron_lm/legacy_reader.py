"""Read a legacy Megatron-LM checkpoint (``iter_*/mp_rank_TT[_PPP]/model_optim_rng.pt``).

Each file holds one (tensor rank, pipeline rank)'s part of the model, with the layer numbers
local to its pipeline stage. The reader merges one pipeline stage at a time (its T files in
memory, nothing more): column-parallel tensors are joined on dim 0 (``linear_qkv``: each rank
holds whole query groups; the embedding and output layer: vocabulary rows), row-parallel ones on
dim 1, SwiGLU's ``linear_fc1`` per rank ``[gate_r; up_r]`` into the global ``[gate; up]``, and
replicated ones (norms, row-parallel biases) taken from tensor rank 0. The layers are renumbered
globally by counting the stages before.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from megatron_chimera.checkpoint.megatron_format import (
    MegatronCheckpointError,
    legacy_rank_files,
    load_megatron_file,
)
from megatron_chimera.megatron_lm.names import (
    EXTRA_STATE,
    SPLIT_COLUMNS,
    SPLIT_GATED,
    SPLIT_ROWS,
    layer_name,
    normalise_suffix,
    split_layer_name,
    tensor_split,
)


def merge_tensor_ranks(parts: list[torch.Tensor], split: str) -> torch.Tensor:
    """One tensor from its tensor-rank parts (in rank order) split as ``split``."""
    if split == SPLIT_ROWS:
        return torch.cat(parts, dim=0)
    if split == SPLIT_COLUMNS:
        return torch.cat(parts, dim=1)
    if split == SPLIT_GATED:
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return parts[0]


class LegacyReader:
    """The model tensors of one legacy iteration directory, merged over T x P files."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.files = legacy_rank_files(path)
        self.tensor = 1 + max(t for t, _ in self.files)
        self.pipeline = 1 + max(p for _, p in self.files)

    def _load(self, tensor: int, pipeline: int) -> dict[str, Any]:
        path = self.files[(tensor, pipeline)]
        state = load_megatron_file(path, mmap=True)  # pages read as tensors are merged
        if not isinstance(state, dict):
            raise MegatronCheckpointError(f"{path}: not a Megatron checkpoint (expected a dict)")
        if "model" not in state:
            virtual = sorted(k for k in state if k.startswith("model") and k[5:].isdigit())
            what = (f"a virtual-pipeline checkpoint ({', '.join(virtual)})" if virtual
                    else "no 'model' entry")
            raise MegatronCheckpointError(f"{path}: {what} is not supported")
        return state

    def common(self) -> dict[str, Any]:
        """The first file's non-model entries (``args``, ``iteration``, ``checkpoint_version``)."""
        state = self._load(0, 0)
        return {k: v for k, v in state.items() if k != "model"}

    def _normalised(self, model: dict[str, Any], path: str) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, value in model.items():
            if EXTRA_STATE in name:
                continue
            if not isinstance(value, torch.Tensor):
                raise MegatronCheckpointError(f"{path}: entry {name!r} is a "
                                              f"{type(value).__name__}, not a tensor")
            parsed = split_layer_name(name)
            key = layer_name(parsed[0], normalise_suffix(parsed[1])) if parsed else name
            out[key] = value
        return out

    def iter_model(self, swiglu: bool, tied: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """(normalised global Megatron name, merged tensor), one pipeline stage at a time."""
        offset = 0
        for stage in range(self.pipeline):
            parts = []
            for rank in range(self.tensor):
                path = self.files[(rank, stage)]
                parts.append(self._normalised(self._load(rank, stage)["model"], path))
            names = list(parts[0])
            for rank, part in enumerate(parts[1:], start=1):
                if list(part) != names:
                    raise MegatronCheckpointError(
                        f"{self.files[(rank, stage)]}: holds other tensors than "
                        f"{self.files[(0, stage)]} (ranks of one stage must match)")
            local_layers = {p[0] for n in names if (p := split_layer_name(n))}
            for name in names:
                if name == "output_layer.weight" and tied and stage > 0:
                    continue  # the last stage's copy of the tied word embedding
                merged = merge_tensor_ranks([p[name] for p in parts], tensor_split(name, swiglu))
                parsed = split_layer_name(name)
                yield (layer_name(parsed[0] + offset, parsed[1]) if parsed else name), merged
            offset += len(local_layers)
            del parts

