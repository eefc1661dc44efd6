"""The anchor table: every schedule at every memory budget, beside the anchors' published figures.

D=8, N in {8, 32}, F:B:W in {1:1:1, 1:2:1, 1:1.5:0.5} (times of one micro-batch on L/D layers; a V
chunk costs half), activation caps {8, 5} (units of one micro-batch's activations on L/D layers, a
half-size chunk 0.5; 8 = 1F1B). Per cap, every split-backward schedule is built for the costs under
that cap (``--pipeline-activation-cap``), and every unsplit one whose peak fits the cap is listed as
it is -- Chimera once per concatenation, backward halving included (2N half-size micro-batches: half
the cost and half the activation each). A row holds the simulated makespan (units of F), bubble
ratio, peak activations, weight copies (units of L/D layers) and point-to-point messages per
iteration (one message: one micro-batch's activation or gradient at a stage boundary; a V turn's
local hand-off is none). ``p2p`` > 0 charges each message that time, in the generators' costs and in
the simulation. ``anchor-*`` rows are the figures issue 30 quotes (the anchors' own schedulers run
in our simulator, p2p = 0). Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

from megatron_chimera.schedules.actions import Schedule
from megatron_chimera.schedules.chimera import chimera_backward_halving
from megatron_chimera.schedules.costs import StageCosts
from megatron_chimera.schedules.lowering import produced_message
from megatron_chimera.schedules.registry import PAIRED_SCHEDULES, SCHEDULES, get_spec
from megatron_chimera.schedules.simulate import model_copies, peak_activations, simulate
from megatron_chimera.schedules.validate import validate

RANKS = 8
MICROBATCHES = (8, 32)
COSTS = ((1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (1.0, 1.5, 0.5))
CAPS = (8.0, 5.0)
# issue 30's table: (schedule, cap) -> {(N, "F:B:W"): makespan}; weight copies
ANCHORS: dict[tuple[str, float], tuple[dict[tuple[int, str], float], int]] = {
    ("anchor-zbv", 8.0): ({(8, "1:1:1"): 27.5, (8, "1:2:1"): 39, (8, "1:1.5:0.5"): 30.75,
                           (32, "1:1:1"): 99.5, (32, "1:2:1"): 135, (32, "1:1.5:0.5"): 102.75},
                          1),
    ("anchor-v-half", 5.0): ({(8, "1:1:1"): 32.5, (8, "1:2:1"): 54, (8, "1:1.5:0.5"): 42.25,
                              (32, "1:1:1"): 104.5, (32, "1:2:1"): 160,
                              (32, "1:1.5:0.5"): 118.5}, 1),
    ("anchor-chimera-zb", 8.0): ({(8, "1:1:1"): 27, (8, "1:2:1"): 38, (8, "1:1.5:0.5"): 29.5,
                                  (32, "1:1:1"): 99, (32, "1:2:1"): 134,
                                  (32, "1:1.5:0.5"): 101.5}, 2),
    ("anchor-chimera-zb", 5.0): ({(8, "1:1:1"): 34, (8, "1:2:1"): 51, (8, "1:1.5:0.5"): 41.5,
                                  (32, "1:1:1"): 107, (32, "1:2:1"): 164,
                                  (32, "1:1.5:0.5"): 118.5}, 2),
    ("anchor-bitpipe-zb-prototype", 8.0): ({(8, "1:1:1"): 25.5, (8, "1:2:1"): 35,
                                            (8, "1:1.5:0.5"): 26.25, (32, "1:1:1"): 97.5,
                                            (32, "1:2:1"): 135.5}, 2),
}


def costs_label(costs: Sequence[float]) -> str:
    """``"1:1.5:0.5"``."""
    return ":".join(f"{c:g}" for c in costs)


def p2p_messages(schedule: Schedule) -> int:
    """Messages between two ranks in one training iteration (local hand-offs excluded)."""
    return sum(1 for rank, actions in enumerate(schedule.actions) for a in actions
               if (m := produced_message(schedule, a)) is not None and m.dst != rank)


def _row(schedule: Schedule, name: str, label: str, num_microbatches: int,
         costs: Sequence[float], cap: float, p2p: float) -> dict[str, Any]:
    fraction = schedule.meta.get("microbatch_fraction", 1.0)  # backward halving: 0.5
    f, b, w = (c * fraction for c in costs)
    stage_costs = StageCosts.uniform(f, b, w, schedule.num_ranks, p2p)
    model = stage_costs.for_stages(schedule.num_stages).cost_model(schedule.split_backward)
    result = simulate(schedule, model)
    return {"D": schedule.num_ranks, "N": num_microbatches, "costs": costs_label(costs),
            "cap": cap, "p2p": p2p, "schedule": label, "name": name,
            "makespan": result.makespan, "bubble": result.bubble_ratio,
            "peak_activations": max(peak_activations(schedule)) * fraction,
            "weight_copies": max(model_copies(schedule)),
            "p2p_messages": p2p_messages(schedule) * fraction}  # full-size ones


def _variants(name: str, num_ranks: int, num_microbatches: int) -> Iterable[tuple[str, Any]]:
    """(label, options) of one schedule's rows: Chimera once per concatenation."""
    spec = get_spec(name)
    if name == "chimera":
        for options in spec.variants(num_ranks, num_microbatches, {"pipes": (2,)}):
            yield spec.label(options), options
    elif name == "interleaved":
        yield "interleaved/v2", spec.options_type()
    else:
        yield name, spec.options_type()


def rows_at(num_ranks: int, num_microbatches: int, costs: Sequence[float], cap: float,
            p2p: float = 0.0, names: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Every schedule (``names``, default all but :data:`~.registry.PAIRED_SCHEDULES`) at one
    point of the table (module docstring)."""
    rows = []
    stage_costs = StageCosts.uniform(*costs, num_ranks, p2p)
    # issue 30's table: the schedules without MoE all-to-all pairs
    for name in names or tuple(n for n in SCHEDULES if n not in PAIRED_SCHEDULES):
        spec = get_spec(name)
        for label, options in _variants(name, num_ranks, num_microbatches):
            if spec.split_backward and hasattr(options, "costs"):  # zb-2p: a fixed order
                options = replace(options, costs=stage_costs, activation_cap=cap)
            try:
                schedule = spec.build(num_ranks, num_microbatches, options)
                validate(schedule)
            except ValueError:
                continue  # cannot run at these sizes
            row = _row(schedule, name, label, num_microbatches, costs, cap, p2p)
            if row["peak_activations"] <= cap + 1e-9:
                rows.append(row)
    if names is None or "chimera" in names:
        try:
            halving = chimera_backward_halving(num_ranks, num_microbatches)
        except ValueError:
            return rows
        row = _row(halving, "chimera", "chimera/backward-halving", num_microbatches, costs, cap,
                   p2p)
        if row["peak_activations"] <= cap + 1e-9:
            rows.append(row)
    return rows


def anchor_rows(num_ranks: int = RANKS) -> list[dict[str, Any]]:
    """The issue's published figures as rows (p2p = 0; makespan only)."""
    rows = []
    for (label, cap), (figures, copies) in ANCHORS.items():
        for (n, costs), makespan in figures.items():
            rows.append({"D": num_ranks, "N": n, "costs": costs, "cap": cap, "p2p": 0.0,
                         "schedule": label, "name": label, "makespan": float(makespan),
                         "bubble": None, "peak_activations": cap, "weight_copies": copies,
                         "p2p_messages": None})
    return rows


def anchor_table(p2p_values: Sequence[float] = (0.0, 0.1),
                 microbatches: Sequence[int] = MICROBATCHES,
                 names: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Every row of the table, the anchors' (p2p = 0) included."""
    rows = []
    for p2p in p2p_values:
        for n in microbatches:
            for costs in COSTS:
                for cap in CAPS:
                    rows += rows_at(RANKS, n, costs, cap, p2p, names)
    return rows + anchor_rows()


def best(rows: Iterable[dict[str, Any]], n: int, costs: str, cap: float, p2p: float = 0.0,
         max_copies: float = 2.0, anchors: bool = False) -> dict[str, Any]:
    """The fastest row at (N, costs) within ``cap`` and ``max_copies`` (our schedules only,
    unless ``anchors``)."""
    fits = [r for r in rows if r["N"] == n and r["costs"] == costs and r["p2p"] == p2p
            and r["peak_activations"] <= cap + 1e-9 and r["weight_copies"] <= max_copies
            and r["schedule"].startswith("anchor-") == anchors]
    return min(fits, key=lambda r: r["makespan"])


def format_rows(rows: Sequence[dict[str, Any]]) -> str:
    """Plain-text table, one block per (p2p, N, cap)."""
    out = []
    keys = sorted({(r["p2p"], r["N"], r["cap"]) for r in rows}, key=lambda k: (k[0], k[1], -k[2]))
    for p2p, n, cap in keys:
        block = [r for r in rows if (r["p2p"], r["N"], r["cap"]) == (p2p, n, cap)]
        labels = sorted({r["schedule"] for r in block},
                        key=lambda s: (s.startswith("anchor-"), s))
        out.append(f"\nD={RANKS} N={n} cap={cap:g} p2p={p2p:g}F   makespan (bubble) per F:B:W"
                   f" | peak act. | weight copies | p2p messages")
        for label in labels:
            cells = []
            mine = {r["costs"]: r for r in block if r["schedule"] == label}
            for costs in (costs_label(c) for c in COSTS):
                r = mine.get(costs)
                if r is None:
                    cells.append("—".rjust(14))
                else:
                    bubble = "" if r["bubble"] is None else f" ({r['bubble']:.2f})"
                    cells.append(f"{r['makespan']:g}{bubble}".rjust(14))
            any_row = next(iter(mine.values()))
            messages = any_row["p2p_messages"]
            sent = "—" if messages is None else f"{messages:g}"
            out.append(f"  {label:<30}{''.join(cells)} | {any_row['peak_activations']:g} | "
                       f"{any_row['weight_copies']:g} | {sent}")
    return "\n".join(out).lstrip("\n")
