#!/usr/bin/env python
"""Predicted vs measured iteration times of ``tools/benchmark_schedules.py`` (emulated compute).

Example::

    python tools/validate_perf_model.py bench.json --forward-ms 20 --backward-ms 40 \\
        --weight-ms 20 --measure-p2p
"""

from __future__ import annotations

import json

from megatron_chimera.errors import ToolArgumentParser, run_tool
from megatron_chimera.tuning.hardware import LinkProfile
from megatron_chimera.tuning.validation import EmulatedCompute, compare, format_comparison


def main(argv: list[str] | None = None) -> int:
    """Compare a benchmark JSON with the model's predictions."""
    p = ToolArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bench_json")
    p.add_argument("--forward-ms", type=float, required=True)
    p.add_argument("--backward-ms", type=float, required=True)
    p.add_argument("--weight-ms", type=float, default=0.0)
    link_group = p.add_mutually_exclusive_group(required=True)
    link_group.add_argument("--measure-p2p", action="store_true")
    link_group.add_argument("--p2p-alpha-us", type=float)
    p.add_argument("--action-overhead-us", type=float, default=0.0,
                   help="host time before each compute action (benchmark_schedules.py --trace "
                        "prints the run's: host costs ... ms per action; pass its ms per message "
                        "as --p2p-alpha-us)")
    args = p.parse_args(argv)
    if args.action_overhead_us < 0:
        p.error(f"--action-overhead-us must be >= 0, got {args.action_overhead_us}")
    if args.measure_p2p:
        from megatron_chimera.tuning.profile import measure_p2p_link

        link = measure_p2p_link()
    else:
        link = LinkProfile(args.p2p_alpha_us * 1e-6, float("inf"))
    with open(args.bench_json) as f:
        rows = json.load(f)
    compute = EmulatedCompute(args.forward_ms / 1e3, args.backward_ms / 1e3, args.weight_ms / 1e3)
    records = compare(rows, compute, link, args.action_overhead_us * 1e-6)
    print(format_comparison(records, link))
    return 0


if __name__ == "__main__":
    run_tool(main)
