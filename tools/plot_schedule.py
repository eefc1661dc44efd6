#!/usr/bin/env python
"""Simulate one pipeline schedule and draw it: PNG Gantt chart, text chart, JSON timeline.

Example::

    python tools/plot_schedule.py --pipeline-schedule chimera --pipeline-model-parallel-size 8 \\
        --num-microbatches 32 --forward-cost 1 --backward-cost 2 --out c.png --json c.json

Costs are relative times of one micro-batch through one stage; ``--backward-cost`` is the whole
backward, of which ``--weight-cost`` is the weight-gradient part (0 = no B/W split; only
schedules that split the backward, e.g. chimera-zb and zb-h1, use it). The text chart goes to
stdout; ``--json`` writes ``{"makespan", "bubble_ratio", "peak_inflight": {rank: int},
"events": [...], ...}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_chimera.schedules import (  # noqa: E402
    SCHEDULE_NAMES,
    Schedule,
    applicable_options,
    build_schedule,
)
from megatron_chimera.schedules.chimera import CONCAT_NAMES  # noqa: E402
from megatron_chimera.schedules.plot import write_atomically  # noqa: E402
from megatron_chimera.schedules.simulate import CostModel  # noqa: E402

# flag name -> generator keyword
SCHEDULE_FLAGS = {
    "--chimera-pipes": "pipes",
    "--chimera-concat": "concat",
    "--virtual-pipeline-size": "virtual_pipeline_size",
}


def add_schedule_arguments(parser: argparse.ArgumentParser) -> None:
    """Sizes, schedule options and costs shared by plot_schedule.py and compare_schedules.py."""
    parser.add_argument("--pipeline-model-parallel-size", "-D", type=int, default=8,
                        help="pipeline ranks D (default 8)")
    parser.add_argument("--num-microbatches", "-N", type=int, default=None,
                        help="micro-batches per iteration N (default D)")
    parser.add_argument("--chimera-pipes", type=int, default=None,
                        help="2f pipes for Chimera (default 2)")
    parser.add_argument("--chimera-concat", choices=CONCAT_NAMES, default=None,
                        help="Chimera's concatenation of basic units for N > D "
                             "(default slot-merge)")
    parser.add_argument("--virtual-pipeline-size", type=int, default=None,
                        help="model chunks per rank for the interleaved schedule (default 2)")
    parser.add_argument("--forward-cost", type=float, default=1.0)
    parser.add_argument("--backward-cost", type=float, default=2.0,
                        help="whole backward (input + weight gradients)")
    parser.add_argument("--weight-cost", type=float, default=0.0,
                        help="weight-gradient part of the backward (0 = no B/W split)")


def check_costs(args: argparse.Namespace) -> None:
    """Reject cost flags the simulator cannot use."""
    if args.forward_cost <= 0 or args.backward_cost <= 0:
        raise ValueError("--forward-cost and --backward-cost must be positive")
    if not 0 <= args.weight_cost < args.backward_cost:
        raise ValueError(
            f"--weight-cost must lie in [0, --backward-cost), got {args.weight_cost}"
        )


def cost_model(args: argparse.Namespace, schedule: Schedule) -> CostModel:
    """The simulator's costs (no communication cost) for ``schedule``.

    The flags give the time of one micro-batch through one of D equal stages; a schedule with
    more, smaller stages (interleaved: D*v chunks) gets proportionally less per stage.
    """
    check_costs(args)
    scale = schedule.num_ranks / schedule.num_stages
    return CostModel(
        args.forward_cost * scale, args.backward_cost * scale, args.weight_cost * scale
    )


def schedule_options(args: argparse.Namespace) -> dict[str, Any]:
    """Every generator keyword the flags set (None where a flag was not given)."""
    options: dict[str, Any] = {kw: getattr(args, flag[2:].replace("-", "_"))
                               for flag, kw in SCHEDULE_FLAGS.items()}
    if args.weight_cost > 0:  # split-backward generators optimise for these relative times
        options["costs"] = (
            args.forward_cost, args.backward_cost - args.weight_cost, args.weight_cost
        )
    return options


def make_schedule(name: str, args: argparse.Namespace, strict: bool) -> Schedule:
    """Build schedule ``name`` from the flags; ``strict`` rejects flags that do not apply."""
    options = schedule_options(args)
    usable = applicable_options(name, **options)
    if strict:
        for flag, kw in SCHEDULE_FLAGS.items():
            given = getattr(args, flag[2:].replace("-", "_"))
            if given is not None and kw not in usable:
                raise ValueError(f"{flag} does not apply to --pipeline-schedule {name}")
    D = args.pipeline_model_parallel_size
    N = args.num_microbatches if args.num_microbatches is not None else D
    schedule = build_schedule(name, D, N, **usable)
    if schedule.split_backward and args.weight_cost <= 0:
        raise ValueError(
            f"--weight-cost must be > 0 for {name}, which splits each backward into B and W"
        )
    return schedule


def write_json(path: str, data: Any) -> None:
    """Write ``data`` as JSON atomically (temp file in the same directory + rename)."""
    write_atomically(path, lambda handle: json.dump(data, handle, indent=1), mode="w")


def main(argv: list[str] | None = None) -> int:
    """Parse flags, build, validate and simulate the schedule, then write the outputs."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pipeline-schedule", choices=SCHEDULE_NAMES, default="chimera")
    add_schedule_arguments(parser)
    parser.add_argument("--out", default=None, help="PNG file for the Gantt chart")
    parser.add_argument("--json", default=None, help="JSON file for the simulated timeline")
    parser.add_argument("--no-text", action="store_true", help="do not print the text chart")
    args = parser.parse_args(argv)

    from megatron_chimera.schedules.plot import plot_schedule, text_chart
    from megatron_chimera.schedules.simulate import simulate
    from megatron_chimera.schedules.validate import validate

    try:
        check_costs(args)
        schedule = make_schedule(args.pipeline_schedule, args, strict=True)
        validate(schedule)
        result = simulate(schedule, cost_model(args, schedule))
    except ValueError as exc:  # ScheduleError is a ValueError too
        parser.error(str(exc))
    if not args.no_text:
        print(text_chart(schedule, result))
    if args.out:
        plot_schedule(schedule, result, args.out)
        print(f"wrote {args.out}")
    if args.json:
        data = result.to_dict()
        data["schedule_data"] = schedule.to_dict()
        write_json(args.json, data)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
