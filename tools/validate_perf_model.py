#!/usr/bin/env python
"""Predicted vs measured iteration times of ``tools/benchmark_schedules.py`` (emulated compute),
or (``--published``) predicted vs published throughput of real clusters.

Examples::

    python tools/validate_perf_model.py bench.json --forward-ms 20 --backward-ms 40 \\
        --weight-ms 20 --measure-p2p
    python tools/validate_perf_model.py bench.json --forward-ms 20 --backward-ms 40 \\
        --allreduce-ms 60 --p2p-alpha-us 300   # rows of --grad-reduce none,end,stage,overlap
    python tools/validate_perf_model.py --published [--hardware a100] [--json out.json]
    python tools/validate_perf_model.py --published --zb-hardware my-roce-cluster.json
"""

from __future__ import annotations

import json

from megatron_chimera.errors import ToolArgumentParser, run_tool
from megatron_chimera.tuning.emulated_validation import EmulatedCompute, compare, format_comparison
from megatron_chimera.tuning.hardware import LinkProfile, load_hardware
from megatron_chimera.tuning.published_zb import QI_HARDWARE


def published(hardware_name: str, json_path: str | None, write_cache: bool = False,
              zb_hardware_name: str = QI_HARDWARE) -> int:
    """Print (and optionally write) the published-table comparisons: Table 1 (the issue's
    target), Table 2's PTD-P rows, Qi et al.'s zero-bubble Table 4 (priced on
    ``zb_hardware_name``) and the FP8 runs (all but Table 1 out of sample); ``write_cache``:
    store each family's error for --predict."""
    from megatron_chimera.tuning.published import (
        MEGATRON_SOURCE,
        MEGATRON_TABLE1,
        MEGATRON_TABLE2,
        MEGATRON_TABLE2_SOURCE,
        format_published,
        predict_run,
        summarize,
    )

    hardware = load_hardware(hardware_name)
    tables = {}
    for key, source, runs in (("table1", MEGATRON_SOURCE, MEGATRON_TABLE1),
                              ("table2", MEGATRON_TABLE2_SOURCE, MEGATRON_TABLE2)):
        rows = [predict_run(run, hardware) for run in runs]
        if key != "table1":
            print()
        print(format_published(rows, f"{source}; model: --hardware {hardware.name}"))
        summary = summarize(rows)
        tables[key] = {
            "source": source,
            "rows": [{"params": r.run.params, "gpus": r.run.gpus, "layout": r.layout.describe(),
                      "iteration_s": r.iteration_s, "predicted_tflops": r.predicted_tflops,
                      "published_tflops": r.run.tflops, "ratio": r.ratio} for r in rows],
            "mean_error": summary.mean_error, "worst": summary.worst.run.params,
            "spearman": summary.spearman}
    from megatron_chimera.tuning.published_zb import format_zb

    # Qi et al.'s zero-bubble rows are priced on the profile of their cluster
    zb_hardware = load_hardware(zb_hardware_name)
    zb_text, zb_record = format_zb(zb_hardware)
    print()
    print(zb_text)
    from megatron_chimera.tuning.published_fp8 import FP8_RUNS, format_fp8, predict_fp8_run

    h100 = load_hardware("h100")  # the FP8 runs' DGX H100
    fp8_rows = [predict_fp8_run(run, h100) for run in FP8_RUNS]
    print()
    print(format_fp8(fp8_rows, h100.name))
    if write_cache:
        from megatron_chimera.tuning.error_bars import CACHE, family_record, write_errors

        three_d = [abs(r["ratio"] - 1) for key in ("table1", "table2") for r in tables[key]["rows"]]
        zb_errors = [abs(p / q - 1) for row in zb_record["rows"]
                     for p, q in zip(row["predicted"].values(), row["published"].values(),
                                     strict=True) if p is not None]
        write_errors({
            "3D": family_record("Narayanan et al. SC'21 Tables 1-2 on "
                                f"{hardware.name}", three_d),
            "pure PP": family_record(f"Qi et al. ICLR'24 Table 4 on {zb_hardware.name}",
                                     zb_errors),
            "FP8": family_record("NeMo / Megatron-Bridge / torchtitan H100 FP8 runs on h100",
                                 [r.error for r in fp8_rows]),
            "Chimera": {"rows": 0}, "MoE": {"rows": 0}})
        print(f"\nwrote the family errors to {CACHE}")
    if json_path:
        records = {"hardware": hardware.name, **tables["table1"],
                   "out_of_sample": tables["table2"], "zero_bubble": zb_record,
                   "fp8": [{"source": r.run.source, "model": r.run.model,
                            "predicted": r.predicted, "published": r.run.published,
                            "ratio": r.ratio} for r in fp8_rows]}
        with open(json_path, "w") as f:
            json.dump(records, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Compare a benchmark JSON with the model's predictions, or the published tables."""
    p = ToolArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bench_json", nargs="?", default=None)
    p.add_argument("--published", action="store_true",
                   help="compare with Narayanan et al. SC'21 Table 1 and, out of sample, its "
                        "Table 2's PTD-P rows (megatron_chimera/tuning/published.py) and Qi et "
                        "al. ICLR'24 Table 4 (tuning/published_zb.py) and H100 FP8 runs "
                        "(tuning/published_fp8.py) instead of a benchmark JSON")
    p.add_argument("--hardware", default="a100",
                   help="with --published: the profile to predict with (preset or JSON file)")
    p.add_argument("--zb-hardware", default=QI_HARDWARE,
                   help="with --published: the profile Qi et al.'s Table 4 is priced on (their "
                        "A100 80 GB cluster; a JSON profile with that cluster's measured RoCE "
                        "link, for instance)")
    p.add_argument("--json", default=None, help="with --published: write the rows here")
    p.add_argument("--write-error-cache", action="store_true",
                   help="with --published (the default --hardware and --zb-hardware): store "
                        "each family's error for autotune.py --predict "
                        "(tuning/published_errors.json)")
    p.add_argument("--forward-ms", type=float)
    p.add_argument("--backward-ms", type=float)
    p.add_argument("--weight-ms", type=float, default=0.0)
    p.add_argument("--measure-p2p", action="store_true")
    p.add_argument("--p2p-alpha-us", type=float)
    p.add_argument("--action-overhead-us", type=float, default=0.0,
                   help="host time before each compute action (benchmark_schedules.py --trace "
                        "prints the run's: host costs ... ms per action; pass its ms per message "
                        "as --p2p-alpha-us)")
    p.add_argument("--allreduce-ms", type=float, default=0.0,
                   help="the benchmark's --allreduce-ms: rows with a grad_reduce mode are priced "
                        "with each stage's reduction taking this long")
    p.add_argument("--layers-per-stage", type=int, default=4,
                   help="the benchmark's --layers-per-stage (buckets final in turn, overlap)")
    args = p.parse_args(argv)
    if args.published:
        if args.bench_json is not None:
            p.error("--published takes no benchmark JSON")
        if args.write_error_cache and (args.hardware, args.zb_hardware) != ("a100", QI_HARDWARE):
            p.error(f"--write-error-cache scores the default profiles (--hardware a100, "
                    f"--zb-hardware {QI_HARDWARE})")
        return published(args.hardware, args.json, args.write_error_cache, args.zb_hardware)
    if args.bench_json is None:
        p.error("give a benchmark JSON (tools/benchmark_schedules.py --json) or --published")
    if args.forward_ms is None or args.backward_ms is None:
        p.error("--forward-ms and --backward-ms are required with a benchmark JSON")
    if args.measure_p2p == (args.p2p_alpha_us is not None):
        p.error("give exactly one of --measure-p2p and --p2p-alpha-us")
    if args.action_overhead_us < 0:
        p.error(f"--action-overhead-us must be >= 0, got {args.action_overhead_us}")
    if args.measure_p2p:
        from megatron_chimera.tuning.profile import measure_p2p_link

        link = measure_p2p_link()
    else:
        link = LinkProfile(args.p2p_alpha_us * 1e-6, float("inf"))
    with open(args.bench_json) as f:
        rows = json.load(f)
    compute = EmulatedCompute(args.forward_ms / 1e3, args.backward_ms / 1e3, args.weight_ms / 1e3)
    if args.allreduce_ms < 0 or args.layers_per_stage < 1:
        p.error("--allreduce-ms must be >= 0 and --layers-per-stage >= 1")
    records = compare(rows, compute, link, args.action_overhead_us * 1e-6,
                      args.allreduce_ms / 1e3, args.layers_per_stage)
    print(format_comparison(records, link))
    return 0


if __name__ == "__main__":
    run_tool(main)
