"""Read a legacy Megatron-LM checkpoint (``iter_*/mp_rank_TT[_PPP]/model_optim_rng.pt``).

Each file holds one (tensor rank, pipeline rank)'s part of the model, with the layer numbers
local to its pipeline stage. The reader merges one tensor at a time (each rank's file mapped into
memory again for its part, copied into place and let go before the next): column-parallel
tensors are joined on dim 0 (``linear_qkv``: each rank holds whole query groups; the embedding
and output layer: vocabulary rows), row-parallel ones on dim 1, SwiGLU's ``linear_fc1`` per rank
``[gate_r; up_r]`` into the global ``[gate; up]``, and replicated ones (norms, row-parallel
biases) taken from tensor rank 0. The layers are renumbered globally by counting the stages
before.
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
    REPLICATED,
    SPLIT_COLUMNS,
    SPLIT_GATED,
    layer_name,
    normalise_suffix,
    split_layer_name,
    tensor_split,
)


def merge_part(merged: torch.Tensor, part: torch.Tensor, rank: int, ranks: int,
               split: str) -> None:
    """Copy tensor rank ``rank``'s ``part`` (of ``ranks`` equal parts) into its place in the
    whole tensor ``merged``, split as ``split`` (rows, columns, or per rank ``[gate_r; up_r]``
    into the global ``[gate; up]``)."""
    if split == SPLIT_COLUMNS:
        width = part.shape[1]
        merged.narrow(1, rank * width, width).copy_(part)
    elif split == SPLIT_GATED:
        half = part.shape[0] // 2
        merged.narrow(0, rank * half, half).copy_(part[:half])
        merged.narrow(0, (ranks + rank) * half, half).copy_(part[half:])
    else:
        rows = part.shape[0]
        merged.narrow(0, rank * rows, rows).copy_(part)


class LegacyReader:
    """The model tensors of one legacy iteration directory, merged over T x P files."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.files = legacy_rank_files(path)
        self.tensor = 1 + max(t for t, _ in self.files)
        self.pipeline = 1 + max(p for _, p in self.files)
        self._checked: set[str] = set()  # files whose CRCs were checked

    def _load(self, tensor: int, pipeline: int) -> dict[str, Any]:
        path = self.files[(tensor, pipeline)]
        # memory-mapped: a tensor's pages are read as it is merged and let go with the mapping
        state = load_megatron_file(path, mmap=True, check=path not in self._checked)
        self._checked.add(path)
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

    def _stage_models(self, stage: int) -> list[dict[str, torch.Tensor]]:
        """The normalised model entries of the stage's T files (memory-mapped), checked to
        name the same tensors."""
        parts = [self._normalised(self._load(rank, stage)["model"], self.files[(rank, stage)])
                 for rank in range(self.tensor)]
        names = list(parts[0])
        for rank, part in enumerate(parts[1:], start=1):
            if list(part) != names:
                raise MegatronCheckpointError(
                    f"{self.files[(rank, stage)]}: holds other tensors than "
                    f"{self.files[(0, stage)]} (ranks of one stage must match)")
        return parts

    def _part(self, rank: int, stage: int, name: str) -> torch.Tensor:
        path = self.files[(rank, stage)]
        return self._normalised(self._load(rank, stage)["model"], path)[name]

    def _merged(self, stage: int, name: str, split: str) -> torch.Tensor:
        """The whole tensor ``name`` of ``stage``, one rank's file mapped at a time: each part is
        copied into its place and its pages let go before the next is read."""
        if split == REPLICATED or self.tensor == 1:
            return self._part(0, stage, name)
        merged, first = None, None
        for rank in range(self.tensor):
            part = self._part(rank, stage, name)
            if merged is None:
                if part.dim() < (2 if split == SPLIT_COLUMNS else 1):
                    raise MegatronCheckpointError(
                        f"{self.files[(rank, stage)]}: tensor {name!r} has shape "
                        f"{tuple(part.shape)}, not a {split}-split tensor-parallel part")
                first = tuple(part.shape)
                shape = list(first)
                shape[1 if split == SPLIT_COLUMNS else 0] *= self.tensor
                merged = torch.empty(shape, dtype=part.dtype)
            elif tuple(part.shape) != first:
                raise MegatronCheckpointError(
                    f"{self.files[(rank, stage)]}: tensor {name!r} has shape "
                    f"{tuple(part.shape)}, rank 0's {first} (tensor-parallel parts must match)")
            merge_part(merged, part, rank, self.tensor, split)
            del part
        return merged

    def iter_model(self, swiglu: bool, tied: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """(normalised global Megatron name, merged tensor), one tensor at a time: a rank's file
        is mapped again for each part, so the pages of the parts merged before are let go (a
        conversion holds about the merged tensor and one part)."""
        offset = 0
        for stage in range(self.pipeline):
            names = list(self._stage_models(stage)[0])
            local_layers = {p[0] for n in names if (p := split_layer_name(n))}
            for name in names:
                if name == "output_layer.weight" and tied and stage > 0:
                    continue  # the last stage's copy of the tied word embedding
                merged = self._merged(stage, name, tensor_split(name, swiglu))
                parsed = split_layer_name(name)
                yield (layer_name(parsed[0] + offset, parsed[1]) if parsed else name), merged
                del merged
            offset += len(local_layers)
