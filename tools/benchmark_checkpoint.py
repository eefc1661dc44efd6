"""Checkpoint I/O per rank and the cost of saving, on a real training run (CPU ranks, gloo)::

    OMP_NUM_THREADS=1 python tools/benchmark_checkpoint.py --nproc 8 \
        --save-layout "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
                       --chimera-pipes 2 --use-distributed-optimizer" \
        --load-layout "--pipeline-model-parallel-size 4 --use-distributed-optimizer"

Runs ``pretrain_gpt2.py`` under torchrun on mock data (8 layers, hidden 128 unless ``--model``
says otherwise) four times: without saving (the baseline iteration time); with ``--save``
every ``--save-interval`` iterations, synchronously and with ``--async-save``; and resuming the
last checkpoint in ``--load-layout``. Reports, per rank, the bytes of checkpoint data it wrote
(its own DCP files) and read (counted by the reader: only the byte runs its pieces need), both
against its share (checkpoint size / ranks); the load time; the median iteration time without
a save, right after a synchronous save, and while an asynchronous save is in flight.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

from megatron_chimera.errors import ToolArgumentParser, run_tool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ("--num-layers 8 --hidden-size 128 --num-attention-heads 4 --seq-length 64 "
         "--max-position-embeddings 64 --micro-batch-size 1 --global-batch-size 16 --lr 1e-4 "
         "--mock-data --vocab-size 1000 --num-workers 0 --eval-iters 0 --log-interval 1 "
         "--distributed-timeout-minutes 2")
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ .*elapsed time per iteration \(ms\): ([\d.]+)")
LOADED = re.compile(r"loaded checkpoint .* in ([\d.]+) s; checkpoint bytes read per rank: "
                    r"\[([\d, ]+)\]")


def run(nproc: int, flags: list[str], walls: list[float] | None = None) -> str:
    """stdout of ``pretrain_gpt2.py flags`` on ``nproc`` ranks (fails loudly); its wall time
    is appended to ``walls``."""
    started = time.perf_counter()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", os.path.join(ROOT, "pretrain_gpt2.py"), *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    if walls is not None:
        walls.append(time.perf_counter() - started)
    return proc.stdout


def iteration_ms(stdout: str) -> dict[int, float]:
    """Logged time of every iteration (``--log-interval 1``)."""
    return {int(i): float(ms) for i, ms in ITERATION.findall(stdout)}


def after_saves(times: dict[int, float], interval: int, first: int = 2) -> tuple[list, list]:
    """(iterations right after a save, the others), skipping the first ``first`` (warm-up)."""
    during = [ms for i, ms in times.items() if i > first and (i - 1) % interval == 0 and i > 1]
    other = [ms for i, ms in times.items() if i > first and (i - 1) % interval != 0]
    return during, other


def written_per_rank(directory: str, nproc: int) -> list[int]:
    """Bytes of the DCP data files each rank wrote into one checkpoint directory."""
    return [sum(os.path.getsize(p) for p in glob.glob(os.path.join(directory, f"__{r}_*")))
            for r in range(nproc)]


def main(argv: list[str] | None = None) -> None:
    """Run the four trainings and print the table."""
    parser = ToolArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--save-layout", default="--tensor-model-parallel-size 2 "
                        "--pipeline-model-parallel-size 2 --chimera-pipes 2 "
                        "--use-distributed-optimizer")
    parser.add_argument("--load-layout", default="--pipeline-model-parallel-size 4 "
                        "--use-distributed-optimizer")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--iters", type=int, default=13)
    parser.add_argument("--save-interval", type=int, default=4)
    args = parser.parse_args(argv)
    base = shlex.split(args.model) + ["--train-iters", str(args.iters)]
    save_layout, load_layout = shlex.split(args.save_layout), shlex.split(args.load_layout)
    with tempfile.TemporaryDirectory(prefix="ckpt_bench_") as tmp:
        walls: list[float] = []
        plain = iteration_ms(run(args.nproc, [*base, *save_layout], walls))
        saving = ["--save-interval", str(args.save_interval)]
        sync = iteration_ms(run(args.nproc, [*base, *save_layout, "--save",
                                             os.path.join(tmp, "sync"), *saving], walls))
        ckpt = os.path.join(tmp, "async")
        asynchronous = iteration_ms(run(args.nproc, [*base, *save_layout, "--save", ckpt,
                                                     *saving, "--async-save"], walls))
        last = max(int(d[-7:]) for d in glob.glob(os.path.join(ckpt, "iter_*"))
                   if d[-7:].isdigit())
        written = written_per_rank(os.path.join(ckpt, f"iter_{last:07d}"), args.nproc)
        loaded = LOADED.search(run(args.nproc, [*shlex.split(args.model), *load_layout,
                                                "--train-iters", str(last + 1), "--load", ckpt]))
    read = [int(x) for x in loaded.group(2).split(",")]
    share = sum(written) / args.nproc
    print(f"checkpoint data: {sum(written)} B over {args.nproc} ranks (share {share:.0f} B)")
    print("| rank | written (B) | written / share | read on resume (B) | read / share |")
    print("|---|---|---|---|---|")
    for rank in range(args.nproc):
        print(f"| {rank} | {written[rank]} | {written[rank] / share:.2f} | {read[rank]} | "
              f"{read[rank] / share:.2f} |")
    med = statistics.median
    sync_during, _ = after_saves(sync, args.save_interval)
    async_during, async_other = after_saves(asynchronous, args.save_interval)
    plain_ms = med([ms for i, ms in plain.items() if i > 2])
    saves = args.iters // args.save_interval + (args.iters % args.save_interval != 0)
    print(f"\nload time ({args.load_layout}): {float(loaded.group(1)):.2f} s")
    print(f"run wall time added per save (vs no save, {saves} saves): synchronous "
          f"{(walls[1] - walls[0]) / saves:.2f} s, "
          f"--async-save {(walls[2] - walls[0]) / saves:.2f} s")
    print("| iteration time (ms, median) | value | / no save |")
    print("|---|---|---|")
    rows = (("no save", plain_ms), ("sync run, iteration after a save", med(sync_during)),
            ("while an async save is in flight", med(async_during)),
            ("async run, other iterations", med(async_other)))
    for what, value in rows:
        print(f"| {what} | {value:.1f} | {value / plain_ms:.2f} |")


if __name__ == "__main__":
    run_tool(main)
