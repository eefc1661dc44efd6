"""Pipeline schedules as data: generators, validator, simulator, plotter and executor.

``build_schedule(name, num_ranks, num_microbatches, **options)`` is the one entry point that maps a
``--pipeline-schedule`` name to its generator; ``SCHEDULE_GENERATORS`` is the name -> generator
table (add a new schedule by adding an entry there).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from .actions import BACKWARD, FORWARD, WEIGHT, Action, Schedule
from .chimera import chimera
from .gpipe import gpipe
from .interleaved import interleaved
from .one_f_one_b import one_f_one_b
from .zero_bubble import chimera_zb, zb_h1

SCHEDULE_GENERATORS: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "chimera": chimera,
    "chimera-zb": chimera_zb,
    "zb-h1": zb_h1,
}
SCHEDULE_NAMES = tuple(SCHEDULE_GENERATORS)


def build_schedule(name: str, num_ranks: int, num_microbatches: int, **options: Any) -> Schedule:
    """Generate the ``--pipeline-schedule`` called ``name`` for D ranks and N micro-batches."""
    try:
        generator = SCHEDULE_GENERATORS[name]
    except KeyError:
        raise ValueError(
            f"--pipeline-schedule: unknown schedule {name!r}; choose from {SCHEDULE_NAMES}"
        ) from None
    if name == "chimera" and options.get("split_backward"):
        # --chimera-split-backward means the Chimera-ZB order, whose W actions fill the bubbles
        generator = chimera_zb
    return generator(num_ranks, num_microbatches, **options)


def applicable_options(name: str, **options: Any) -> dict[str, Any]:
    """The ``options`` (None values dropped) that the generator of schedule ``name`` accepts.

    Lets tools pass one set of flags (pipes, concat, virtual_pipeline_size, ...) to every schedule.
    """
    if name not in SCHEDULE_GENERATORS:
        raise ValueError(
            f"--pipeline-schedule: unknown schedule {name!r}; choose from {SCHEDULE_NAMES}"
        )
    accepted = inspect.signature(SCHEDULE_GENERATORS[name]).parameters
    return {k: v for k, v in options.items() if v is not None and k in accepted}


__all__ = [
    "Action", "Schedule", "FORWARD", "BACKWARD", "WEIGHT", "build_schedule", "SCHEDULE_NAMES",
    "SCHEDULE_GENERATORS", "applicable_options", "chimera", "gpipe", "interleaved", "one_f_one_b",
    "chimera_zb", "zb_h1",
]
