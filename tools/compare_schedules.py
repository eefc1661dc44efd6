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

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from plot_schedule import (  # noqa: E402
    add_schedule_arguments,
    check_costs,
    cost_model,
    make_schedule,
    write_json,
)

from megatron_chimera.schedules import SCHEDULE_NAMES  # noqa: E402
from megatron_chimera.schedules.chimera import CONCAT_NAMES  # noqa: E402
from megatron_chimera.schedules.simulate import simulate  # noqa: E402
from megatron_chimera.schedules.validate import validate  # noqa: E402


def _variants(args: argparse.Namespace) -> list[tuple[str, argparse.Namespace]]:
    """(schedule name, flags) per row: Chimera once per concatenation when N > D and none is set."""
    D = args.pipeline_model_parallel_size
    n_gt_d = args.num_microbatches is not None and args.num_microbatches > D
    rows = []
    for name in args.schedules or SCHEDULE_NAMES:
        if name == "chimera" and args.chimera_concat is None and n_gt_d:
            for concat in CONCAT_NAMES:
                rows.append((name, argparse.Namespace(**{**vars(args), "chimera_concat": concat})))
        else:
            rows.append((name, args))
    return rows


def compare(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Simulate every schedule variant; one dict per row.

    Peak in-flight activations are in units of M_a of one of D stages (an interleaved chunk
    holds 1/v of a stage, so its count is divided by v).
    """
    rows = []
    for name, flags in _variants(args):
        row: dict[str, Any] = {"schedule": name}
        try:
            schedule = make_schedule(name, flags, strict=False)
            validate(schedule)
        except ValueError as exc:
            row.update(variant=flags.chimera_concat if name == "chimera" else "", error=str(exc))
            rows.append(row)
            continue
        result = simulate(schedule, cost_model(flags, schedule))
        unit = schedule.num_ranks / schedule.num_stages
        peaks = [p * unit for p in result.peak_inflight]
        variant = " ".join(f"{k}={v}" for k, v in sorted(schedule.meta.items())
                           if k in ("concat", "virtual_pipeline_size", "max_inflight"))
        row.update(
            variant=variant,
            pipes=schedule.num_pipes,
            makespan=result.makespan,
            bubble_ratio=result.bubble_ratio,
            peak_inflight=[int(p) if float(p).is_integer() else p for p in peaks],
            weight_copies=result.weight_copies,
        )
        rows.append(row)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """Aligned plain-text table of :func:`compare` rows."""
    header = ("schedule", "variant", "makespan", "bubble", "peak in-flight per rank",
              "weight copies per rank")
    lines = []
    for r in rows:
        if "error" in r:
            continue
        lines.append((
            r["schedule"], r["variant"], f"{r['makespan']:g}", f"{r['bubble_ratio']:.3f}",
            " ".join(f"{p:g}" for p in r["peak_inflight"]), " ".join(map(str, r["weight_copies"])),
        ))
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h)
              for i, h in enumerate(header)]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    out += [
        "  ".join((r["schedule"].ljust(widths[0]), r["variant"].ljust(widths[1]), "n/a: "))
        + r["error"]
        for r in rows
        if "error" in r
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Parse flags, compare the schedules, print the table and optionally write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_schedule_arguments(parser)
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULE_NAMES, default=None,
                        help="subset of schedules to compare (default: all)")
    parser.add_argument("--json", default=None, help="write the rows to this JSON file")
    args = parser.parse_args(argv)
    try:
        check_costs(args)
    except ValueError as exc:
        parser.error(str(exc))
    D = args.pipeline_model_parallel_size
    N = args.num_microbatches if args.num_microbatches is not None else D
    print(f"D={D} N={N} forward={args.forward_cost:g} backward={args.backward_cost:g} "
          f"weight={args.weight_cost:g}")
    rows = compare(args)
    print(format_table(rows))
    if args.json:
        write_json(args.json, rows)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
