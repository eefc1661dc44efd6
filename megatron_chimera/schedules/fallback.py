"""Never slower than the unsplit schedules: a split-backward order against 1F1B and Chimera.

A split-backward order (Chimera-ZB, ZB-H1) is built for some F, B, W costs; under the costs the
job really has it can lose to a plain schedule that runs each backward whole (B + W as one
action). :func:`decide` simulates the split order and the unsplit alternatives -- 1F1B and
Chimera (default concatenation: slot-merge when N > D) with the split schedule's pipes -- under
the same :class:`~.costs.StageCosts` and picks the fastest, following the policy of
``--chimera-zb-fallback``:

* ``unsplit`` (default): an alternative that is predicted faster replaces the split order;
* ``refuse`` (the user *forces* the split-backward schedule): no replacement; if an alternative
  is predicted faster, :class:`FallbackRefused` (a ValueError) says so with the figures.

An alternative never needs more memory: one whose peak of live activations on a rank exceeds
the split schedule's cap (``--pipeline-activation-cap`` / ``--chimera-max-inflight``, else the
split order's own peak; in units of one micro-batch's activations on L/D layers), or that holds
more weight copies on a rank (:func:`~.simulate.model_copies`: ZB-H1, ZBV and V-Half hold one,
Chimera two), may not replace it.
BitPipe-ZB also meets unsplit BitPipe. ``same_placement=True`` (a running job, whose process
groups and stage modules are built for the split schedule's placement) also requires the same
placement. Such alternatives are still predicted and reported, with the reason. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megatron_chimera.errors import UserError
from megatron_chimera.schedules.actions import Schedule
from megatron_chimera.schedules.costs import StageCosts
from megatron_chimera.schedules.registry import FALLBACKS, ChimeraOptions, OverlapOptions, get_spec
from megatron_chimera.schedules.simulate import model_copies, peak_activations, simulate
from megatron_chimera.schedules.validate import validate

POLICIES = FALLBACKS  # the choices of --chimera-zb-fallback
DEFAULT_POLICY = "unsplit"
_RELATIVE_TOLERANCE = 1e-9


class FallbackRefused(UserError, ValueError):
    """``--chimera-zb-fallback refuse`` and an unsplit schedule is predicted faster (a flag
    problem: exit code 2, one ``error:`` line)."""

    exit_code = 2


@dataclass(frozen=True)
class Prediction:
    """One candidate schedule and its simulated iteration time under the costs."""

    label: str
    name: str
    options: Any
    schedule: Schedule | None
    makespan: float  # inf when the schedule cannot run at these sizes
    note: str = ""  # why it cannot run, or why it may not replace the running schedule

    @property
    def usable(self) -> bool:
        """Built, and allowed to replace the split schedule."""
        return self.schedule is not None and not self.note


@dataclass(frozen=True)
class Decision:
    """The split order, the unsplit alternatives and the one to run."""

    split: Prediction
    alternatives: tuple[Prediction, ...]
    chosen: Prediction

    @property
    def fell_back(self) -> bool:
        """Whether an unsplit schedule replaces the split order."""
        return self.chosen is not self.split

    def figures(self, unit: float = 1.0, suffix: str = "") -> str:
        """``chimera-zb 139 | 1f1b 156 | chimera/slot-merge 146`` (iteration times / unit)."""
        def one(p: Prediction) -> str:
            value = f"{p.makespan / unit:.4g}{suffix}" if p.schedule is not None else "n/a"
            return f"{p.label} {value}" + (f" ({p.note})" if p.note else "")

        return " | ".join(one(p) for p in (self.split, *self.alternatives))


def unsplit_alternatives(num_pipes: int, name: str = "") -> list[tuple[str, Any]]:
    """1F1B and Chimera (its default concatenation) with ``num_pipes`` pipes (2 for one pipe),
    and BitPipe for BitPipe-ZB (``name``: the split schedule)."""
    pipes = num_pipes if num_pipes > 1 else 2
    extra = [("bitpipe", OverlapOptions())] if name == "bitpipe-zb" else []
    return [("1f1b", OverlapOptions()), ("chimera", ChimeraOptions(pipes=pipes))] + extra


def predict(name: str, options: Any, num_ranks: int, num_microbatches: int,
            costs: StageCosts) -> Prediction:
    """Build schedule ``name`` and simulate it under ``costs`` (inf if it cannot run)."""
    spec = get_spec(name)
    try:
        schedule = spec.build(num_ranks, num_microbatches, options)
        validate(schedule)
    except ValueError as exc:
        return Prediction(name, name, options, None, float("inf"), str(exc).splitlines()[0])
    label = name if schedule.meta.get("concat") is None else f"{name}/{schedule.meta['concat']}"
    return of_schedule(schedule, costs, label=label, name=name, options=options)


def of_schedule(schedule: Schedule, costs: StageCosts, label: str | None = None,
                name: str | None = None, options: Any = None) -> Prediction:
    """A built schedule's simulated iteration time under ``costs`` (recut to its stages)."""
    stage_costs = costs.for_stages(schedule.num_stages)
    makespan = simulate(schedule, stage_costs.cost_model(schedule.split_backward)).makespan
    return Prediction(label or schedule.name, name or schedule.name, options, schedule, makespan)


def _why_not(alternative: Schedule, split: Schedule, same_placement: bool) -> str:
    """Why ``alternative`` may not replace ``split`` (more memory, or another placement while
    running), or ``""``."""
    cap = (split.meta.get("activation_cap") or split.meta.get("max_inflight")
           or max(peak_activations(split)))
    peak = max(peak_activations(alternative))
    if peak > cap + 1e-9:
        return f"needs {peak:g} live activations > {cap:g}"
    copies, allowed = max(model_copies(alternative)), max(model_copies(split))
    if copies > allowed + 1e-9:
        return f"needs {copies:g} weight copies > {allowed:g}"
    if same_placement and alternative.placement != split.placement:
        return "other placement: needs a restart"
    return ""


def decide(split: Prediction, costs: StageCosts, policy: str | None = None,
           same_placement: bool = False,
           alternatives: Sequence[tuple[str, Any]] | None = None) -> Decision:
    """Compare ``split`` with the unsplit alternatives under ``costs`` and choose (module doc).

    Raises :class:`FallbackRefused` under ``policy="refuse"`` when an alternative that could
    replace it is predicted faster.
    """
    policy = policy or DEFAULT_POLICY
    if policy not in POLICIES:
        raise ValueError(f"--chimera-zb-fallback must be one of {POLICIES}, got {policy!r}")
    assert split.schedule is not None, "the split schedule must be built"
    sched = split.schedule
    candidates = []
    for name, options in alternatives or unsplit_alternatives(sched.num_pipes, sched.name):
        p = predict(name, options, sched.num_ranks, sched.num_microbatches, costs)
        note = "" if p.schedule is None else _why_not(p.schedule, sched, same_placement)
        if note:
            p = Prediction(p.label, p.name, p.options, p.schedule, p.makespan, note)
        candidates.append(p)
    usable = [p for p in candidates if p.usable]
    best = min(usable, key=lambda p: p.makespan, default=None)
    decision = Decision(split, tuple(candidates), split)
    if best is None or best.makespan >= split.makespan * (1 - _RELATIVE_TOLERANCE):
        return decision
    if policy == "refuse":
        raise FallbackRefused(
            f"--chimera-zb-fallback refuse: {split.label} is predicted slower than "
            f"{best.label} under the costs ({split.makespan:.4g} vs {best.makespan:.4g}; "
            f"{decision.figures()}); drop --chimera-zb-fallback refuse to run {best.label}, or "
            f"choose another schedule")
    return Decision(split, tuple(candidates), best)
