"""Pipeline schedules as data (the IR): actions, generators, registry, validator, simulator, plots.

Torch-free: importing this package never imports torch. ``build_schedule(name, D, N, **options)``
and the :mod:`.registry` (one :class:`~.registry.ScheduleSpec` per ``--pipeline-schedule`` name,
with its typed options and flags) are the entry points.
"""

from __future__ import annotations

from megatron_chimera.schedules.actions import BACKWARD, FORWARD, WEIGHT, Action, Schedule
from megatron_chimera.schedules.registry import (
    SCHEDULE_NAMES,
    SCHEDULES,
    ScheduleSpec,
    build_schedule,
    get_spec,
)

__all__ = [
    "Action", "Schedule", "FORWARD", "BACKWARD", "WEIGHT", "build_schedule", "get_spec",
    "SCHEDULE_NAMES", "SCHEDULES", "ScheduleSpec",
]
