"""Pipeline schedules as data: generators, validator, simulator, plotter and executor.

``build_schedule(name, num_ranks, num_microbatches, **options)`` is the one entry point that maps a
``--pipeline-schedule`` name to its generator.
"""

from __future__ import annotations

from typing import Any

from .actions import BACKWARD, FORWARD, WEIGHT, Action, Schedule
from .gpipe import gpipe
from .one_f_one_b import one_f_one_b

SCHEDULE_NAMES = ("gpipe", "1f1b")


def build_schedule(name: str, num_ranks: int, num_microbatches: int, **options: Any) -> Schedule:
    """Generate the schedule called ``name`` (a ``--pipeline-schedule`` value) for D ranks and N micro-batches."""
    if name == "gpipe":
        return gpipe(num_ranks, num_microbatches, **options)
    if name == "1f1b":
        return one_f_one_b(num_ranks, num_microbatches, **options)
    raise ValueError(f"--pipeline-schedule: unknown schedule {name!r}; choose from {SCHEDULE_NAMES}")


__all__ = [
    "Action", "Schedule", "FORWARD", "BACKWARD", "WEIGHT", "build_schedule", "SCHEDULE_NAMES",
    "gpipe", "one_f_one_b",
]
