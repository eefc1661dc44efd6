"""Measured F, B and W times per stage, agreed on by every rank with one all-reduce.

:class:`StageTimeRecorder` is the executor's ``action_timer``: it keeps the compute seconds of
every F, B and W this rank runs (wall clock on CPU, CUDA events on GPU; the executor times only
compute, never a wait for a message) while :attr:`~StageTimeRecorder.recording` is on.
:func:`agree_stage_costs` turns every rank's medians into one :class:`~.costs.StageCosts`: per
(kind, stage), the mean over the ranks that ran it of their median, identical on every rank
(one SUM all-reduce of medians and counts, rounded before use).
"""

from __future__ import annotations

import statistics
from collections import defaultdict

import torch
import torch.distributed as dist

from megatron_chimera.schedules.actions import BACKWARD, FORWARD, KINDS, WEIGHT, Action
from megatron_chimera.schedules.costs import StageCosts


class StageTimeRecorder:
    """Per (kind, stage), the seconds of the actions this rank ran while recording."""

    def __init__(self) -> None:
        self.recording = True
        self.samples: dict[tuple[str, int], list[float]] = defaultdict(list)

    def __call__(self, action: Action, seconds: float) -> None:
        """The executor's hook: one action's compute seconds."""
        if self.recording:
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
