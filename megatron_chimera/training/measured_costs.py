"""Profile-guided pieces of the training loop: ``--partition-method time``, the measured-costs
record kept in checkpoints, and what a schedule rebuilt from measured costs logs and saves.

``pretrain`` asks :func:`profiling_for` whether this run profiles its first iterations
(``--profile-iterations``, a split-backward schedule), :func:`resumed_rebuild` whether a resumed
run must repeat the rebuild its checkpoint recorded (same costs, same deterministic rebuild, so
the resumed iterations run the same order), and, once a rebuild is decided,
:func:`profiled_record`, :func:`rebuild_scalars` and :func:`save_profiled_costs` for what is
kept, plotted and written next to the checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch
import torch.distributed as dist

from megatron_chimera.atomic import atomic_write
from megatron_chimera.config import TrainConfig
from megatron_chimera.model.family import ModelFamily
from megatron_chimera.model.partition import partition_layers
from megatron_chimera.pipeline.profile_rebuild import ProfileRebuild
from megatron_chimera.schedules.actions import Schedule
from megatron_chimera.schedules.costs import StageCosts
from megatron_chimera.schedules.rebuild import RebuildReport, rebuild_for_costs

PROFILED_KEY = "profiled_stage_costs"  # in a checkpoint's args: the measured costs, the schedule
PROFILED_COSTS_FILE = "profiled_stage_costs.json"  # next to the checkpoints (``@file`` input)



def schedule_digest(schedule: Schedule) -> str:
    """A short fingerprint of ``schedule``'s orders (which schedule a record was made for)."""
    return hashlib.sha256(schedule.to_json().encode()).hexdigest()[:16]


def time_partition(config: TrainConfig, family: ModelFamily, schedule: Schedule,
                   device: torch.device, verbose: bool) -> list[tuple[int, int]]:
    """``--partition-method time``: time one transformer layer and the extra cost of the first
    (embeddings) and last stage (final norm, LM head, loss) with the real classes on this rank's
    device, average over all ranks (one all-reduce, so every rank splits alike), and balance the
    ranks' total time over the stages each holds (both replicas for Chimera)."""
    from megatron_chimera.tuning.costs import ModelSpec
    from megatron_chimera.tuning.profile import MeasuredCompute

    compute = MeasuredCompute(ModelSpec(config.model, family), device=str(device))
    layer, first, last = compute.measure(config.training.micro_batch_size)
    recompute = config.model.recompute_granularity == "full"  # the backward re-runs the forward
    seconds = [t.forward * (2 if recompute else 1) + t.backward for t in (layer, first, last)]
    times = torch.tensor(seconds, dtype=torch.float64, device=device)
    dist.all_reduce(times)
    unit = float(times[0]) / dist.get_world_size()
    layer_s, first_s, last_s = (round(float(t) / dist.get_world_size() / unit, 3)
                                for t in times)
    rank_stages = [schedule.stages_of_rank(r) for r in range(schedule.num_ranks)]
    partition = partition_layers(config.model.num_layers, schedule.num_stages, "time",
                                 layer_times=[layer_s] * config.model.num_layers,
                                 embedding_time=first_s, head_time=last_s,
                                 rank_stages=rank_stages)
    if verbose:
        print(f" --partition-method time: layer {unit * 1e3:.3g} ms (forward + backward per "
              f"micro-batch), first stage +{first_s:.3g} layers, last stage +{last_s:.3g} "
              f"layers -> layers per stage {[end - start for start, end in partition]}",
              flush=True)
    return partition


def profiling_for(config: TrainConfig, schedule: Schedule, device: torch.device,
                  verbose: bool) -> ProfileRebuild | None:
    """The profiler of ``--profile-iterations`` for ``schedule``; None when not asked for, or
    when the schedule runs the whole backward (nothing to rebuild: said once when ``verbose``)."""
    iterations = config.training.profile_iterations
    if not iterations:
        return None
    if not schedule.split_backward:
        if verbose:
            print(f" --profile-iterations {iterations}: {schedule.name} runs the whole "
                  f"backward, nothing to rebuild", flush=True)
        return None
    options = config.parallel.schedule_options
    return ProfileRebuild(schedule, options, iterations, device,
                          getattr(options, "fallback", None))


def resumed_rebuild(profile: ProfileRebuild | None, schedule: Schedule,
                    saved_args: dict[str, Any], finetune: bool, verbose: bool,
                    ) -> RebuildReport | None:
    """A resume after the profiling window: the rebuild the saved run made, from the costs its
    checkpoint recorded for this very schedule (None when there is nothing to repeat)."""
    record = saved_args.get(PROFILED_KEY)
    if (profile is None or not record or finetune
            or record.get("schedule") != schedule_digest(schedule)):
        return None
    if verbose:
        print(" resuming with the per-stage costs measured before the checkpoint (no "
              "profiling)", flush=True)
    return rebuild_for_costs(schedule, profile.options, StageCosts.from_dict(record["costs"]),
                             profile.policy)


def profiled_record(report: RebuildReport) -> dict[str, Any]:
    """What checkpoints keep of a rebuild (under :data:`PROFILED_KEY`): the measured costs and
    the schedule they were measured on."""
    return {"costs": report.costs.to_dict(), "schedule": schedule_digest(report.before.schedule)}


def rebuild_scalars(report: RebuildReport) -> dict[str, float]:
    """TensorBoard scalars of a rebuild: predicted iteration before and after, the gain, whether
    it changed the order or fell back to the unsplit schedule, and every measured cost."""
    costs = report.costs
    scalars = {"schedule-predicted-iteration-before": report.before.makespan,
               "schedule-predicted-iteration-after": report.decision.chosen.makespan,
               "schedule-predicted-gain": report.predicted_gain,
               "schedule-rebuilt": float(report.changed),
               "schedule-unsplit-fallback": float(report.decision.fell_back)}
    for kind, values in (("F", costs.forward), ("B", costs.backward), ("W", costs.weight)):
        scalars.update({f"profiled-{kind}-stage{s}": v for s, v in enumerate(values)})
    return scalars


def save_profiled_costs(save_dir: str, costs: StageCosts) -> None:
    """Write the measured costs to ``<save_dir>/profiled_stage_costs.json`` (atomically), the
    input of ``--chimera-zb-costs @file``."""
    os.makedirs(save_dir, exist_ok=True)
    atomic_write(os.path.join(save_dir, PROFILED_COSTS_FILE),
                 lambda handle: json.dump(costs.to_dict(), handle, indent=1), mode="w")
