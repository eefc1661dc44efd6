"""Profile-guided rebuild of a running split-backward schedule: the runtime half (the torch-free
rebuild and the trace reader are :mod:`megatron_chimera.schedules.measured`; timing the model
classes offline is :mod:`megatron_chimera.tuning.profile`).

* :class:`StageTimeRecorder` is the executor's ``action_timer``: it keeps the compute seconds of
  every F, B and W this rank runs (wall clock on CPU, CUDA events on GPU; the executor times only
  compute, never a wait for a message) while :attr:`~StageTimeRecorder.recording` is on.
* :func:`agree_stage_costs` turns every rank's medians into one :class:`StageCosts`: per (kind,
  stage), the mean over the ranks that ran it of their median, identical on every rank (one SUM
  all-reduce of medians and counts, rounded before use).
* :class:`ProfileRebuild` is the window of ``--profile-iterations``: during the first
  ``iterations`` iterations of this process it sets a recorder as the executor's
  ``action_timer`` (the first of them is a warm-up and not recorded when there are two or more);
  after the last one every rank agrees on the measured costs and rebuilds the schedule from them
  (:func:`~megatron_chimera.schedules.measured.rebuild_for_costs`: same inputs on every rank, so
  the same, validated schedule; never slower than the unsplit schedules on the same placement).
  A message time given with ``--chimera-zb-costs "...;p2p=T"`` is kept, in the measured unit
  (:meth:`~megatron_chimera.schedules.costs.StageCosts.with_message_time_of`).
* :func:`profiling_for` says whether a run profiles (a split-backward schedule),
  :func:`resumed_rebuild` whether a resumed run must repeat the rebuild its checkpoint recorded
  (same costs, same deterministic rebuild, so the resumed iterations run the same order), and
  :func:`profiled_record`, :func:`rebuild_scalars` and :func:`save_profiled_costs` what is kept
  in checkpoints, plotted and written next to them once a rebuild is decided.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from megatron_chimera.atomic import atomic_write
from megatron_chimera.config import TrainConfig
from megatron_chimera.pipeline.executor import PipelineExecutor
from megatron_chimera.schedules.actions import BACKWARD, FORWARD, KINDS, WEIGHT, Action, Schedule
from megatron_chimera.schedules.costs import StageCosts
from megatron_chimera.schedules.measured import RebuildReport, rebuild_for_costs

PROFILED_KEY = "profiled_stage_costs"  # in a checkpoint's args: the measured costs, the schedule
PROFILED_COSTS_FILE = "profiled_stage_costs.json"  # next to the checkpoints (``@file`` input)


class StageTimeRecorder:
    """Per (kind, stage), the seconds of the actions this rank ran while recording. For a sliced
    schedule (``slice_work``: each slice's share of its sequence's work) a slice's seconds are
    divided by its share: the samples are whole-sequence costs, as the sliced generator and the
    simulator take them."""

    def __init__(self, slice_work: list[float] | None = None) -> None:
        self.recording = True
        self.samples: dict[tuple[str, int], list[float]] = defaultdict(list)
        self.slice_work = slice_work

    def __call__(self, action: Action, seconds: float) -> None:
        """The executor's hook: one action's compute seconds."""
        if self.recording:
            if self.slice_work:
                seconds /= self.slice_work[action.microbatch % len(self.slice_work)]
            self.samples[(action.kind, action.stage)].append(seconds)

    def medians(self) -> dict[tuple[str, int], float]:
        """The median seconds per (kind, stage) this rank recorded."""
        return {key: statistics.median(values) for key, values in self.samples.items() if values}


def agree_stage_costs(recorder: StageTimeRecorder, num_stages: int,
                      device: torch.device | str = "cpu",
                      group: dist.ProcessGroup | None = None) -> StageCosts:
    """Every rank's medians averaged over the ranks that ran each (kind, stage): the same
    :class:`StageCosts` (seconds, p2p 0) on every rank of ``group``. Collective.

    Raises RuntimeError naming what no rank measured (a split-backward schedule runs every F,
    B and W of every stage somewhere, so this means nothing was recorded).
    """
    table = torch.zeros(len(KINDS), num_stages, 2, dtype=torch.float64, device=device)
    for (kind, stage), median in recorder.medians().items():
        table[KINDS.index(kind), stage, 0] = median
        table[KINDS.index(kind), stage, 1] = 1.0
    dist.all_reduce(table, group=group)
    table = table.cpu()
    missing = [f"{kind}{stage}" for k, kind in enumerate(KINDS) for stage in range(num_stages)
               if table[k, stage, 1] == 0]
    if missing:
        raise RuntimeError(f"profiling measured no time for {', '.join(missing)}: run at least "
                           f"one split-backward iteration while recording")
    mean = (table[..., 0] / table[..., 1]).tolist()
    costs = StageCosts(tuple(mean[KINDS.index(FORWARD)]), tuple(mean[KINDS.index(BACKWARD)]),
                       tuple(mean[KINDS.index(WEIGHT)]))
    return costs.rounded()


class ProfileRebuild:
    """The profiling window of one run and the rebuild at its end."""

    def __init__(self, schedule: Schedule, options: Any, iterations: int,
                 device: torch.device | str = "cpu", policy: str | None = None) -> None:
        if iterations < 1:
            raise ValueError(f"--profile-iterations must be >= 1 to profile, got {iterations}")
        if not schedule.split_backward:
            raise ValueError(f"{schedule.name} does not split the backward: nothing to profile")
        self.schedule = schedule
        self.options = options
        self.iterations = iterations
        self.device = device
        self.policy = policy
        self.recorder = StageTimeRecorder(schedule.meta.get("slice_work")
                                          if schedule.sequence_slices > 1 else None)
        self.started = 0  # iterations of this process that began under the profiler

    @property
    def active(self) -> bool:
        """Whether iterations remain to profile (or the rebuild is still due)."""
        return self.started < self.iterations

    def start_iteration(self, executor: PipelineExecutor) -> None:
        """Before an iteration: time it (the first of several is a warm-up, not recorded)."""
        if not self.active:
            return
        self.started += 1
        self.recorder.recording = self.started > 1 or self.iterations == 1
        executor.action_timer = self.recorder

    def finish_iteration(self, executor: PipelineExecutor) -> RebuildReport | None:
        """After an iteration: at the end of the window, agree on the costs and rebuild
        (collective on every rank of the default group); else None."""
        if self.started != self.iterations or executor.action_timer is None:
            return None
        executor.action_timer = None
        costs = agree_stage_costs(self.recorder, self.schedule.num_stages, self.device)
        costs = costs.with_message_time_of(getattr(self.options, "costs", None))
        return rebuild_for_costs(self.schedule, self.options, costs, self.policy)


def schedule_digest(schedule: Schedule) -> str:
    """A short fingerprint of ``schedule``'s orders (which schedule a record was made for)."""
    return hashlib.sha256(schedule.to_json().encode()).hexdigest()[:16]


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
