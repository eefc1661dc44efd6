"""Per-stage costs a split-backward generator builds for: F, B (input gradient), W, and p2p.

:class:`StageCosts` holds, for every model stage, the time of one micro-batch's forward (F), its
input-gradient backward (B) and its weight-gradient backward (W), plus the time of one
point-to-point message between two ranks. Any unit (seconds, or relative to F): a generator's
order depends only on the ratios.

``--chimera-zb-costs`` accepts three forms (:func:`parse_costs`):

* ``F,B,W``: the same three numbers for every stage (a tuple, as before);
* ``F,B,W;F,B,W;...``: one triple per stage, stage 0 first (one triple: every stage), optionally
  followed by ``;p2p=T``, the time of one point-to-point message, and ``;a2a=A`` or
  ``;a2a=A0,A1,...`` (one per stage), the MoE all-to-all time of one micro-batch through a stage
  in one direction (:attr:`StageCosts.all_to_all`);
* ``@path.json``: a JSON object ``{"F": [...], "B": [...], "W": [...], "p2p": seconds,
  "A2A": [...]}`` (one entry per stage; ``p2p`` and ``A2A`` optional), as written by
  :meth:`StageCosts.to_dict` (the measured costs a training run logs, ``tools/autotune.py
  --stage-costs-json``), or a list of such objects under ``"stage_costs"`` keys (the first is
  used).

Torch-free, like the rest of the IR.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from megatron_chimera.schedules.actions import BACKWARD, FORWARD, WEIGHT
from megatron_chimera.schedules.simulate import CostModel

FLAG = "--chimera-zb-costs"
UniformCosts = tuple[float, float, float]


@dataclass(frozen=True)
class StageCosts:
    """Per-stage F, B (input gradient), W times of one micro-batch, and one p2p message time.

    ``all_to_all`` (MoE with expert parallelism; empty: none): per stage, the time of one
    micro-batch's all-to-alls in one direction (dispatch and combine of its MoE layers), which an
    F and a B each pay on top of their compute (:attr:`CostModel.all_to_all_cost`)."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    weight: tuple[float, ...]
    p2p: float = 0.0
    all_to_all: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        lengths = {len(self.forward), len(self.backward), len(self.weight)}
        if len(lengths) != 1 or not self.forward:
            raise ValueError(f"{FLAG}: F, B and W need one entry per stage each, got "
                             f"{len(self.forward)}, {len(self.backward)}, {len(self.weight)}")
        for name, values in (("F", self.forward), ("B", self.backward), ("W", self.weight)):
            if any(not (math.isfinite(v) and v > 0) for v in values):
                raise ValueError(f"{FLAG}: every {name} must be a positive number, got "
                                 f"{list(values)}")
        if not (math.isfinite(self.p2p) and self.p2p >= 0):
            raise ValueError(f"{FLAG}: p2p must be a number >= 0, got {self.p2p}")
        if self.all_to_all and (len(self.all_to_all) != len(self.forward) or any(
                not (math.isfinite(v) and v >= 0) for v in self.all_to_all)):
            raise ValueError(f"{FLAG}: a2a needs one number >= 0 per stage, got "
                             f"{list(self.all_to_all)} for {len(self.forward)} stages")

    # ------------------------------------------------------------------ construction
    @classmethod
    def uniform(cls, forward: float, backward: float, weight: float, num_stages: int,
                p2p: float = 0.0, all_to_all: float = 0.0) -> StageCosts:
        """The same F, B, W (and all-to-all time) on every one of ``num_stages`` stages."""
        return cls((float(forward),) * num_stages, (float(backward),) * num_stages,
                   (float(weight),) * num_stages, float(p2p),
                   (float(all_to_all),) * num_stages if all_to_all else ())

    @classmethod
    def of(cls, costs: StageCosts | Sequence[float], num_stages: int) -> StageCosts:
        """``costs`` for ``num_stages`` stages: a StageCosts of that length (one stage: the same
        for every stage), or ``(F, B, W)``."""
        if isinstance(costs, StageCosts):
            if costs.num_stages == 1 and num_stages > 1:
                return cls.uniform(costs.forward[0], costs.backward[0], costs.weight[0],
                                   num_stages, costs.p2p, costs.a2a_of(0))
            if costs.num_stages != num_stages:
                raise ValueError(f"{FLAG}: the costs have {costs.num_stages} stages, the "
                                 f"schedule {num_stages}")
            return costs
        values = tuple(costs)
        if len(values) != 3:
            raise ValueError(f"{FLAG}: costs must be three numbers F,B,W or per-stage lists, "
                             f"got {costs!r}")
        return cls.uniform(*values, num_stages)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StageCosts:
        """Inverse of :meth:`to_dict` (``p2p`` optional)."""
        missing = [k for k in ("F", "B", "W") if k not in data]
        if missing:
            raise ValueError(f"{FLAG}: the cost file lacks {missing} (needs per-stage lists "
                             f"\"F\", \"B\", \"W\" and optionally \"p2p\")")
        try:
            return cls(tuple(float(v) for v in data["F"]), tuple(float(v) for v in data["B"]),
                       tuple(float(v) for v in data["W"]), float(data.get("p2p", 0.0)),
                       tuple(float(v) for v in data.get("A2A", ())))
        except TypeError:
            raise ValueError(f"{FLAG}: \"F\", \"B\", \"W\" and \"A2A\" must be lists of "
                             f"numbers") from None

    # ------------------------------------------------------------------ views
    @property
    def num_stages(self) -> int:
        """Number of stages."""
        return len(self.forward)

    def a2a_of(self, stage: int) -> float:
        """The all-to-all time of ``stage`` (0 without MoE costs)."""
        return self.all_to_all[stage] if self.all_to_all else 0.0

    def durations(self) -> dict[str, tuple[float, ...]]:
        """Per-kind (``F``, ``B``, ``W``) per-stage times a rank is busy: F and B with their
        all-to-all (unpaired, nothing hides it)."""
        if not self.all_to_all:
            return {FORWARD: self.forward, BACKWARD: self.backward, WEIGHT: self.weight}
        return {FORWARD: tuple(f + a for f, a in zip(self.forward, self.all_to_all)),
                BACKWARD: tuple(b + a for b, a in zip(self.backward, self.all_to_all)),
                WEIGHT: self.weight}

    def for_stages(self, num_stages: int) -> StageCosts:
        """The same model cut into ``num_stages`` equal stages: consecutive stages summed (a V
        schedule's 2D chunks -> D stages) or each stage split evenly (D -> 2D chunks)."""
        n = self.num_stages
        if num_stages == n:
            return self
        if n % num_stages == 0:
            k = n // num_stages

            def regroup(values: tuple[float, ...]) -> tuple[float, ...]:
                return tuple(sum(values[i * k:(i + 1) * k]) for i in range(num_stages))
        elif num_stages % n == 0:
            k = num_stages // n

            def regroup(values: tuple[float, ...]) -> tuple[float, ...]:
                return tuple(v / k for v in values for _ in range(k))
        else:
            raise ValueError(f"{FLAG}: costs of {n} stages cannot be cut into {num_stages}")
        return StageCosts(regroup(self.forward), regroup(self.backward), regroup(self.weight),
                          self.p2p, regroup(self.all_to_all) if self.all_to_all else ())

    def is_uniform(self) -> bool:
        """Whether every stage has the same F, B and W (and all-to-all time)."""
        return all(len(set(v)) <= 1 for v in (self.forward, self.backward, self.weight,
                                                self.all_to_all))

    def scaled(self, factor: float) -> StageCosts:
        """Every time (p2p included) times ``factor``."""
        return StageCosts(tuple(v * factor for v in self.forward),
                          tuple(v * factor for v in self.backward),
                          tuple(v * factor for v in self.weight), self.p2p * factor,
                          tuple(v * factor for v in self.all_to_all))

    def with_message_time_of(self, given: Any) -> StageCosts:
        """These (measured) costs with the message time of ``given`` (the ``--chimera-zb-costs``
        a run was started with), converted to these costs' unit by the ratio of the mean F's: a
        profiled rebuild measures F, B and W, not what a message costs, so a ``p2p=T`` the user
        gave still counts. Unchanged when ``given`` names no message time."""
        if not isinstance(given, StageCosts) or not given.p2p:
            return self
        ratio = (sum(self.forward) / len(self.forward)) / (sum(given.forward) / len(given.forward))
        return replace(self, p2p=given.p2p * ratio)

    def rounded(self, digits: int = 4) -> StageCosts:
        """Times rounded to ``digits`` significant digits relative to the mean F (so that ranks
        that agree up to the last bits build the same order)."""
        unit = sum(self.forward) / len(self.forward)
        scale = 10 ** (digits - 1 - math.floor(math.log10(unit)))

        def r(v: float) -> float:
            return max(round(v * scale), 1) / scale

        return StageCosts(tuple(map(r, self.forward)), tuple(map(r, self.backward)),
                          tuple(map(r, self.weight)), round(self.p2p * scale) / scale,
                          tuple(round(v * scale) / scale for v in self.all_to_all))

    def quantized(self, step: float = 0.05) -> StageCosts:
        """Times rounded to multiples of ``step`` x the mean F (at least one step; p2p may round
        to 0): an order built for them does not follow measurement noise below the step."""
        unit = step * sum(self.forward) / len(self.forward)

        def q(v: float) -> float:
            return max(round(v / unit), 1) * unit

        return StageCosts(tuple(map(q, self.forward)), tuple(map(q, self.backward)),
                          tuple(map(q, self.weight)), round(self.p2p / unit) * unit,
                          tuple(round(v / unit) * unit for v in self.all_to_all))

    def cost_model(self, split_backward: bool = True, **extra: Any) -> CostModel:
        """The simulator's cost model: a split schedule runs B and W, an unsplit one runs the
        whole backward B + W as one action. ``extra``: other CostModel fields."""
        whole = tuple(b + w for b, w in zip(self.backward, self.weight))
        if self.all_to_all:
            extra.setdefault("all_to_all_cost", self.all_to_all)
        return CostModel(forward_cost=self.forward, backward_cost=whole,
                         weight_cost=self.weight if split_backward else 0.0,
                         p2p_alpha=self.p2p, **extra)

    def to_dict(self) -> dict[str, Any]:
        """``{"F": [...], "B": [...], "W": [...], "p2p": x}`` and ``"A2A": [...]`` with MoE
        all-to-all times (the ``@file.json`` format)."""
        data = {"F": list(self.forward), "B": list(self.backward), "W": list(self.weight),
                "p2p": self.p2p}
        if self.all_to_all:
            data["A2A"] = list(self.all_to_all)
        return data

    def to_text(self) -> str:
        """The inline flag form ``F,B,W;F,B,W;...[;p2p=T][;a2a=A0,A1,...]`` (exact: floats in
        full)."""
        text = ";".join(f"{f!r},{b!r},{w!r}"
                        for f, b, w in zip(self.forward, self.backward, self.weight))
        text += f";p2p={self.p2p!r}" if self.p2p else ""
        return text + (";a2a=" + ",".join(map(repr, self.all_to_all)) if self.all_to_all
                       else "")

    def summary(self, unit: float = 1e-3, suffix: str = "ms") -> str:
        """Short per-stage text for log lines: ``s0 F/B/W 1.2/1.5/0.8 ms, ...``."""
        stages = ", ".join(f"s{s} {f / unit:.3g}/{b / unit:.3g}/{w / unit:.3g}"
                           for s, (f, b, w) in enumerate(zip(self.forward, self.backward,
                                                             self.weight)))
        a2a = (f"; all-to-all {', '.join(f'{v / unit:.3g}' for v in self.all_to_all)} {suffix}"
               if self.all_to_all else "")
        return f"F/B/W per stage [{suffix}]: {stages}; p2p {self.p2p / unit:.3g} {suffix}{a2a}"


def _triple(text: str, source: str) -> UniformCosts:
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{FLAG} must be F,B,W numbers, got {source!r}") from None
    if len(values) != 3 or any(not (math.isfinite(v) and v > 0) for v in values):
        raise ValueError(f"{FLAG} must be three positive numbers F,B,W per stage, got {source!r}")
    return values  # type: ignore[return-value]


def _from_json(data: Any, path: str) -> StageCosts:
    if isinstance(data, list):  # e.g. a list of records, each with "stage_costs"
        for record in data:
            if isinstance(record, Mapping) and "stage_costs" in record:
                return StageCosts.from_dict(record["stage_costs"])
        raise ValueError(f"{FLAG}: {path} is a list without a \"stage_costs\" entry")
    if isinstance(data, Mapping) and "stage_costs" in data:
        data = data["stage_costs"]
    if not isinstance(data, Mapping):
        raise ValueError(f"{FLAG}: {path} must hold a JSON object with \"F\", \"B\", \"W\"")
    return StageCosts.from_dict(data)


def load_costs(path: str) -> StageCosts:
    """Per-stage costs from a JSON file (see the module docstring)."""
    try:
        with open(path) as handle:
            data = json.load(handle)
    except OSError as exc:
        raise ValueError(f"{FLAG}: cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{FLAG}: {path} is not valid JSON ({exc.msg}, line {exc.lineno})") \
            from None
    return _from_json(data, path)


def parse_costs(text: str) -> UniformCosts | StageCosts:
    """``--chimera-zb-costs``: ``F,B,W`` -> a tuple; ``F,B,W;F,B,W;...`` or ``@file.json`` ->
    :class:`StageCosts` (ValueError naming the flag otherwise)."""
    text = text.strip()
    if text.startswith("@"):
        return load_costs(text[1:])
    if ";" not in text:
        return _triple(text, text)
    parts = [part.strip() for part in text.split(";") if part.strip()]
    a2a: tuple[float, ...] = ()
    if parts and parts[-1].startswith("a2a="):
        try:
            a2a = tuple(float(v) for v in parts.pop()[4:].split(","))
        except ValueError:
            raise ValueError(f"{FLAG}: a2a=A[,A...] needs numbers, got {text!r}") from None
    p2p = 0.0
    if parts and parts[-1].startswith("p2p="):
        try:
            p2p = float(parts.pop()[4:])
        except ValueError:
            raise ValueError(f"{FLAG}: p2p=T needs a number, got {text!r}") from None
    triples = [_triple(part, text) for part in parts]
    if not triples:
        raise ValueError(f"{FLAG} needs at least one F,B,W triple, got {text!r}")
    if len(a2a) == 1 and len(triples) > 1:
        a2a *= len(triples)
    return StageCosts(tuple(t[0] for t in triples), tuple(t[1] for t in triples),
                      tuple(t[2] for t in triples), p2p, a2a)


def costs_text(costs: UniformCosts | StageCosts) -> str:
    """The flag text of parsed costs (the inverse of :func:`parse_costs`)."""
    if isinstance(costs, StageCosts):
        return costs.to_text()
    return ",".join(repr(float(v)) for v in costs)
