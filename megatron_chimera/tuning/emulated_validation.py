"""Predicted vs measured iteration times of ``tools/benchmark_schedules.py`` (emulated compute).

The benchmark's stages sleep known times, so the performance model is given exactly those costs
(:class:`EmulatedCompute`) and a point-to-point link measured here by ping-pong; its predictions
are compared with the measured medians (``tools/validate_perf_model.py``).

Rows with a gradient reduction (``benchmark_schedules.py --allreduce-ms R --grad-reduce ...``)
are priced with each stage's reduction taking R on the emulated link, started as the row's mode
says (the simulator's ``CostModel.grad_reduce``: ``end``, eager ``stage``, or ``overlap`` with the
stage's layers becoming final one after another in its last backward); ``none`` rows have none.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

from megatron_chimera.config import ModelConfig
from megatron_chimera.schedules.chimera import CONCAT_NAMES
from megatron_chimera.schedules.registry import get_spec
from megatron_chimera.schedules.simulate import simulate
from megatron_chimera.tuning.analytic_costs import ModelSpec, StagePiece
from megatron_chimera.tuning.hardware import HardwareProfile, LinkProfile
from megatron_chimera.tuning.perf_model import PerformanceModel, StageTimes
from megatron_chimera.tuning.training_plan import TrainingPlan

LAYERS_PER_RANK = 4  # enough for interleaved v = 2 and 4 in the emulated model


@dataclass(frozen=True)
class EmulatedCompute:
    """Per-stage times of the emulated benchmark: a rank's whole share (``LAYERS_PER_RANK``
    layers) costs ``forward_s`` / ``backward_s`` / ``weight_s``; a chunk pays its fraction."""

    forward_s: float
    backward_s: float
    weight_s: float

    def stage_times(self, piece: StagePiece, micro_batch: int, recompute: bool) -> StageTimes:
        """Times scaled by the stage's share of a rank's layers."""
        share = piece.num_layers / LAYERS_PER_RANK
        return StageTimes(self.forward_s * share, self.backward_s * share, self.weight_s * share)


def emulated_model(D: int, compute: EmulatedCompute, link: LinkProfile,
                   action_overhead_s: float = 0.0) -> PerformanceModel:
    """A performance model of the emulated stages on ``D`` local ranks (one "node"), the host
    spending ``action_overhead_s`` before each compute action."""
    config = ModelConfig(num_layers=D * LAYERS_PER_RANK, hidden_size=4, num_attention_heads=1,
                         seq_length=8, vocab_size=8, make_vocab_size_divisible_by=8)
    hardware = HardwareProfile("local", 1.0, 1.0, 1.0, 1e3, 1 << 20, link, link,
                               action_overhead_s=action_overhead_s)
    return PerformanceModel(ModelSpec(config, "gpt2"), hardware, compute=compute, p2p_link=link,
                            device_type="cpu")


def layout_of_row(row: dict, model: PerformanceModel | None = None) -> TrainingPlan:
    """The layout a benchmark row ran (B = 1; its ``W``, 1 when the row does not say).

    The row's ``costs`` option names what a split-backward order was built for: ``unit`` (the
    generator's default 1,1,1), else (known, or rebuilt for the measured ones after
    ``profile=K``) the emulated stage costs, which ``model`` supplies, and the message time of
    its ``p2p_us`` option (0 without).
    """
    spec = get_spec(row["schedule"])
    fields = {f.name for f in spec.option_fields()}
    given = row.get("options") or {}
    options = {k: v for k, v in given.items() if k in fields and k != "costs"}
    if "pipes" in fields and row.get("pipes"):
        options.setdefault("pipes", row["pipes"])
    if "concat" in fields and row.get("concat") in CONCAT_NAMES:  # the basic unit has none
        options.setdefault("concat", row["concat"])
    layout = TrainingPlan.of(row["schedule"], row["D"], row.get("W", 1), 1, row["N"], **options)
    if model is not None and spec.split_backward and given.get("costs") != "unit":
        costs = dataclasses.replace(model.stage_costs(layout),
                                    p2p=float(given.get("p2p_us", 0)) * 1e-6)
        layout = dataclasses.replace(layout, options=dataclasses.replace(layout.options,
                                                                         costs=costs))
    return layout


def reduced_seconds(model: PerformanceModel, layout: TrainingPlan, reduce_s: float, mode: str,
                    layers_per_stage: int) -> float:
    """The simulated iteration of ``layout`` when each stage's gradient reduction takes
    ``reduce_s`` on the rank's one emulated link, started as ``mode`` says."""
    schedule = model.schedule(layout)
    replicas = schedule.num_pipes * layout.W
    share = 2 * (replicas - 1) / replicas if replicas > 1 else 1.0
    costs = dataclasses.replace(model.cost_model(layout), allreduce_alpha=0.0,
                                allreduce_beta=1.0 / share, grad_bytes=reduce_s,
                                grad_reduce=mode, grad_buckets=layers_per_stage,
                                allreduce_channels=1)
    return simulate(schedule, costs).makespan


def compare(rows: list[dict], compute: EmulatedCompute, link: LinkProfile,
            action_overhead_s: float = 0.0, reduce_s: float = 0.0,
            layers_per_stage: int = 4) -> list[dict]:
    """Per row: the layout, measured and predicted seconds and the relative error (rows with a
    ``grad_reduce`` option other than ``none``: each stage's reduction ``reduce_s``)."""
    result = []
    for row in rows:
        if row.get("measured_s") is None or row["schedule"].startswith("torch-"):
            continue
        model = emulated_model(row["D"], compute, link, action_overhead_s)
        layout = layout_of_row(row, model)
        mode = (row.get("options") or {}).get("grad_reduce")
        if mode in (None, "none") or reduce_s <= 0:
            predicted = model.predict(layout).iteration_s
        else:
            predicted = reduced_seconds(model, layout, reduce_s, mode, layers_per_stage)
        built_for = (row.get("options") or {}).get("p2p_us")  # the row's message time
        label = layout.describe() + (f" (built for p2p {built_for} us)" if built_for else "")
        label += f" reduce={mode}" if mode else ""
        result.append({"layout": label, "measured_s": row["measured_s"],
                       "predicted_s": predicted,
                       "relative_error": abs(predicted - row["measured_s"]) / row["measured_s"]})
    return result


def format_comparison(records: list[dict], link: LinkProfile) -> str:
    """Markdown table plus mean and max relative error."""
    lines = [f"p2p link: alpha {link.alpha_s * 1e6:.0f} us, {link.bandwidth_gbps:.2f} GB/s", "",
             "| layout | measured s | predicted s | relative error |", "|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['layout']} | {r['measured_s']:.3f} | {r['predicted_s']:.3f} | "
                     f"{100 * r['relative_error']:.1f}% |")
    errors = [r["relative_error"] for r in records]
    if errors:
        lines.append(f"\n{len(errors)} configurations: mean relative error "
                     f"{100 * statistics.mean(errors):.1f}%, max {100 * max(errors):.1f}%")
    return "\n".join(lines)
