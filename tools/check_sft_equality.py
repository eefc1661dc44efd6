#!/usr/bin/env python
"""--sft training on many layouts against one process that runs every conversation on its own.

    tools/check_sft_equality.py [--iters 12] [--layouts 1f1b-D4 chimera-D4xW2 ...]
                                [--no-budget-check]

Writes a synthetic SFT dataset (conversations of 4-60 tokens, prompts untrained, responses
trained), computes the reference losses in this process (every conversation unpacked, the loss
the mean over the global batch's trained tokens, plain SGD:
:mod:`megatron_chimera.training.sft_reference`), then runs ``pretrain_gpt2.py --sft`` (packed
into --seq-length 64 with document masks; ``*-varlen`` layouts: into variable-length
micro-batches of at most 64 tokens, ``--variable-seq-lengths``) on each layout and prints each
layout's largest relative |Δloss| over every iteration.

The budget check trains packed variable-length SFT twice, with ``--micro-batch-tokens`` 64
(4 micro-batches a global batch) and 32 (8), on conversations in pairs of exactly 32 inputs,
so both packings put the same conversations in every global batch (checked first): the losses
must agree with each other and with the reference. Exit 0 when all is within --rtol (fp32: 1e-5).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_chimera.errors import ToolArgumentParser, run_tool  # noqa: E402
from megatron_chimera.training import equivalence as eq  # noqa: E402
from megatron_chimera.training.arguments import parse_args  # noqa: E402
from megatron_chimera.training.sft_reference import (  # noqa: E402
    SGD_FLAGS,
    global_batches,
    reference_losses,
    write_sft_dataset,
)
from megatron_chimera.training.training import build_tokenizer_for  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "pretrain_gpt2.py"
MODEL = ("--num-layers 8 --hidden-size 32 --num-attention-heads 4 --seq-length 64 "
         "--max-position-embeddings 64 --global-batch-size 8 --lr 0.5 "
         "--tokenizer-type NullTokenizer --vocab-size 500 --hidden-dropout 0 "
         "--attention-dropout 0 --num-workers 0 --eval-iters 0 --log-interval 1 "
         "--split 100,0,0 --distributed-timeout-minutes 2 --sft").split()
VARLEN = ["--micro-batch-size", "1", "--variable-seq-lengths", "--micro-batch-tokens", "64"]
# name: (ranks, flags); the micro-batch split differs between layouts (1, 2 or 4 per batch)
LAYOUTS = {
    "one-process-mbs1": (1, ["--micro-batch-size", "1"]),
    "one-process-mbs4": (1, ["--micro-batch-size", "4"]),
    "1f1b-D4": (4, ["--micro-batch-size", "1", "--pipeline-model-parallel-size", "4"]),
    "chimera-D4xW2": (4, ["--micro-batch-size", "1", "--pipeline-model-parallel-size", "4",
                          "--chimera-pipes", "2"]),
    "chimera-D4xW2-mbs2": (4, ["--micro-batch-size", "2", "--pipeline-model-parallel-size", "4",
                               "--chimera-pipes", "2"]),
    "chimera-D2xW2-DP2": (4, ["--micro-batch-size", "1", "--pipeline-model-parallel-size", "2",
                              "--chimera-pipes", "2"]),
    "zbv-D4": (4, ["--micro-batch-size", "1", "--pipeline-model-parallel-size", "4",
                   "--pipeline-schedule", "zbv"]),
    "chimera-zb-D2xT2-SP": (4, ["--micro-batch-size", "1", "--pipeline-model-parallel-size", "2",
                                "--pipeline-schedule", "chimera-zb",
                                "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "chimera-D2xCP2": (4, ["--micro-batch-size", "1", "--pipeline-model-parallel-size", "2",
                           "--chimera-pipes", "2", "--context-parallel-size", "2"]),
    "1f1b-D2-slices2": (2, ["--micro-batch-size", "1", "--pipeline-model-parallel-size", "2",
                            "--pipeline-sequence-slices", "2"]),
    "one-process-varlen": (1, VARLEN),
    "1f1b-D4-varlen": (4, [*VARLEN, "--pipeline-model-parallel-size", "4"]),
    "chimera-D4xW2-varlen": (4, [*VARLEN, "--pipeline-model-parallel-size", "4",
                                 "--chimera-pipes", "2"]),
    "chimera-zb-D2xT2-SP-varlen": (4, [*VARLEN, "--pipeline-model-parallel-size", "2",
                                       "--pipeline-schedule", "chimera-zb",
                                       "--tensor-model-parallel-size", "2",
                                       "--sequence-parallel"]),
    "zbv-D4-varlen": (4, [*VARLEN, "--pipeline-model-parallel-size", "4",
                          "--pipeline-schedule", "zbv"]),
    "chimera-D2xCP2-varlen": (4, [*VARLEN, "--pipeline-model-parallel-size", "2",
                                  "--chimera-pipes", "2", "--context-parallel-size", "2"]),
}
# the budget check: one layout, two token budgets (and global batches of as many micro-batches)
BUDGET_LAYOUT = ["--pipeline-model-parallel-size", "4", "--chimera-pipes", "2"]
BUDGETS = ((64, 4), (32, 8))


def sft_flags(data_path: str, iters: int) -> list[str]:
    """The shared flags of every run (model, data, SGD) for ``iters`` iterations."""
    return [*MODEL, *SGD_FLAGS, "--data-path", data_path, "--train-iters", str(iters)]


def relative_gap(curves: eq.Curves, want: list[float]) -> float:
    """Largest relative |Δloss| of ``curves`` against ``want`` (inf unless every iteration
    was logged)."""
    if sorted(curves.loss) != list(range(1, len(want) + 1)):
        return float("inf")
    return max(abs(curves.loss[i + 1] - w) / abs(w) for i, w in enumerate(want))


def check_layouts(flags: list[str], names: list[str], iters: int, rtol: float,
                  work: Path) -> float:
    """Every layout of ``names`` against the reference of its packing; the worst gap."""
    references: dict[bool, list[float]] = {}
    worst_all = 0.0
    for name in names:
        ranks, extra = LAYOUTS[name]
        varlen = "--variable-seq-lengths" in extra
        if varlen not in references:
            one = VARLEN if varlen else ["--micro-batch-size", "1"]
            references[varlen] = reference_losses([*flags, *one], iters)
            ref = references[varlen]
            frozen = reference_losses([*flags, *one, "--lr", "0"], iters)
            moved = max(abs(r - f) / f for r, f in zip(ref, frozen))
            packing = "variable-length micro-batches" if varlen else "--seq-length rows"
            print(f"reference ({packing}, each conversation alone): loss {ref[0]:.6f} -> "
                  f"{ref[-1]:.6f} over {iters} iterations; the weights move: max relative "
                  f"|Δloss| to a frozen model {moved:.2e}")
            if moved <= 100 * rtol:
                print("FAIL: the weights barely move, the comparison could not see a wrong step")
                worst_all = float("inf")
        curves = eq.run(SCRIPT, [*flags, *extra], ranks, work / name, checkpoints=False)
        worst = relative_gap(curves, references[varlen])
        worst_all = max(worst_all, worst)
        print(f"{name:28s} ranks {ranks}: max relative |Δloss| {worst:.2e} "
              f"{'ok' if worst <= rtol else 'FAIL'}")
    return worst_all


def check_budgets(iters: int, rtol: float, work: Path) -> float:
    """Two token budgets that pack the same conversations into every global batch: the losses
    agree with each other and with the reference; the worst gap (inf if the packings differ)."""
    pairs = 8 * iters + 8  # 8 pairs of 32 inputs per global batch, and to spare
    rng = np.random.default_rng(7)
    first = rng.integers(3, 30, pairs)  # inputs of a pair: a + (32 - a) = 32
    sizes = np.stack([first + 1, 33 - first], axis=1).reshape(-1)
    data = write_sft_dataset(str(work / "pairs"), 0, 500, (0, 0), seed=2, sizes=sizes)
    runs: list[tuple[list[float], eq.Curves]] = []
    batches = []
    for budget, batch in BUDGETS:
        flags = [*sft_flags(data, iters), *VARLEN[:-1], str(budget),
                 "--global-batch-size", str(batch)]
        config = parse_args(flags, world_size=1)
        tokenizer, config = build_tokenizer_for(config)
        batches.append([[ids.tobytes() for ids, _ in conversations]
                        for conversations in global_batches(config, tokenizer, iters)])
        reference = reference_losses(flags, iters)
        curves = eq.run(SCRIPT, [*flags, *BUDGET_LAYOUT], 4, work / f"budget-{budget}",
                        checkpoints=False)
        runs.append((reference, curves))
        print(f"budget {budget:3d} tokens, {batch} micro-batches a global batch: max relative "
              f"|Δloss| to its reference {relative_gap(curves, reference):.2e}")
    if batches[0] != batches[1]:
        print("budget check FAIL: the two packings put different conversations in a global batch")
        return float("inf")
    (ref_a, a), (ref_b, b) = runs
    between = relative_gap(b, [a.loss[i] for i in sorted(a.loss)])
    worst = max(between, relative_gap(a, ref_a), relative_gap(b, ref_b))
    print(f"budgets {BUDGETS[0][0]} vs {BUDGETS[1][0]} (same conversations in every global "
          f"batch): max relative |Δloss| {between:.2e} {'ok' if worst <= rtol else 'FAIL'}")
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = ToolArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--layouts", nargs="*", default=sorted(LAYOUTS), choices=sorted(LAYOUTS))
    parser.add_argument("--budget-check", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--rtol", type=float, default=1e-5)
    parser.add_argument("--work-dir", type=Path)
    args = parser.parse_args(argv)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="sft-equality-"))
    work.mkdir(parents=True, exist_ok=True)
    data = write_sft_dataset(str(work / "chat"), 400, 500, (4, 60), seed=1)
    worst = check_layouts(sft_flags(data, args.iters), args.layouts, args.iters, args.rtol, work)
    if args.budget_check:
        worst = max(worst, check_budgets(args.iters, args.rtol, work))
    return 0 if worst <= args.rtol else 1


if __name__ == "__main__":
    run_tool(main)
