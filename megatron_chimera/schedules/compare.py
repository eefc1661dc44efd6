"""Every schedule at one size side by side: makespan, bubble ratio, memory, weight copies.

The library part of ``tools/compare_schedules.py`` (also used by the playground). Every name of
``--pipeline-schedule`` is simulated (Chimera once per concatenation when N > D, unless
``--chimera-concat`` picks one); a schedule that cannot run at these sizes is listed with the
reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields, replace
from typing import Any

from megatron_chimera.schedules.actions import DESCRIBED_META
from megatron_chimera.schedules.cli import cost_model, options_for, schedule_from_args, sizes
from megatron_chimera.schedules.registry import SCHEDULE_NAMES, get_spec
from megatron_chimera.schedules.simulate import model_copies, simulate
from megatron_chimera.schedules.validate import validate


def _variants(name: str, args: Any) -> list[Any]:
    """Option sets of one row each: every concatenation when N > D and none is given."""
    spec = get_spec(name)
    options = options_for(spec, args, strict=False)
    d, n = sizes(args)
    concat = next((f for f in fields(options) if f.name == "concat"), None)
    if concat is None or options.concat is not None or n <= d:
        return [options]
    return [replace(options, concat=c) for c in concat.metadata["choices"]]


def compare(args: Any, names: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Simulate every schedule variant; one dict per row.

    Peak in-flight activations are in units of M_a of one of D stages (an interleaved chunk
    holds 1/v of a stage, so its count is divided by v); weight copies likewise in units of one
    of D stages (interleaved and ZBV 1, Chimera and BitPipe 2).
    """
    rows = []
    for name in names or SCHEDULE_NAMES:
        for options in _variants(name, args):
            row: dict[str, Any] = {"schedule": name}
            try:
                schedule = schedule_from_args(name, args, strict=False, options=options)
                validate(schedule)
            except ValueError as exc:
                row.update(variant=getattr(options, "concat", None) or "", error=str(exc))
                rows.append(row)
                continue
            result = simulate(schedule, cost_model(args, schedule))
            unit = schedule.num_ranks / schedule.num_stages
            peaks = [p * unit for p in result.peak_inflight]
            variant = " ".join(f"{k}={v}" for k, v in sorted(schedule.meta.items())
                               if k in DESCRIBED_META)
            row.update(
                variant=variant,
                pipes=schedule.num_pipes,
                makespan=result.makespan,
                bubble_ratio=result.bubble_ratio,
                peak_inflight=[int(p) if float(p).is_integer() else p for p in peaks],
                weight_copies=[int(c) if c.is_integer() else c for c in model_copies(schedule)],
            )
            rows.append(row)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """Aligned plain-text table of :func:`compare` rows (rows with errors listed last)."""
    header = ("schedule", "variant", "makespan", "bubble", "peak in-flight per rank",
              "weight copies per rank")
    lines = [(r["schedule"], r["variant"], f"{r['makespan']:g}", f"{r['bubble_ratio']:.3f}",
              " ".join(f"{p:g}" for p in r["peak_inflight"]),
              " ".join(f"{c:g}" for c in r["weight_copies"]))
             for r in rows if "error" not in r]
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h)
              for i, h in enumerate(header)]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    out += ["  ".join((r["schedule"].ljust(widths[0]), r["variant"].ljust(widths[1]), "n/a: "))
            + r["error"] for r in rows if "error" in r]
    return "\n".join(out)
