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

``--measured TRACE`` (a ``--pipeline-trace`` file of a training run) draws the measured timeline
of its first traced iteration beside the simulated timeline of the same schedule, simulated with
the per-stage F/B/W times measured there (milliseconds; no communication): text charts one above
the other, and with ``--out`` a second PNG ``<out>-measured.png``. The schedule flags are then
ignored (the trace holds its schedule).
"""

from __future__ import annotations

import json
from typing import Any

from megatron_chimera.atomic import atomic_write
from megatron_chimera.errors import ToolArgumentParser, run_tool
from megatron_chimera.schedules.cli import (
    add_size_and_cost_arguments,
    check_costs,
    cost_model,
    schedule_from_args,
)
from megatron_chimera.schedules.measured import measured_costs, measured_result, trace_schedule
from megatron_chimera.schedules.plot import plot_schedule, text_chart
from megatron_chimera.schedules.registry import add_schedule_arguments, schedule_name_from
from megatron_chimera.schedules.simulate import simulate
from megatron_chimera.schedules.validate import validate


def write_json(path: str, data: Any) -> None:
    """Write ``data`` as JSON atomically (temp file in the same directory + rename)."""
    atomic_write(path, lambda handle: json.dump(data, handle, indent=1), mode="w")


def main(argv: list[str] | None = None) -> int:
    """Parse flags, build, validate and simulate the schedule, then write the outputs."""
    parser = ToolArgumentParser(description=__doc__.split("\n")[0])
    add_schedule_arguments(parser, default_schedule="chimera")
    add_size_and_cost_arguments(parser)
    parser.add_argument("--out", default=None, help="PNG file for the Gantt chart")
    parser.add_argument("--json", default=None, help="JSON file for the simulated timeline")
    parser.add_argument("--no-text", action="store_true", help="do not print the text chart")
    parser.add_argument("--measured", default=None, metavar="TRACE",
                        help="a --pipeline-trace file: draw its measured timeline beside the "
                             "simulated one of the same schedule and measured stage costs")
    args = parser.parse_args(argv)
    if args.measured:
        return draw_measured(args.measured, args.out, args.no_text)

    try:
        check_costs(args)
        schedule = schedule_from_args(schedule_name_from(args), args, strict=True)
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


def draw_measured(path: str, out: str | None, no_text: bool) -> int:
    """The measured timeline of trace ``path`` beside its schedule simulated with the measured
    per-stage costs (text charts; PNGs ``out`` and ``<out>-measured.png``)."""
    with open(path, encoding="utf-8") as handle:
        trace = json.load(handle)
    schedule = trace_schedule(trace)
    simulated = simulate(schedule, measured_costs(trace))
    measured = measured_result(trace)
    if not no_text:
        print("simulated with the measured stage costs (ms):")
        print(text_chart(schedule, simulated))
        print("measured (ms):")
        print(text_chart(schedule, measured))
    if out:
        second = out[:-4] + "-measured.png" if out.endswith(".png") else out + "-measured.png"
        plot_schedule(schedule, simulated, out)
        plot_schedule(schedule, measured, second)
        print(f"wrote {out} and {second}")
    return 0


if __name__ == "__main__":
    run_tool(main)
