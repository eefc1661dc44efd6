"""The lowered expert all-to-all ops of a rank's stages (schedules/expert_ops.py), and the
NCCL-semantics mode's check that the paired runtime issued exactly those, in that order."""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from megatron_chimera.pipeline.failures import PipelineFailure
from megatron_chimera.schedules.expert_ops import ExpertOp, StageLayout


def stage_layout(module: nn.Module, training: bool = True) -> StageLayout | None:
    """The MoE layers of a stage whose all-to-alls run through the paired runtime (the
    ``alltoall`` dispatcher over EP > 1), with their checkpointed regions (full
    recomputation); None when the stage has other expert communication this module cannot
    lay out (emulated stages)."""
    regions: list[int | None] = []
    for sub in module.modules():
        layers = getattr(sub, "layers", None)
        if not (isinstance(layers, nn.ModuleList) and hasattr(sub, "recompute_granularity")):
            continue
        full = training and sub.recompute_granularity == "full"
        for i, layer in enumerate(layers):
            tape_of = getattr(getattr(layer, "mlp", None), "backward_tape", None)
            dispatcher = getattr(getattr(layer, "mlp", None), "dispatcher", None)
            if tape_of is None or dispatcher is None or dispatcher.kind != "alltoall" or (
                    dispatcher.ep_size == 1):
                continue
            region = None
            if full and sub.recompute_method == "uniform":
                region = i // sub.recompute_num_layers
            elif full and i < sub.recompute_num_layers:  # block: one region per layer
                region = i
            regions.append(region)
    if not regions and any(hasattr(m, "set_expert_comm") and not hasattr(m, "backward_tape")
                           for m in module.modules()):
        return None
    return StageLayout(tuple(regions))


def stage_layouts(modules: Mapping[int, nn.Module]) -> dict[int, StageLayout] | None:
    """:func:`stage_layout` of every stage (None if one cannot be laid out)."""
    layouts = {stage: stage_layout(module) for stage, module in modules.items()}
    if any(layout is None for layout in layouts.values()):
        return None
    return {s: layout for s, layout in layouts.items() if layout is not None and layout.regions}


def check_issued(expected: list[ExpertOp], issued: list[str], rank: int) -> None:
    """Raise :class:`PipelineFailure` unless the runtime's labels are the lowered ops."""
    want = [op.short() for op in expected]
    for position, (x, y) in enumerate(zip(want, issued)):
        if x != y:
            raise PipelineFailure(f"rank {rank}: expert all-to-all {position} issued {y}, the "
                                  f"lowered schedule has {x} there")
    if len(want) != len(issued):
        raise PipelineFailure(f"rank {rank}: {len(issued)} expert all-to-alls issued, the "
                              f"lowered schedule has {len(want)}")
