#!/usr/bin/env python
"""Time the Chimera-ZB generator over D x N: seconds, makespan, lower bound, chosen variant.

Example (the table in docs/CHIMERA_ZB.md)::

    python tools/benchmark_generation.py -D 8 16 32 64 --n-per-d 1 4 8 --json gen.json

Each size is built twice: for 1:1:1 and for per-stage costs as profiling measures them (F 1,
B 1.5, W 0.5, the first and last stage 1.5 x heavier). Wall-clock seconds of one build in this
process (no cache), and the CPU seconds of this process for it (what a quiet machine's wall
clock would be; on a shared machine the wall clock also counts waiting for a core).
"""

from __future__ import annotations

import json
import sys
import time

from megatron_chimera.atomic import atomic_write
from megatron_chimera.errors import ToolArgumentParser, run_tool
from megatron_chimera.schedules.cost_grid import true_costs
from megatron_chimera.schedules.costs import StageCosts
from megatron_chimera.schedules.zero_bubble import chimera_zb


def build_costs(name: str, num_ranks: int) -> StageCosts:
    """``unit``: 1:1:1; ``skewed``: F 1, B 1.5, W 0.5, end stages x1.5."""
    if name == "unit":
        return StageCosts.uniform(1.0, 1.0, 1.0, num_ranks)
    return true_costs(num_ranks, 1.5, 1 / 3, end_factor=1.5)


def main(argv: list[str] | None = None) -> int:
    """Build every size, print the table, optionally write JSON."""
    parser = ToolArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-D", "--pipeline-model-parallel-size", type=int, nargs="+",
                        default=[8, 16, 32, 64])
    parser.add_argument("--n-per-d", type=int, nargs="+", default=[1, 4, 8],
                        help="N = each of these x D (default 1 4 8)")
    parser.add_argument("--chimera-pipes", type=int, default=2)
    parser.add_argument("--costs", nargs="+", choices=("unit", "skewed"),
                        default=["unit", "skewed"])
    parser.add_argument("--json", default=None, help="write the rows to this JSON file")
    args = parser.parse_args(argv)
    if min(args.pipeline_model_parallel_size) < 2 or min(args.n_per_d) < 1:
        parser.error("-D must be >= 2 and --n-per-d >= 1")
    rows = []
    print("| D | N | costs | seconds | CPU seconds | makespan | lower bound | gap | order |")
    print("|---|---|---|---|---|---|---|---|---|")
    for d in args.pipeline_model_parallel_size:
        for k in args.n_per_d:
            n = k * d
            for name in args.costs:
                costs = build_costs(name, d)
                start, cpu = time.perf_counter(), time.process_time()
                try:
                    schedule = chimera_zb(d, n, pipes=args.chimera_pipes, costs=costs)
                except ValueError as exc:
                    print(f"skipped D={d} N={n}: {exc}", file=sys.stderr)
                    continue
                seconds = time.perf_counter() - start
                cpu_seconds = time.process_time() - cpu
                meta = schedule.meta
                gap = meta["model_makespan"] / meta["lower_bound"] - 1
                rows.append({"D": d, "N": n, "costs": name, "seconds": seconds,
                             "cpu_seconds": cpu_seconds,
                             "makespan": meta["model_makespan"],
                             "lower_bound": meta["lower_bound"], "order": meta["priority"]})
                print(f"| {d} | {n} | {name} | {seconds:.2f} | {cpu_seconds:.2f} | "
                      f"{meta['model_makespan']:g} | "
                      f"{meta['lower_bound']:g} | {gap:.1%} | {meta['priority']} |", flush=True)
    if args.json:
        atomic_write(args.json, lambda handle: json.dump(rows, handle, indent=1), mode="w")
    return 0


if __name__ == "__main__":
    run_tool(main)
