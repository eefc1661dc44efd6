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
from megatron_chimera.schedules.walk import no_cyclic_gc


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


# ----------------------------------------------------------------------------- MoE overlap table
# (label, schedule, options): each Chimera-family and 1F1B-family schedule without and with
# --overlap-moe-expert-parallel-comm, and the published F&B-overlap schedules
MOE_ROWS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("1f1b", "1f1b", {}),
    ("1f1b +overlap", "1f1b", {"overlap_moe_expert_parallel_comm": True}),
    ("interleaved v2", "interleaved", {}),
    ("interleaved v2 +overlap", "interleaved", {"overlap_moe_expert_parallel_comm": True}),
    ("combined-1f1b v2", "combined-1f1b", {}),
    ("dualpipe", "dualpipe", {}),
    ("dualpipev", "dualpipev", {}),
    ("chimera", "chimera", {}),
    ("chimera-ep (chimera +overlap)", "chimera", {"overlap_moe_expert_parallel_comm": True}),
    ("chimera-zb", "chimera-zb", {}),
    ("chimera-ep (chimera-zb +overlap)", "chimera-zb",
     {"overlap_moe_expert_parallel_comm": True}),
    ("bitpipe +overlap", "bitpipe", {"overlap_moe_expert_parallel_comm": True}),
    ("bitpipe-zb +overlap", "bitpipe-zb", {"overlap_moe_expert_parallel_comm": True}),
)
CHIMERA_EP_LABELS = ("chimera-ep (chimera +overlap)", "chimera-ep (chimera-zb +overlap)")


@no_cyclic_gc()  # the searches and simulations allocate millions of short-lived tuples
def moe_table(num_ranks: int, num_microbatches: int, costs: Any,
              rows: Sequence[tuple[str, str, dict[str, Any]]] = MOE_ROWS,
              moe_layers_per_stage: int = 0) -> list[dict[str, Any]]:
    """Every row of ``rows`` simulated under ``costs`` (a one-stage :class:`~.costs.StageCosts`
    with ``all_to_all``: the cost of each of D stages, split over smaller chunks): makespan,
    exposed all-to-all (the worst rank's, and the mean over ranks) and its share of the
    makespan, peak activations and weight copies (L/D-layer units) and the number of pairs.
    The split-backward schedules are built for ``costs`` (``costs=`` option) where they take
    it; every schedule is simulated with them, each pair costed piece by piece over
    ``moe_layers_per_stage`` MoE layers per stage when it is > 0
    (``CostModel.moe_layers_per_stage``; 0: max(compute, all-to-all)) -- the cost the
    overlapped rows' pairs are also chosen under."""
    from megatron_chimera.schedules.pairing import ep_costs

    out = []
    for label, name, options in rows:
        spec = get_spec(name)
        given = dict(options)
        if any(f.name == "costs" for f in spec.option_fields()):
            given["costs"] = costs
        row: dict[str, Any] = {"schedule": label}
        try:
            schedule = spec.build(num_ranks, num_microbatches, spec.options_type(**given),
                                  moe_layers_per_stage=moe_layers_per_stage)
            validate(schedule)
        except ValueError as exc:
            row["error"] = str(exc)
            out.append(row)
            continue
        stage_costs = ep_costs(costs, num_ranks, schedule.num_stages)
        result = simulate(schedule, stage_costs.cost_model(
            schedule.split_backward, moe_layers_per_stage=moe_layers_per_stage))
        exposed = result.exposed_all_to_all
        row.update(
            makespan=result.makespan,
            exposed_max=max(exposed),
            exposed_mean=sum(exposed) / len(exposed),
            exposed_share=max(exposed) / result.makespan,
            exposed_mean_share=sum(exposed) / len(exposed) / result.makespan,
            peak_activations=max(result.peak_inflight) * schedule.num_ranks
            / schedule.num_stages,
            weight_copies=max(model_copies(schedule)),
            pairs=schedule.num_pairs(),
        )
        out.append(row)
    return out


def format_moe_table(rows: list[dict[str, Any]]) -> str:
    """Aligned plain-text table of :func:`moe_table` rows."""
    header = ("schedule", "makespan", "exposed a2a (worst rank)", "share", "mean share",
              "peak act", "weights", "pairs")
    lines = [(r["schedule"], f"{r['makespan']:g}", f"{r['exposed_max']:g}",
              f"{r['exposed_share']:.1%}", f"{r['exposed_mean_share']:.1%}",
              f"{r['peak_activations']:g}", f"{r['weight_copies']:g}", str(r["pairs"]))
             for r in rows if "error" not in r]
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h)
              for i, h in enumerate(header)]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    out += [f"{r['schedule']}: n/a: {r['error']}" for r in rows if "error" in r]
    return "\n".join(out)
