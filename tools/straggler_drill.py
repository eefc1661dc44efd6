"""Straggler drill: is a slow rank named, and do clean runs stay silent? (CPU ranks, gloo)::

    OMP_NUM_THREADS=1 python tools/straggler_drill.py            # 8 ranks, Chimera D=4 x W=2

Runs ``pretrain_gpt2.py`` under torchrun on mock data three times with the same layout:

1. ``--log-straggler``, ``--clean-iters`` iterations, nothing slowed: every straggler line is a
   false alarm (target 0 over 200 iterations);
2. ``--log-straggler`` with one rank's compute stretched by ``--slowdown`` (CPU time burnt
   inside each of its compute actions, ``MEGATRON_CHIMERA_SLOW_RANK``): the log interval at
   which the rank is first named, and the line (target: within 5 log intervals);
3. as 1 without ``--log-straggler``: the median iteration time against run 1's (the detector's
   added iteration time, target <= 2%; on a shared machine this ratio carries the machine's
   noise, so the detector's own CPU time per log interval is printed too, measured in-process
   on the gathered figures of run 1's size).
"""

from __future__ import annotations

import os
import random
import re
import shlex
import statistics
import subprocess
import sys
import time

from megatron_chimera.errors import ToolArgumentParser, run_tool
from megatron_chimera.schedules.registry import build_schedule
from megatron_chimera.training.straggler import StragglerDetector, expected_busy_by_kind

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ("--num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
         "--max-position-embeddings 64 --micro-batch-size 1 --global-batch-size 16 --lr 1e-4 "
         "--mock-data --vocab-size 500 --num-workers 0 --eval-iters 0 "
         "--distributed-timeout-minutes 3")
LAYOUT = "--pipeline-model-parallel-size 4 --chimera-pipes 2"
ITERATION = re.compile(r" iteration\s+(\d+)/\s*\d+ .*elapsed time per iteration \(ms\): ([\d.]+)")
STRAGGLER = re.compile(r" straggler: (.*?) slower than its peers")


def run(nproc: int, flags: list[str], env: dict[str, str] | None = None) -> list[str]:
    """The ranks' stdout lines of ``pretrain_gpt2.py flags`` on ``nproc`` ranks (fails loudly)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", os.path.join(ROOT, "pretrain_gpt2.py"), *flags]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout.splitlines()


def named_at(lines: list[str], log_interval: int) -> list[tuple[int, int, str]]:
    """(log interval, rank, line) of every straggler line: the interval of the iteration
    logged just before it."""
    found, iteration = [], 0
    for line in lines:
        if m := ITERATION.search(line):
            iteration = int(m.group(1))
        elif m := STRAGGLER.search(line):
            found += [(iteration // log_interval, int(rank), line.strip())
                      for rank in re.findall(r"rank (\d+) \(", m.group(1))]
    return found


def median_iteration_ms(lines: list[str], skip: int = 5) -> float:
    """Median logged iteration time (ms), the first ``skip`` iterations left out."""
    times = [float(m.group(2)) for line in lines if (m := ITERATION.search(line))
             and int(m.group(1)) > skip]
    return statistics.median(times)


def detector_cost(nproc: int, log_interval: int, repeats: int = 200) -> float:
    """Seconds the detector spends per log interval on ``nproc`` ranks' figures."""
    schedule = build_schedule("chimera", num_ranks=4, num_microbatches=8)
    kinds = expected_busy_by_kind(schedule, [2.0] * 4, [r // 2 for r in range(nproc)])
    detector = StragglerDetector([sum(k.values()) for k in kinds], expected_kinds=kinds)
    rng = random.Random(0)
    rows = [[{k: v * rng.uniform(0.9, 1.1) for k, v in kinds[r].items()} for r in range(nproc)]
            for _ in range(log_interval)]
    busy = [[sum(k.values()) for k in row] for row in rows]
    started = time.perf_counter()
    for _ in range(repeats):
        detector.observe(busy, rows)
    return (time.perf_counter() - started) / repeats


def main(argv: list[str] | None = None) -> None:
    """Run the three trainings and print the figures."""
    parser = ToolArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--layout", default=LAYOUT)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--log-interval", type=int, default=5)
    parser.add_argument("--clean-iters", type=int, default=200)
    parser.add_argument("--slow-iters", type=int, default=50)
    parser.add_argument("--slow-rank", type=int, default=5)
    parser.add_argument("--slowdown", type=float, default=0.3)
    args = parser.parse_args(argv)
    base = [*shlex.split(args.model), *shlex.split(args.layout), "--log-interval",
            str(args.log_interval)]
    clean = run(args.nproc, [*base, "--train-iters", str(args.clean_iters), "--log-straggler"])
    alarms = named_at(clean, args.log_interval)
    print(f"clean run, {args.clean_iters} iterations with --log-straggler: {len(alarms)} false "
          f"alarms (target 0)")
    for line in dict.fromkeys(line for _, _, line in alarms):
        print(f"  {line}")
    slow = run(args.nproc, [*base, "--train-iters", str(args.slow_iters), "--log-straggler"],
               env={"MEGATRON_CHIMERA_SLOW_RANK": f"{args.slow_rank}:{args.slowdown}"})
    found = named_at(slow, args.log_interval)
    hit = next(((i, line) for i, rank, line in found if rank == args.slow_rank), None)
    others = [(i, rank) for i, rank, _ in found if rank != args.slow_rank]
    if hit is None:
        print(f"rank {args.slow_rank} slowed {args.slowdown:.0%}: NOT named in "
              f"{args.slow_iters // args.log_interval} log intervals")
    else:
        print(f"rank {args.slow_rank} slowed {args.slowdown:.0%}: named at log interval "
              f"{hit[0]} (target <= 5); other ranks named: {others or 'none'}")
        print(f"  {hit[1]}")
    plain = run(args.nproc, [*base, "--train-iters", str(args.clean_iters)])
    with_ms, without_ms = median_iteration_ms(clean), median_iteration_ms(plain)
    cost = detector_cost(args.nproc, args.log_interval)
    print(f"median iteration: {with_ms:.1f} ms with --log-straggler, {without_ms:.1f} ms "
          f"without: ratio {with_ms / without_ms:.3f} (target <= 1.02; machine noise included)")
    print(f"detector CPU per log interval ({args.nproc} ranks x {args.log_interval} "
          f"iterations): {cost * 1e6:.0f} us = {cost / (args.log_interval * with_ms / 1000):.4%} "
          f"of the interval")


if __name__ == "__main__":
    run_tool(main)
