"""A rank's model stages as checkpoints see them: stage slices and global parameter names."""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

_LAYER_KEY = re.compile(r"(^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class StageSlice:
    """One model stage whose weights this rank holds (one module per stage, shared by pipes)."""

    stage: int
    layer_range: tuple[int, int]
    module: nn.Module
    # this rank writes the stage's file: the lowest rank holding its shard (with tensor
    # parallelism every rank of the writing tensor-parallel group joins in; tensor rank 0 writes)
    writer: bool = True


def global_name(local_name: str, layer_start: int) -> str:
    """``...layers.{i}...`` of a stage slice -> ``...layers.{start + i}...`` (global layer)."""
    return _LAYER_KEY.sub(lambda m: f"{m.group(1)}layers.{int(m.group(2)) + layer_start}.",
                          local_name, count=1)


def stage_named_parameters(stage: StageSlice) -> dict[str, nn.Parameter]:
    """The stage module's parameters under their global names."""
    start = stage.layer_range[0]
    return {global_name(n, start): p for n, p in stage.module.named_parameters()}


def shared_embedding_name(stage: StageSlice) -> str | None:
    """Global name of the tied word embedding in this stage slice, or None."""
    shared_fn = getattr(stage.module, "shared_embedding_or_output_weight", None)
    shared = shared_fn() if shared_fn is not None else None
    if shared is None:
        return None
    for name, param in stage_named_parameters(stage).items():
        if param is shared:
            return name
    return None
