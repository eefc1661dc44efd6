#!/usr/bin/env python
"""Compare every pipeline schedule at one size: makespan, bubble ratio, memory, weight copies.

Example::

    python tools/compare_schedules.py -D 8 -N 32 --forward-cost 1 --backward-cost 2

Every name of ``--pipeline-schedule`` is simulated (Chimera once per concatenation that applies,
unless ``--chimera-concat`` picks one); the schedule flags apply to the schedules that take them.
A schedule that cannot run at these sizes is listed with the reason. ``--json PATH`` writes the
rows as a list of objects.

``--cost-grid`` instead prints the cost grid (``megatron_chimera/schedules/cost_grid.py``): for
B/F in {0.5, 1, 1.5, 2} x W/B in {0.25, 0.5, 1}, the makespan of Chimera-ZB built for 1:1:1,
for measured costs (the true ones off by up to ``--measurement-noise``) and for the true costs,
of ZB-H1, 1F1B and Chimera, the lower bound, and the schedule the framework would choose::

    python tools/compare_schedules.py -D 8 -N 32 --cost-grid --json grid.json

``--anchor-table`` prints issue 30's table (``megatron_chimera/schedules/anchor_table.py``): D=8,
N in {8, 32}, F:B:W in {1:1:1, 1:2:1, 1:1.5:0.5}, activation caps {8, 5}, every schedule (the
split-backward ones built for each cost and cap), beside the anchors' published figures, once
with free point-to-point messages and once at 0.1 F per message::

    python tools/compare_schedules.py --anchor-table --json anchors.json

``--moe-table`` prints issue 41's table (``megatron_chimera/schedules/compare.py: moe_table``):
MoE expert parallelism at -D, -N (default 8, 32), F:B:W = 1:1:1 per stage and an all-to-all of
``--all-to-all-cost`` (default 1 = the forward: DeepSeek's 1:1) per stage and direction; 1F1B,
interleaved, Chimera(-ZB) and BitPipe(-ZB) without and with ``--overlap-moe-expert-parallel-comm``
beside DualPipe, DualPipeV and Megatron's combined 1F1B: makespan and exposed all-to-all::

    python tools/compare_schedules.py --moe-table -D 8 -N 32
"""

from __future__ import annotations

import argparse
import json

from megatron_chimera.atomic import atomic_write
from megatron_chimera.errors import ToolArgumentParser, run_tool
from megatron_chimera.schedules.anchor_table import anchor_table, format_rows
from megatron_chimera.schedules.cli import add_size_and_cost_arguments, check_costs, sizes
from megatron_chimera.schedules.compare import compare, format_moe_table, format_table, moe_table
from megatron_chimera.schedules.cost_grid import cost_grid, format_grid
from megatron_chimera.schedules.costs import StageCosts
from megatron_chimera.schedules.registry import SCHEDULE_NAMES, add_schedule_arguments

COST_FLAGS = {"forward_cost": 1.0, "backward_cost": 2.0, "weight_cost": 0.0}


def run_cost_grid(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``--cost-grid``: print (and write) the grid at -D, -N, --chimera-pipes."""
    given = [f"--{k.replace('_', '-')}" for k, v in COST_FLAGS.items() if getattr(args, k) != v]
    others = [f for f, v in (("--schedules", args.schedules),
                             ("--chimera-concat", args.chimera_concat),
                             ("--chimera-max-inflight", args.chimera_max_inflight),
                             ("--chimera-zb-costs", args.chimera_zb_costs),
                             ("--chimera-zb-fallback", args.chimera_zb_fallback),
                             ("--num-virtual-stages-per-pipeline-rank",
                              args.num_virtual_stages_per_pipeline_rank)) if v is not None]
    if given or others:
        parser.error(f"--cost-grid sets the costs and the schedules itself; drop "
                     f"{' '.join(given + others)}")
    if not 0 <= args.measurement_noise < 1:
        parser.error(f"--measurement-noise must be in [0, 1), got {args.measurement_noise}")
    if args.end_stage_factor <= 0:
        parser.error(f"--end-stage-factor must be positive, got {args.end_stage_factor}")
    try:
        D, N = sizes(args)
        points = cost_grid(D, N, pipes=args.chimera_pipes or 2,
                           end_factor=args.end_stage_factor, noise=args.measurement_noise,
                           seed=args.seed)
    except ValueError as exc:
        parser.error(str(exc))
    print(f"D={D} N={N} pipes={args.chimera_pipes or 2} F=1 on middle stages, first and last "
          f"stage x{args.end_stage_factor:g}; measured = true costs off by up to "
          f"{args.measurement_noise:.0%} (seed {args.seed}); makespans under the true costs")
    print(format_grid(points))
    if args.json:
        rows = [p.to_dict() for p in points]
        atomic_write(args.json, lambda handle: json.dump(rows, handle, indent=1), mode="w")
        print(f"wrote {args.json}")
    return 0


def run_anchor_table(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``--anchor-table``: print (and write) the anchor table; only --json and --schedules."""
    defaults = parser.parse_args([])
    given = [k for k, v in vars(args).items()
             if k not in ("anchor_table", "json", "schedules") and v != getattr(defaults, k)]
    if given:
        parser.error(f"--anchor-table sets the sizes, costs and caps itself; drop "
                     f"{' '.join('--' + k.replace('_', '-') for k in given)}")
    rows = anchor_table(names=args.schedules)
    print(format_rows(rows))
    if args.json:
        atomic_write(args.json, lambda handle: json.dump(rows, handle, indent=1), mode="w")
        print(f"wrote {args.json}")
    return 0


def run_moe_table(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``--moe-table``: print (and write) the MoE overlap table; only -D, -N, --json,
    --all-to-all-cost and --moe-layers-per-stage."""
    defaults = parser.parse_args([])
    allowed = ("moe_table", "json", "all_to_all_cost", "moe_layers_per_stage", "num_microbatches",
               "pipeline_model_parallel_size")
    given = [k for k, v in vars(args).items() if k not in allowed and v != getattr(defaults, k)]
    if given:
        parser.error(f"--moe-table sets the costs and the schedules itself; drop "
                     f"{' '.join('--' + k.replace('_', '-') for k in given)}")
    if not args.all_to_all_cost >= 0:
        parser.error(f"--all-to-all-cost must be >= 0, got {args.all_to_all_cost}")
    layers = args.moe_layers_per_stage
    if layers < 0:
        parser.error(f"--moe-layers-per-stage must be >= 0, got {layers}")
    if args.num_microbatches is None:
        args.num_microbatches = 32  # the table: N = 32
    try:
        D, N = sizes(args)
    except ValueError as exc:
        parser.error(str(exc))
    costs = StageCosts.uniform(1.0, 1.0, 1.0, 1, all_to_all=args.all_to_all_cost)
    print(f"D={D} N={N} F:B:W = 1:1:1 per stage, all-to-all {args.all_to_all_cost:g} per stage "
          f"and direction; an unpaired F or B pays its all-to-all, a pair "
          + (f"piece by piece over {layers} MoE layers per stage (the paired runtime's baton)"
             if layers else "max(compute, all-to-all)")
          + "; exposed = all-to-all not hidden behind compute (worst rank)")
    rows = moe_table(D, N, costs, moe_layers_per_stage=layers)
    print(format_moe_table(rows))
    if args.json:
        atomic_write(args.json, lambda handle: json.dump(rows, handle, indent=1), mode="w")
        print(f"wrote {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse flags, compare the schedules, print the table and optionally write JSON."""
    parser = ToolArgumentParser(description=__doc__.split("\n")[0])
    add_size_and_cost_arguments(parser)
    add_schedule_arguments(parser)
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULE_NAMES, default=None,
                        help="subset of schedules to compare (default: all)")
    parser.add_argument("--json", default=None, help="write the rows to this JSON file")
    grid = parser.add_argument_group("cost grid")
    grid.add_argument("--cost-grid", action="store_true",
                      help="print the cost grid instead (B/F x W/B, orders built from measured "
                           "costs vs every alternative and the lower bound)")
    grid.add_argument("--measurement-noise", type=float, default=0.02,
                      help="--cost-grid: relative error of the measured costs (default 0.02)")
    grid.add_argument("--end-stage-factor", type=float, default=1.0,
                      help="--cost-grid: first and last stage cost this many times a middle one")
    grid.add_argument("--seed", type=int, default=0, help="--cost-grid: measurement error seed")
    parser.add_argument("--anchor-table", action="store_true",
                        help="print issue 30's table: D=8, N 8 and 32, three F:B:W, caps 8 and "
                             "5, p2p 0 and 0.1 F, beside the anchors' published figures")
    moe = parser.add_argument_group("MoE overlap table")
    moe.add_argument("--moe-table", action="store_true",
                     help="print issue 41's table: makespan and exposed all-to-all of every "
                          "schedule with and without --overlap-moe-expert-parallel-comm, "
                          "DualPipe, DualPipeV, combined 1F1B (F:B:W 1:1:1)")
    moe.add_argument("--all-to-all-cost", type=float, default=1.0,
                     help="--moe-table: all-to-all time per stage and direction (default 1)")
    moe.add_argument("--moe-layers-per-stage", type=int, default=0,
                     help="--moe-table: cost each pair piece by piece over this many MoE layers "
                          "per stage, as the paired runtime runs it (default 0: max(compute, "
                          "all-to-all))")
    args = parser.parse_args(argv)
    if args.moe_table:
        return run_moe_table(args, parser)
    if args.all_to_all_cost != 1.0:
        parser.error("--all-to-all-cost applies only with --moe-table")
    if args.moe_layers_per_stage:
        parser.error("--moe-layers-per-stage applies only with --moe-table")
    if args.anchor_table:
        return run_anchor_table(args, parser)
    if args.pipeline_schedule is not None or args.chimera_split_backward:
        parser.error("choose schedules with --schedules (every schedule is compared)")
    if args.cost_grid:
        return run_cost_grid(args, parser)
    grid_flags = [f for f, v, d in (("--measurement-noise", args.measurement_noise, 0.02),
                                    ("--end-stage-factor", args.end_stage_factor, 1.0),
                                    ("--seed", args.seed, 0)) if v != d]
    if grid_flags:
        parser.error(f"{' '.join(grid_flags)} apply only with --cost-grid")
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
