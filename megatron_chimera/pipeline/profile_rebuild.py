"""Profile the first iterations of a split-backward run, then rebuild its schedule for them.

:class:`ProfileRebuild` drives it from the training loop: during the first ``iterations``
iterations of this process it sets a :class:`~.profiler.StageTimeRecorder` as the executor's
``action_timer`` (the first of them is a warm-up and not recorded when there are two or more);
after the last one every rank agrees on the measured per-stage F, B, W times (one all-reduce,
:func:`~.profiler.agree_stage_costs`) and rebuilds the schedule from them
(:func:`~megatron_chimera.schedules.rebuild.rebuild_for_costs`: same inputs on every rank, so
the same, validated schedule; never slower than the unsplit schedules on the same placement). A
message time given with ``--chimera-zb-costs "...;p2p=T"`` is kept, in the measured unit
(:meth:`~megatron_chimera.schedules.costs.StageCosts.with_message_time_of`).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_chimera.pipeline.executor import PipelineExecutor
from megatron_chimera.pipeline.profiler import StageTimeRecorder, agree_stage_costs
from megatron_chimera.schedules.actions import Schedule
from megatron_chimera.schedules.rebuild import RebuildReport, rebuild_for_costs


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
        self.recorder = StageTimeRecorder()
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
