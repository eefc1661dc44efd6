"""Check that your training flags give the same numbers on other parallel layouts.

    tools/check_equivalence.py --layouts "T2,CP2,D2,chimera:W2" "1f1b,D4" -- <pretrain_gpt2 flags>

Builds a small proxy of your model (same layer kinds and settings, smaller width/depth), runs
--steps iterations on one process and on each layout with the same data and seed, and prints per
layout the largest relative |Δloss|, |Δgrad norm| and per-parameter difference, and the first
step that diverges beyond the precision's tolerance, naming the parameter whose gradient or value
left it first. Exit 0 when every layout agrees, 1 when one does not, 2 on a config that
does not fit. See docs/EQUIVALENCE.md.

``--against-flag FLAG`` compares each layout with FLAG against the same layout without it,
bitwise (any difference fails), keeping the user's dropout -- e.g. the MoE overlap (issue 48)::

    tools/check_equivalence.py --steps 12 --against-flag --overlap-moe-expert-parallel-comm \
        --layouts "chimera:W2,D4,DP2,EP2" -- <MoE flags> --hidden-dropout 0.1 ...
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_chimera.errors import ConfigError, ToolArgumentParser, run_tool  # noqa: E402
from megatron_chimera.training import equivalence as eq  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "pretrain_gpt2.py"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, user = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (
        argv, [])
    parser = ToolArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="*", default=[], help="target layouts")
    parser.add_argument("--layouts-file", type=Path, help="one layout per line")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rtol", type=float, help="default: 1e-5 fp32, 2e-2 bf16/fp16")
    parser.add_argument("--work-dir", type=Path)
    parser.add_argument("--keep-checkpoints", action="store_true",
                        help="keep each layout's per-step checkpoints under --work-dir")
    parser.add_argument("--precision-band", action="store_true",
                        help="instead of layouts: one process, --bf16 against fp32, and print the "
                             "divergence band (the GPU check runs it for 100 steps)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"),
                        help="cpu hides any GPU from the runs (a quick dry run)")
    parser.add_argument("--against-flag", metavar="FLAG",
                        help="each layout with FLAG against the same layout without it, bitwise "
                             "(dropout kept), instead of against one process")
    against = None
    if "--against-flag" in own:  # its value is itself a flag: take it before argparse does
        i = own.index("--against-flag")
        if i + 1 >= len(own):
            parser.error("--against-flag needs a flag, e.g. --overlap-moe-expert-parallel-comm")
        against, own = own[i + 1], own[:i] + own[i + 2:]
    args = parser.parse_args(own)
    args.against_flag = against
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if args.precision_band:
        return precision_band(user, args)
    try:
        texts = list(args.layouts)
        if args.layouts_file:
            texts += [ln.strip() for ln in args.layouts_file.read_text().splitlines()
                      if ln.strip() and not ln.startswith("#")]
        if not texts:
            raise ConfigError("no layout given (--layouts or --layouts-file)")
        layouts = [eq.parse_layout(t) for t in texts]
        flags = eq.proxy_flags(user, layouts, args.steps,
                               keep_dropout=args.against_flag is not None)
        if args.against_flag is not None:
            flags = [f for f in flags if f != args.against_flag]
        else:
            eq.check_fits(flags, eq.Layout("one process"))
        for layout in layouts:
            eq.check_fits(flags, layout)
            if args.against_flag is not None:
                eq.check_fits([*flags, args.against_flag], layout)
    except ConfigError as exc:
        print(f"check_equivalence: error: {exc}", file=sys.stderr)
        return 2
    if args.against_flag is not None:
        return against_flag(flags, layouts, args)
    rtol = args.rtol or eq.RTOL[eq.precision(flags)]
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="check-equivalence-"))
    print(f"proxy flags: {' '.join(flags)}", flush=True)
    reference = eq.run(SCRIPT, flags, 1, work / "one-process")
    _print_header(f"first divergence (rtol {rtol:g})")
    failed = False
    for i, layout in enumerate(layouts):
        try:
            curves = eq.run(SCRIPT, [*flags, *layout.flags()], layout.world_size,
                            work / f"layout-{i}")
            result = eq.compare(reference, curves, rtol)
            if not args.keep_checkpoints:
                shutil.rmtree(work / f"layout-{i}" / "ckpt", ignore_errors=True)
        except RuntimeError as exc:
            inf = float("inf")
            result = eq.Comparison(inf, inf, inf, f"run failed: {exc}")
        failed |= bool(result.first)
        _print_row(layout, result, result.first or "agrees")
    return 1 if failed else 0


def _print_header(last_column: str) -> None:
    """The table's header line: one row per layout follows, the last column ``last_column``."""
    print(f"{'layout':32s} {'ranks':>5s} {'max rel dloss':>14s} {'max rel dgnorm':>14s} "
          f"{'max rel dparam':>14s}  {last_column}")


def _print_row(layout: eq.Layout, result: eq.Comparison, verdict: str) -> None:
    """One layout's line under :func:`_print_header`."""
    print(f"{layout.text:32s} {layout.world_size:5d} {result.loss:14.3e} "
          f"{result.grad_norm:14.3e} {result.param:14.3e}  {verdict}", flush=True)


def against_flag(flags: list[str], layouts: list[eq.Layout], args: argparse.Namespace) -> int:
    """Each layout with ``args.against_flag`` against itself without it: every step's loss,
    grad norm and (per-step checkpoints) parameter must be bitwise equal."""
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="check-equivalence-"))
    print(f"proxy flags: {' '.join(flags)}", flush=True)
    _print_header(f"{args.against_flag} on vs off (bitwise)")
    failed = False
    for i, layout in enumerate(layouts):
        try:
            off = eq.run(SCRIPT, [*flags, *layout.flags()], layout.world_size,
                         work / f"layout-{i}-off")
            on = eq.run(SCRIPT, [*flags, *layout.flags(), args.against_flag],
                        layout.world_size, work / f"layout-{i}-on")
            result = eq.compare(off, on, 0.0)
            same = result.loss == result.grad_norm == result.param == 0.0 and bool(off.loss)
            verdict = "bitwise equal" if same else (result.first or "differs")
            if not args.keep_checkpoints:
                for side in ("off", "on"):
                    shutil.rmtree(work / f"layout-{i}-{side}" / "ckpt", ignore_errors=True)
        except RuntimeError as exc:
            inf = float("inf")
            result, same, verdict = eq.Comparison(inf, inf, inf, ""), False, f"run failed: {exc}"
        failed |= not same
        _print_row(layout, result, f"{verdict} ({len(off.loss) if same else '-'} steps)")
    return 1 if failed else 0


def precision_band(user: list[str], args: argparse.Namespace) -> int:
    """bf16 against fp32 on one process: the largest relative |Δloss| and |Δgrad norm|."""
    user = [f for f in user if f not in ("--bf16", "--fp16")]
    try:
        flags = eq.proxy_flags(user, [eq.Layout("one process")], args.steps)
        eq.check_fits(flags, eq.Layout("one process"))
    except ConfigError as exc:
        print(f"check_equivalence: error: {exc}", file=sys.stderr)
        return 2
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="check-equivalence-"))
    fp32 = eq.run(SCRIPT, flags, 1, work / "fp32", checkpoints=False)
    bf16 = eq.run(SCRIPT, [*flags, "--bf16"], 1, work / "bf16", checkpoints=False)
    result = eq.compare(fp32, bf16, float("inf"))
    print(f"bf16 vs fp32 over {args.steps} steps: max rel dloss {result.loss:.3e}, "
          f"max rel dgnorm {result.grad_norm:.3e}")
    return 0


if __name__ == "__main__":
    run_tool(main)
