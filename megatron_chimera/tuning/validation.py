"""Predicted vs measured iteration times of ``tools/benchmark_schedules.py`` (emulated compute).

The benchmark's stages sleep known times, so the performance model is given exactly those costs
(:class:`EmulatedCompute`) and a point-to-point link measured here by ping-pong; its predictions
are compared with the measured medians::

    python -m megatron_chimera.tuning.validation bench.json --forward-ms 20 --backward-ms 40 \\
        --weight-ms 20 --measure-p2p
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
from dataclasses import dataclass

from megatron_chimera.config import ModelConfig
from megatron_chimera.tuning.costs import ModelSpec, StageSlice
from megatron_chimera.tuning.hardware import HardwareProfile, LinkProfile
from megatron_chimera.tuning.perf_model import PerformanceModel, StageTimes, TrainingLayout

LAYERS_PER_RANK = 4  # enough for interleaved v = 2 and 4 in the emulated model


@dataclass(frozen=True)
class EmulatedCompute:
    """Per-stage times of the emulated benchmark: a rank's whole share (``LAYERS_PER_RANK``
    layers) costs ``forward_s`` / ``backward_s`` / ``weight_s``; a chunk pays its fraction."""

    forward_s: float
    backward_s: float
    weight_s: float

    def stage_times(self, piece: StageSlice, micro_batch: int, recompute: bool) -> StageTimes:
        """Times scaled by the stage's share of a rank's layers."""
        share = piece.num_layers / LAYERS_PER_RANK
        return StageTimes(self.forward_s * share, self.backward_s * share, self.weight_s * share)


def emulated_model(D: int, compute: EmulatedCompute, link: LinkProfile) -> PerformanceModel:
    """A performance model of the emulated stages on ``D`` local ranks (one "node")."""
    config = ModelConfig(num_layers=D * LAYERS_PER_RANK, hidden_size=4, num_attention_heads=1,
                         seq_length=8, vocab_size=8, make_vocab_size_divisible_by=8)
    hardware = HardwareProfile("local", 1.0, 1.0, 1.0, 1e3, 1 << 20, link, link)
    return PerformanceModel(ModelSpec(config, "gpt2"), hardware, compute=compute, p2p_link=link,
                            device_type="cpu")


def layout_of_row(row: dict) -> TrainingLayout:
    """The layout a benchmark row ran (W = 1, B = 1)."""
    options = row.get("options") or {}
    concat = row.get("concat") if row["schedule"] == "chimera" else None
    if concat not in importlib.import_module("megatron_chimera.schedules.chimera").CONCAT_NAMES:
        concat = None  # the basic unit (N = D) has no concatenation
    return TrainingLayout(row["schedule"], row["D"], 1, 1, row["N"], pipes=row.get("pipes") or 1,
                          concat=concat, virtual=options.get("virtual_pipeline_size", 1))


def compare(rows: list[dict], compute: EmulatedCompute, link: LinkProfile) -> list[dict]:
    """Per row: the layout, measured and predicted seconds and the relative error."""
    result = []
    for row in rows:
        if row.get("measured_s") is None or row["schedule"].startswith("torch-"):
            continue
        layout = layout_of_row(row)
        predicted = emulated_model(layout.D, compute, link).predict(layout).iteration_s
        result.append({"layout": layout.describe(), "measured_s": row["measured_s"],
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


def main(argv: list[str] | None = None) -> int:
    """Compare a benchmark JSON with the model's predictions."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bench_json")
    p.add_argument("--forward-ms", type=float, required=True)
    p.add_argument("--backward-ms", type=float, required=True)
    p.add_argument("--weight-ms", type=float, default=0.0)
    link_group = p.add_mutually_exclusive_group(required=True)
    link_group.add_argument("--measure-p2p", action="store_true")
    link_group.add_argument("--p2p-alpha-us", type=float)
    args = p.parse_args(argv)
    if args.measure_p2p:
        from megatron_chimera.tuning.profile import measure_p2p_link

        link = measure_p2p_link()
    else:
        link = LinkProfile(args.p2p_alpha_us * 1e-6, float("inf"))
    with open(args.bench_json) as f:
        rows = json.load(f)
    compute = EmulatedCompute(args.forward_ms / 1e3, args.backward_ms / 1e3, args.weight_ms / 1e3)
    print(format_comparison(compare(rows, compute, link), link))
    return 0


if __name__ == "__main__":
    sys.exit(main())
