#!/usr/bin/env python
"""Chimera vs the baselines: predicted throughput and (``--measure``) emulated-compute timings.

Example (the paper's 64-layer GPT-2 on 32 P100s, 8 stages)::

    python examples/demo_performance.py --model gpt2-64 --num-gpus 32 -D 8 -N 32
    python examples/demo_performance.py -D 4 -N 8 --measure      # also time them on this machine

Predicted: the performance model (``megatron_chimera.tuning.perf_model``: analytic stage times of
the model on ``--hardware``, alpha-beta communication, eager gradient all-reduce, all run through
the schedule simulator) gives the iteration time, samples/s, bubble ratio and peak memory of every
schedule at the same D, W = GPUs / D, micro-batch size B and N micro-batches.

Measured (``--measure``): ``torchrun --nproc-per-node D tools/benchmark_schedules.py`` runs the
same schedules with the real executor and stages that sleep instead of computing. The sleeps keep
the model's forward : backward : weight-gradient ratios, scaled to ``--emulated-forward-ms``; the
table shows measured and simulated iteration times and throughput relative to 1F1B.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from megatron_chimera.config import ConfigError
from megatron_chimera.model.presets import DTYPES, SIZE_FLAGS, add_model_arguments, make_model
from megatron_chimera.tuning.analytic_costs import ModelSpec
from megatron_chimera.tuning.hardware import GB, GIB, load_hardware
from megatron_chimera.tuning.perf_model import (
    PerformanceModel,
    Prediction,
    TrainingPlan,
)

ROOT = Path(__file__).resolve().parent.parent

# (label, TrainingPlan options, tools/benchmark_schedules.py --schedules spec)
VARIANTS = (
    ("gpipe", {"schedule": "gpipe"}, "gpipe"),
    ("1f1b", {"schedule": "1f1b"}, "1f1b"),
    ("interleaved v=2", {"schedule": "interleaved", "virtual_pipeline_size": 2},
     "interleaved:virtual_pipeline_size=2"),
    ("zb-h1", {"schedule": "zb-h1"}, "zb-h1"),
    ("chimera/direct", {"schedule": "chimera", "pipes": 2, "concat": "direct"},
     "chimera:concat=direct"),
    ("chimera/forward-doubling", {"schedule": "chimera", "pipes": 2,
                                  "concat": "forward-doubling"},
     "chimera:concat=forward-doubling"),
    ("chimera/slot-merge", {"schedule": "chimera", "pipes": 2, "concat": "slot-merge"},
     "chimera:concat=slot-merge"),
    ("chimera 4 pipes", {"schedule": "chimera", "pipes": 4}, "chimera:pipes=4"),
    ("chimera-zb", {"schedule": "chimera-zb", "pipes": 2}, "chimera-zb"),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Model, machine, layout and the optional emulated measurement."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    add_model_arguments(p, default="gpt2-64")
    p.add_argument("--params-dtype", choices=DTYPES, default="fp32")
    p.add_argument("--hardware", default="p100", help="p100, a100, h100 or a JSON profile")
    p.add_argument("--num-gpus", type=int, default=None, help="GPUs (default D: W = 1)")
    p.add_argument("--pipeline-model-parallel-size", "-D", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--num-microbatches", "-N", type=int, default=32)
    p.add_argument("--recompute", action="store_true",
                   help="predict with full activation recomputation (less memory, more work)")
    p.add_argument("--measure", action="store_true",
                   help="also run the schedules with emulated compute (torchrun, D processes)")
    p.add_argument("--emulated-forward-ms", type=float, default=10.0,
                   help="sleep of one emulated forward (default 10 ms)")
    p.add_argument("--iters", type=int, default=5, help="measured iterations (median, >= 5)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for the measurement")
    return p.parse_args(argv)


def predict_all(model: PerformanceModel, D: int, W: int, B: int, N: int, recompute: bool = False
                ) -> list[tuple[str, str, Prediction | str]]:
    """(label, benchmark spec, prediction or the reason it does not apply) per variant."""
    rows = []
    for label, options, spec in VARIANTS:
        schedule_options = {k: v for k, v in options.items() if k != "schedule"}
        layout = TrainingPlan.of(options["schedule"], D, W, B, N, recompute,
                                   **schedule_options)
        try:
            rows.append((label, spec, model.predict(layout)))
        except (ValueError, ConfigError) as exc:
            rows.append((label, spec, str(exc).splitlines()[0]))
    return rows


def format_predictions(rows: list[tuple[str, str, Prediction | str]], limit: int) -> str:
    """Table: iteration time, samples/s, speedup over 1F1B, bubble ratio, peak memory."""
    base = next(p for label, _, p in rows if label == "1f1b")
    header = (f"{'schedule':<26}{'iter [s]':>10}{'samples/s':>11}{'vs 1F1B':>9}{'bubble':>8}"
              f"{'peak GiB':>10}{'fits':>6}")
    lines = [header, "-" * len(header)]
    for label, _, p in rows:
        if isinstance(p, str):
            lines.append(f"{label:<26}n/a: {p}")
            continue
        speedup = base.iteration_s / p.iteration_s if isinstance(base, Prediction) else 0.0
        lines.append(f"{label:<26}{p.iteration_s:>10.4f}{p.samples_per_s:>11.2f}"
                     f"{speedup:>9.3f}{p.bubble_ratio:>8.3f}{p.peak_memory_bytes / GIB:>10.2f}"
                     f"{'yes' if p.peak_memory_bytes <= limit else 'no':>6}")
    return "\n".join(lines)


def emulated_ms(model: PerformanceModel, D: int, W: int, B: int, N: int,
                forward_ms: float) -> tuple[float, float, float]:
    """Mean forward, whole backward and weight-gradient times of a stage (from the split-backward
    cost model of zb-h1), scaled so that the forward takes ``forward_ms``."""
    costs = model.cost_model(TrainingPlan("zb-h1", D, W, B, N))
    mean = [sum(c) / len(c) for c in (costs.forward_cost, costs.backward_cost, costs.weight_cost)]
    scale = forward_ms / mean[0]
    return mean[0] * scale, mean[1] * scale, mean[2] * scale


def measure(specs: list[str], D: int, N: int, ms: tuple[float, float, float],
            args: argparse.Namespace) -> list[dict]:
    """Run tools/benchmark_schedules.py under torchrun; its JSON rows."""
    with tempfile.TemporaryDirectory(prefix="demo_performance_") as tmp:
        out = os.path.join(tmp, "bench.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={D}", str(ROOT / "tools" / "benchmark_schedules.py"),
               "-D", str(D), "--num-microbatches", str(N), "--forward-ms", f"{ms[0]:.4f}",
               "--backward-ms", f"{ms[1]:.4f}", "--weight-ms", f"{ms[2]:.4f}",
               "--iters", str(args.iters), "--warmup", "1", "--schedules", ",".join(specs),
               "--json", out]
        shown = ["torchrun", *cmd[3:]]
        shown[4] = os.path.relpath(shown[4], ROOT)
        print("running: " + " ".join(shown), flush=True)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            _, err = proc.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers
            proc.communicate()
            raise ConfigError(
                f"the measurement took longer than --timeout {args.timeout:g} s") from None
        if proc.returncode != 0:
            raise RuntimeError(f"benchmark failed (exit {proc.returncode}):\n{err[-3000:]}")
        with open(out) as handle:
            return json.load(handle)


def format_measurements(rows: list[dict], labels: dict[str, str]) -> str:
    """Table: measured and simulated seconds, and throughput relative to 1F1B for both."""
    base = next((r for r in rows if r["schedule"] == "1f1b" and not r["options"]), None)
    header = (f"{'schedule':<26}{'measured s':>12}{'simulated s':>13}{'measured vs 1F1B':>18}"
              f"{'simulated vs 1F1B':>19}")
    lines = [header, "-" * len(header)]
    for r in rows:
        spec = ":".join([r["schedule"], *(f"{k}={v}" for k, v in r["options"].items())])
        rel_m = base["measured_s"] / r["measured_s"] if base else float("nan")
        rel_s = base["simulated_s"] / r["simulated_s"] if base else float("nan")
        lines.append(f"{labels.get(spec, spec):<26}{r['measured_s']:>12.4f}"
                     f"{r['simulated_s']:>13.4f}{rel_m:>18.3f}{rel_s:>19.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the predicted table and, with --measure, the emulated measurement."""
    args = parse_args(argv)
    D, B, N = args.pipeline_model_parallel_size, args.micro_batch_size, args.num_microbatches
    gpus = args.num_gpus or D
    try:
        if min(D, B, N, gpus) < 1 or gpus % D:
            raise ConfigError(f"--num-gpus {gpus} must be a positive multiple of "
                              f"--pipeline-model-parallel-size {D}; -N and --micro-batch-size "
                              "must be positive")
        if args.emulated_forward_ms <= 0 or args.iters < 5:
            raise ConfigError("--emulated-forward-ms must be positive and --iters >= 5")
        family, config = make_model(args.model, args.model_type, args.params_dtype,
                                    **{f: getattr(args, f) for f in SIZE_FLAGS})
        spec = ModelSpec(config, family)
        hardware = load_hardware(args.hardware)
        model = PerformanceModel(spec, hardware)
        W = gpus // D
        limit = int(hardware.memory_gb * GB * 0.9)
        rows = predict_all(model, D, W, B, N, args.recompute)
        print(f"{args.model}: {config.num_layers} layers, hidden {config.hidden_size}, "
              f"{config.params_dtype}; {gpus} x {hardware.name} ({hardware.memory_gb:g} GB, 90% "
              f"usable); D={D} W={W} B={B} N={N}, global batch {B * N * W}"
              f"{', full recomputation' if args.recompute else ''}\n")
        print("predicted (performance model):")
        print(format_predictions(rows, limit))
        if not args.measure:
            return 0
        ms = emulated_ms(model, D, W, B, N, args.emulated_forward_ms)
        print(f"\nmeasured with emulated compute on this machine ({D} processes, W=1): forward "
              f"{ms[0]:.2f} ms, backward {ms[1]:.2f} ms (weight gradient {ms[2]:.2f} ms) per "
              "stage and micro-batch", flush=True)
        specs = [s for _, s, p in rows if isinstance(p, Prediction)]
        measured = measure(specs, D, N, ms, args)
        print(format_measurements(measured, {s: label for label, s, _ in rows}))
    except (ValueError, ConfigError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
