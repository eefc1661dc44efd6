"""The start-up block rank 0 prints once (as Megatron prints its arguments): the layout, the
schedule and the settings a user wants to see took effect, in a few lines."""

from __future__ import annotations

from megatron_chimera.config import TrainConfig
from megatron_chimera.schedules.actions import Schedule


def startup_block(config: TrainConfig, schedule: Schedule, world_size: int,
                  predicted_bubble: float | None) -> list[str]:
    """The lines of the start-up block: world = T x CP x D x W, the expert groups, the schedule
    with its pipes and micro-batches, the predicted bubble, slices, precision, recomputation and
    the optimizer's sharding."""
    parallel, model = config.parallel, config.model
    layout = parallel.layout
    lines = [f" layout: world {world_size} = T {layout.tensor} x CP {layout.context} x "
             f"D {layout.pipeline} x W {layout.data} (tensor x context x pipeline x "
             "data-parallel)"]
    if model.moe.enabled:
        lines.append(f" experts: {model.moe.num_experts} (top-{model.moe.moe_router_topk}), "
                     f"EP {layout.expert} x expert-data {layout.expert_data} per pipeline rank")
    bubble = f", predicted bubble {predicted_bubble:.2f}" if predicted_bubble is not None else ""
    lines.append(f" schedule: {schedule.name}, {schedule.num_pipes} pipe"
                 f"{'s' if schedule.num_pipes != 1 else ''}, N = {schedule.num_microbatches} "
                 f"micro-batches of {config.training.micro_batch_size} per iteration"
                 f"{bubble} ({schedule.describe()})")
    slices = parallel.pipeline_sequence_slices
    recompute = model.recompute_granularity or "off"
    if model.recompute_method is not None:
        recompute += f" ({model.recompute_method}, {model.recompute_num_layers} layers)"
    lines.append(f" settings: precision {model.params_dtype}, sequence slices {slices}, "
                 f"recomputation {recompute}, distributed optimizer "
                 f"{'on' if config.ddp.use_distributed_optimizer else 'off'}"
                 f"{', sequence parallel' if model.sequence_parallel else ''}")
    return lines
