#!/usr/bin/env python
"""Compare every pipeline schedule at one size: makespan, bubble ratio, memory, weight copies.

Example::

    python tools/compare_schedules.py -D 8 -N 32 --forward-cost 1 --backward-cost 2

Every name of ``--pipeline-schedule`` is simulated (Chimera once per concatenation that applies,
unless ``--chimera-concat`` picks one); the schedule flags apply to the schedules that take them.
A schedule that cannot run at these sizes is listed with the reason. ``--json PATH`` writes the
rows as a list of objects.
"""

from __future__ import annotations

import json

from megatron_chimera.atomic import atomic_write
from megatron_chimera.errors import ToolArgumentParser, run_tool
from megatron_chimera.schedules.cli import add_size_and_cost_arguments, check_costs, sizes
from megatron_chimera.schedules.compare import compare, format_table
from megatron_chimera.schedules.registry import SCHEDULE_NAMES, add_schedule_arguments


def main(argv: list[str] | None = None) -> int:
    """Parse flags, compare the schedules, print the table and optionally write JSON."""
    parser = ToolArgumentParser(description=__doc__.split("\n")[0])
    add_size_and_cost_arguments(parser)
    add_schedule_arguments(parser)
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULE_NAMES, default=None,
                        help="subset of schedules to compare (default: all)")
    parser.add_argument("--json", default=None, help="write the rows to this JSON file")
    args = parser.parse_args(argv)
    if args.pipeline_schedule is not None or args.chimera_split_backward:
        parser.error("choose schedules with --schedules (every schedule is compared)")
    try:
        check_costs(args)
        D, N = sizes(args)
    except ValueError as exc:
        parser.error(str(exc))
    print(f"D={D} N={N} forward={args.forward_cost:g} backward={args.backward_cost:g} "
          f"weight={args.weight_cost:g}")
    rows = compare(args, args.schedules)
    print(format_table(rows))
    if args.json:
        atomic_write(args.json, lambda handle: json.dump(rows, handle, indent=1), mode="w")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    run_tool(main)
