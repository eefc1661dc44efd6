#!/usr/bin/env python
"""--sft training on many layouts against one process that runs every conversation on its own.

    tools/check_sft_equality.py [--iters 12] [--layouts 1f1b-D4 chimera-D4xW2 ...]

Writes a synthetic SFT dataset (conversations of 4-60 tokens, prompts untrained, responses
trained), computes the reference losses in this process (every conversation unpacked, the loss
the mean over the global batch's trained tokens, plain SGD:
:mod:`megatron_chimera.training.sft_reference`), then runs ``pretrain_gpt2.py --sft`` (packed
into --seq-length 64 with document masks) on each layout and prints each layout's largest
relative |Δloss| over every iteration. Exit 0 when every layout is within --rtol (fp32: 1e-5).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_chimera.errors import ToolArgumentParser, run_tool  # noqa: E402
from megatron_chimera.training import equivalence as eq  # noqa: E402
from megatron_chimera.training.sft_reference import (  # noqa: E402
    SGD_FLAGS,
    reference_losses,
    write_sft_dataset,
)

SCRIPT = Path(__file__).resolve().parents[1] / "pretrain_gpt2.py"
MODEL = ("--num-layers 8 --hidden-size 32 --num-attention-heads 4 --seq-length 64 "
         "--max-position-embeddings 64 --global-batch-size 8 --lr 0.5 "
         "--tokenizer-type NullTokenizer --vocab-size 500 --hidden-dropout 0 "
         "--attention-dropout 0 --num-workers 0 --eval-iters 0 --log-interval 1 "
         "--split 100,0,0 --distributed-timeout-minutes 2 --sft").split()
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
}


def sft_flags(data_path: str, iters: int) -> list[str]:
    """The shared flags of every run (model, data, SGD) for ``iters`` iterations."""
    return [*MODEL, *SGD_FLAGS, "--data-path", data_path, "--train-iters", str(iters)]


def main(argv: list[str] | None = None) -> int:
    parser = ToolArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--layouts", nargs="*", default=sorted(LAYOUTS), choices=sorted(LAYOUTS))
    parser.add_argument("--rtol", type=float, default=1e-5)
    parser.add_argument("--work-dir", type=Path)
    args = parser.parse_args(argv)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="sft-equality-"))
    work.mkdir(parents=True, exist_ok=True)
    data = write_sft_dataset(str(work / "chat"), 400, 500, (4, 60), seed=1)
    flags = sft_flags(data, args.iters)
    reference = reference_losses([*flags, "--micro-batch-size", "1"], args.iters)
    print(f"reference (each conversation alone): loss {reference[0]:.6f} -> "
          f"{reference[-1]:.6f} over {args.iters} iterations")
    worst_all = 0.0
    for name in args.layouts:
        ranks, extra = LAYOUTS[name]
        curves = eq.run(SCRIPT, [*flags, *extra], ranks, work / name)
        steps = sorted(curves.loss)
        if steps != list(range(1, args.iters + 1)):
            print(f"{name:22s} FAIL: logged iterations {steps}")
            worst_all = float("inf")
            continue
        worst = max(abs(curves.loss[i + 1] - want) / abs(want) for i, want in
                    enumerate(reference))
        worst_all = max(worst_all, worst)
        print(f"{name:22s} ranks {ranks}: max relative |Δloss| {worst:.2e} "
              f"{'ok' if worst <= args.rtol else 'FAIL'}")
    return 0 if worst_all <= args.rtol else 1


if __name__ == "__main__":
    run_tool(main)
