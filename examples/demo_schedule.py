#!/usr/bin/env python
"""Chimera's bidirectional schedule next to 1F1B: text charts, PNG Gantt charts, bubbles, memory.

Example::

    python examples/demo_schedule.py -D 8 -N 16 --out outputs/demo_schedule

Both schedules are built for the same D pipeline ranks and N micro-batches and simulated with the
same relative costs (one micro-batch through one stage; ``--backward-cost`` is the whole backward).
The demo prints both text charts, the makespan, bubble ratio, weight copies and peak in-flight
activations per rank, and checks the simulated bubble ratios at forward = backward against the
paper's Table 2: ``(D-2f)/(2fN+D-2f)`` for Chimera with 2f pipes, ``(D-1)/(N+D-1)`` for 1F1B.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_chimera.schedules import Schedule, build_schedule
from megatron_chimera.schedules.chimera import CONCAT_FORWARD_DOUBLING, CONCAT_NAMES
from megatron_chimera.schedules.plot import plot_schedule, text_chart
from megatron_chimera.schedules.simulate import CostModel, SimResult, simulate
from megatron_chimera.schedules.validate import validate


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Sizes, Chimera's options, costs and the output directory."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--pipeline-model-parallel-size", "-D", type=int, default=4,
                   help="pipeline ranks D (even, default 4)")
    p.add_argument("--num-microbatches", "-N", type=int, default=8,
                   help="micro-batches per iteration N (default 8)")
    p.add_argument("--chimera-pipes", type=int, default=2, help="2f pipes (default 2)")
    p.add_argument("--chimera-concat", choices=CONCAT_NAMES, default=None,
                   help="how N > D is built from basic units (default slot-merge)")
    p.add_argument("--forward-cost", type=float, default=1.0)
    p.add_argument("--backward-cost", type=float, default=2.0, help="whole backward")
    p.add_argument("--out", default="outputs/demo_schedule",
                   help="directory for chimera.png and 1f1b.png")
    args = p.parse_args(argv)
    if args.forward_cost <= 0 or args.backward_cost <= 0:
        p.error("--forward-cost and --backward-cost must be positive")
    return args


def build_pair(args: argparse.Namespace) -> dict[str, Schedule]:
    """Chimera (with the chosen pipes and concatenation) and 1F1B at the same sizes."""
    D, N = args.pipeline_model_parallel_size, args.num_microbatches
    chimera_options = {"pipes": args.chimera_pipes}
    if args.chimera_concat is not None:
        chimera_options["concat"] = args.chimera_concat
    schedules = {"chimera": build_schedule("chimera", D, N, **chimera_options),
                 "1f1b": build_schedule("1f1b", D, N)}
    for schedule in schedules.values():
        validate(schedule)
    return schedules


def paper_bubble_ratio(name: str, D: int, N: int, pipes: int) -> float:
    """Table 2 of the paper (forward = backward cost)."""
    if name == "chimera":
        return (D - pipes) / (pipes * N + D - pipes)
    return (D - 1) / (N + D - 1)


def summary(name: str, schedule: Schedule, result: SimResult, equal: SimResult) -> str:
    """One schedule's figures, and its bubble at forward = backward vs the paper's formula."""
    D, N = schedule.num_ranks, schedule.num_microbatches
    lines = [f"{name}: makespan {result.makespan:g}, bubble ratio {result.bubble_ratio:.4f}, "
             f"weight copies per rank {result.weight_copies}, "
             f"peak in-flight micro-batches per rank {result.peak_inflight}"]
    if schedule.meta.get("concat") == CONCAT_FORWARD_DOUBLING:
        lines.append("  (forward doubling runs two forwards per slot: Table 2 does not apply)")
    else:
        formula = paper_bubble_ratio(name, D, N, schedule.num_pipes)
        lines.append(f"  at forward = backward: simulated bubble ratio {equal.bubble_ratio:.4f}, "
                     f"paper Table 2 {formula:.4f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Build, simulate, print and draw both schedules."""
    args = parse_args(argv)
    try:
        schedules = build_pair(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    costs = CostModel(args.forward_cost, args.backward_cost)
    results = {}
    for name, schedule in schedules.items():
        results[name] = simulate(schedule, costs)
        print(text_chart(schedule, results[name]), end="\n\n")
    for name, schedule in schedules.items():
        equal = simulate(schedule, CostModel(1.0, 1.0))
        print(summary(name, schedule, results[name], equal))
    speedup = results["1f1b"].makespan / results["chimera"].makespan
    print(f"\nChimera finishes the iteration {speedup:.3f}x as fast as 1F1B "
          f"(forward {args.forward_cost:g}, backward {args.backward_cost:g}), holding "
          f"{max(results['chimera'].weight_copies)} weight copies per rank instead of 1.")
    for name, schedule in schedules.items():
        path = out / f"{name}.png"
        plot_schedule(schedule, results[name], str(path))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
