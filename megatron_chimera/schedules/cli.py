"""Command-line pieces the schedule tools share: sizes and cost flags, schedule and cost model.

``tools/plot_schedule.py``, ``tools/compare_schedules.py`` and ``tools/chimera_playground.py``
take the registry's schedule flags (:func:`~.registry.add_schedule_arguments`) plus D, N and
relative costs (:func:`add_size_and_cost_arguments`); :func:`schedule_from_args` and
:func:`cost_model` turn them into a schedule and the simulator's cost model.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from megatron_chimera.schedules.actions import Schedule
from megatron_chimera.schedules.registry import ScheduleSpec, get_spec
from megatron_chimera.schedules.simulate import CostModel


def add_size_and_cost_arguments(parser: argparse.ArgumentParser | Any, default_ranks: int = 8,
                                default_microbatches: int | None = None) -> None:
    """``-D``, ``-N`` and the relative F / B / W costs of one micro-batch through one stage."""
    parser.add_argument("--pipeline-model-parallel-size", "-D", type=int, default=default_ranks,
                        help=f"pipeline ranks D (default {default_ranks})")
    parser.add_argument("--num-microbatches", "-N", type=int, default=default_microbatches,
                        help="micro-batches per iteration N (default "
                             f"{default_microbatches or 'D'})")
    parser.add_argument("--forward-cost", type=float, default=1.0)
    parser.add_argument("--backward-cost", type=float, default=2.0,
                        help="whole backward (input + weight gradients)")
    parser.add_argument("--weight-cost", type=float, default=0.0,
                        help="weight-gradient part of the backward (0 = no B/W split)")


def check_costs(args: Any) -> None:
    """Reject cost flags the simulator cannot use (ValueError naming the flag)."""
    if args.forward_cost <= 0 or args.backward_cost <= 0:
        raise ValueError("--forward-cost and --backward-cost must be positive")
    if not 0 <= args.weight_cost < args.backward_cost:
        raise ValueError(f"--weight-cost must lie in [0, --backward-cost), got {args.weight_cost}")


def sizes(args: Any) -> tuple[int, int]:
    """(D, N) of the flags; N defaults to D."""
    d = args.pipeline_model_parallel_size
    n = args.num_microbatches if args.num_microbatches is not None else d
    if d < 1 or n < 1:
        raise ValueError("--pipeline-model-parallel-size and --num-microbatches must be positive")
    return d, n


def cost_model(args: Any, schedule: Schedule) -> CostModel:
    """The simulator's costs (no communication) for ``schedule``: the flags give one micro-batch
    through one of D equal stages, so a schedule with more, smaller stages (interleaved: D*v
    chunks) gets proportionally less per stage."""
    check_costs(args)
    scale = schedule.num_ranks / schedule.num_stages
    return CostModel(args.forward_cost * scale, args.backward_cost * scale,
                     args.weight_cost * scale)


def options_for(spec: ScheduleSpec, args: Any, strict: bool) -> Any:
    """The spec's options from the flags; a split-backward generator with no costs of its own
    is built for the simulated F, B, W costs when ``--weight-cost`` is set."""
    options = spec.options_from(args, strict=strict)
    if getattr(options, "costs", "absent") is None and args.weight_cost > 0:
        costs = (args.forward_cost, args.backward_cost - args.weight_cost, args.weight_cost)
        options = replace(options, costs=costs)
    return options


def schedule_from_args(name: str, args: Any, strict: bool, options: Any = None) -> Schedule:
    """Build schedule ``name`` from the flags (``strict``: reject flags that do not apply)."""
    spec = get_spec(name)
    options = options_for(spec, args, strict) if options is None else options
    d, n = sizes(args)
    schedule = spec.build(d, n, options)
    if schedule.split_backward and args.weight_cost <= 0:
        raise ValueError(
            f"--weight-cost must be > 0 for {name}, which splits each backward into B and W"
        )
    return schedule
