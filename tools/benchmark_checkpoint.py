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
against its share (checkpoint size / ranks); its peak host memory during a save (synchronous,
asynchronous: from the capture to the publish, the most over the run's saves) and the load (the
rise of the process's resident high-water mark ``VmHWM``, reset when the phase starts; every
thread of the rank counted, training's own included); the load time; and the wall time of an
iteration without a save, right after a synchronous save, and while an asynchronous save is in
flight.

An iteration's wall time is the time between the logging rank's lines of it and of the previous
one, taken as the lines arrive (``--log-interval 1``), so it holds everything the loop does: the
step, the logging collective, a save's synchronous part (an async save's staging). An async save
of iteration N is in flight for every iteration after N that began before its "finished saving"
line arrived; all of them are counted.

``--async-only`` runs only the ``--async-save`` training and compares, within that one run, the
iterations an async save was in flight for with the others (the same run's load, so the machine's
swings fall on both): the mean in-flight iteration over the median other one (target <= 1.2).

``--reshard`` instead saves one checkpoint (``--save-layout``, with the distributed optimizer)
and resumes it in each ``--reshard-layouts`` layout (default: T=2 -> T=1 with Chimera -> 1F1B,
and D=2 -> D=4), printing the most checkpoint bytes one rank read over its share (target
<= 1.25) and how many saved chunks carry block checksums (every block a load reads is checked
against them; a load that passed checked them all).
"""

from __future__ import annotations

import ast
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
STARTED = re.compile(r"started saving checkpoint .* at iteration (\d+)")
FINISHED = re.compile(r"finished saving checkpoint .*iter_(\d+) in the background")
LOADED = re.compile(r"loaded checkpoint .* in ([\d.]+) s; checkpoint bytes read per rank: "
                    r"\[([\d, ]+)\]")
PEAKS = re.compile(r"peak host memory added per rank \(MB\): (\[[^\]]*\])")


def run(nproc: int, flags: list[str], walls: list[float] | None = None
        ) -> list[tuple[float, str]]:
    """The ranks' stdout lines of ``pretrain_gpt2.py flags`` on ``nproc`` ranks, each with the
    time it arrived (fails loudly); the run's wall time is appended to ``walls``."""
    started = time.perf_counter()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", os.path.join(ROOT, "pretrain_gpt2.py"), *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with tempfile.TemporaryFile(mode="w+") as errors:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=errors,
                                text=True)
        lines = [(time.perf_counter(), line) for line in proc.stdout]
        if proc.wait(timeout=1800) != 0:
            errors.seek(0)
            raise SystemExit(f"{' '.join(cmd)} failed:\n{''.join(x for _, x in lines)[-3000:]}"
                             f"\n{errors.read()[-3000:]}")
    if walls is not None:
        walls.append(time.perf_counter() - started)
    return lines


def iteration_walls(lines: list[tuple[float, str]]) -> dict[int, float]:
    """Wall time (ms) of every iteration after the first: between its log line and the
    previous one's."""
    stamps = {int(m.group(1)): t for t, line in lines if (m := ITERATION.search(line))}
    return {i: (t - stamps[i - 1]) * 1000 for i, t in stamps.items() if i - 1 in stamps}


def in_flight_iterations(lines: list[tuple[float, str]]) -> list[list[int]]:
    """Per async save of iteration N with an iteration after it: the iterations it was in
    flight for, those after N that began (the previous iteration was logged) before it
    finished."""
    stamps = {int(m.group(1)): t for t, line in lines if (m := ITERATION.search(line))}
    windows = []
    for t, line in lines:
        if m := FINISHED.search(line):
            saved = int(m.group(1))
            window = [i for i in sorted(stamps) if i > saved and stamps.get(i - 1, t) < t]
            if window:
                windows.append(window)
    return windows


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
    parser.add_argument("--async-only", action="store_true",
                        help="only the --async-save run: in-flight iterations against the others")
    parser.add_argument("--reshard", action="store_true",
                        help="only the reads of resharded loads (see --reshard-layouts)")
    parser.add_argument("--reshard-layouts", nargs="+", default=list(RESHARDS),
                        help="load layouts for --reshard (flags, one string each)")
    args = parser.parse_args(argv)
    if args.reshard:
        return reshard_rows(args)
    base = shlex.split(args.model) + ["--train-iters", str(args.iters)]
    save_layout, load_layout = shlex.split(args.save_layout), shlex.split(args.load_layout)
    if args.async_only:
        return async_only(args, [*base, *save_layout])
    with tempfile.TemporaryDirectory(prefix="ckpt_bench_") as tmp:
        walls: list[float] = []
        plain = iteration_walls(run(args.nproc, [*base, *save_layout], walls))
        saving = ["--save-interval", str(args.save_interval)]
        sync_lines = run(args.nproc, [*base, *save_layout, "--save", os.path.join(tmp, "sync"),
                                      *saving], walls)
        ckpt = os.path.join(tmp, "async")
        async_lines = run(args.nproc, [*base, *save_layout, "--save", ckpt, *saving,
                                       "--async-save"], walls)
        last = max(int(d[-7:]) for d in glob.glob(os.path.join(ckpt, "iter_*"))
                   if d[-7:].isdigit())
        written = written_per_rank(os.path.join(ckpt, f"iter_{last:07d}"), args.nproc)
        load_lines = run(args.nproc, [*shlex.split(args.model), *load_layout, "--train-iters",
                                      str(last + 1), "--load", ckpt])
        loaded = LOADED.search("".join(line for _, line in load_lines))
    read = [int(x) for x in loaded.group(2).split(",")]
    peaks = {"sync save": peak_memory(sync_lines, "saved checkpoint"),
             "async save": peak_memory(async_lines, "finished saving checkpoint"),
             "load": peak_memory(load_lines, "loaded checkpoint")}
    print_rank_table(written, read, peaks)
    saves = args.iters // args.save_interval + (args.iters % args.save_interval != 0)
    print(f"\nload time ({args.load_layout}): {float(loaded.group(1)):.2f} s")
    print(f"run wall time added per save (vs no save, {saves} saves): synchronous "
          f"{(walls[1] - walls[0]) / saves:.2f} s, "
          f"--async-save {(walls[2] - walls[0]) / saves:.2f} s")
    print_iteration_table(plain, iteration_walls(sync_lines), iteration_walls(async_lines),
                          in_flight_iterations(async_lines), args.save_interval)


def async_only(args, flags: list[str], warmup: int = 2) -> None:
    """One ``--async-save`` run: its iterations with a save in flight against the others."""
    with tempfile.TemporaryDirectory(prefix="ckpt_async_") as tmp:
        lines = run(args.nproc, [*flags, "--save", os.path.join(tmp, "async"),
                                 "--save-interval", str(args.save_interval), "--async-save"])
    walls, windows = iteration_walls(lines), in_flight_iterations(lines)
    in_flight = [i for window in windows for i in window if i > warmup]
    others = [ms for i, ms in walls.items() if i > warmup and i not in in_flight]
    if not in_flight or not others:
        raise SystemExit(f"no iteration with (or without) an async save in flight after "
                         f"iteration {warmup}: raise --iters or --save-interval")
    busy, quiet = statistics.mean(walls[i] for i in in_flight), statistics.median(others)
    print(f"--async-save every {args.save_interval} of {args.iters} iterations: "
          f"{len(windows)} saves in flight over {len(in_flight)} iterations "
          f"({', '.join(str(w) for w in windows)}), mean {busy:.1f} ms; the other "
          f"{len(others)} iterations' median {quiet:.1f} ms; in flight / not: {busy / quiet:.2f} "
          f"(target <= 1.2)")
    print("  per save, the in-flight iterations' ms (the iteration before it): " + "; ".join(
        f"{', '.join(f'{walls[i]:.0f}' for i in w)} ({walls.get(w[0] - 1, float('nan')):.0f})"
        for w in windows))


RESHARDS = ("--pipeline-model-parallel-size 4 --use-distributed-optimizer",  # T=2 -> 1, 1F1B
            "--tensor-model-parallel-size 2 --use-distributed-optimizer")  # D=2 -> D=4


def reshard_rows(args) -> None:
    """Save once in ``--save-layout``, resume in each reshard layout; per layout the most bytes
    one rank read over its share."""
    from megatron_chimera.checkpoint.safe_reader import CHECKSUMS, read_metadata
    base = shlex.split(args.model)
    with tempfile.TemporaryDirectory(prefix="ckpt_reshard_") as tmp:
        ckpt = os.path.join(tmp, "ck")
        run(args.nproc, [*base, *shlex.split(args.save_layout), "--train-iters", "2",
                         "--save", ckpt, "--save-interval", "2"])
        saved = os.path.join(ckpt, "iter_0000002")
        size = sum(written_per_rank(saved, args.nproc))
        chunks = [info for index, info in read_metadata(saved).storage_data.items()
                  if index.offset is not None]  # tensor chunks (not bytes items)
        checked = sum(getattr(info, CHECKSUMS, None) is not None for info in chunks)
        print(f"checkpoint: {size} B, {checked} of its {len(chunks)} tensor chunks with block "
              f"checksums; saved by: {args.save_layout}")
        print("| load layout | share (B) | most read by a rank (B) | most read / share | "
              "mean read / share |")
        print("|---|---|---|---|---|")
        for layout in args.reshard_layouts:
            lines = run(args.nproc, [*base, *shlex.split(layout), "--train-iters", "3",
                                     "--load", ckpt])
            loaded = LOADED.search("".join(line for _, line in lines))
            read = [int(x) for x in loaded.group(2).split(",")]
            share = size / len(read)
            print(f"| {layout} | {share:.0f} | {max(read)} | {max(read) / share:.2f} | "
                  f"{sum(read) / len(read) / share:.2f} |")


def peak_memory(lines: list[tuple[float, str]], marker: str) -> list[float | None]:
    """Per rank, the most peak host memory (MB) any line with ``marker`` reports."""
    runs = [ast.literal_eval(m.group(1)) for _, line in lines
            if marker in line and (m := PEAKS.search(line))]
    return [max((r[k] for r in runs if r[k] is not None), default=None)
            for k in range(len(runs[0]))] if runs else []


def print_rank_table(written: list[int], read: list[int],
                     peaks: dict[str, list[float | None]]) -> None:
    """Per rank: bytes written and read against the share, peak host memory per phase."""
    share = sum(written) / len(written)
    print(f"checkpoint data: {sum(written)} B over {len(written)} ranks (share {share:.0f} B)")
    print("| rank | written (B) | written / share | read on resume (B) | read / share | "
          + " | ".join(f"peak host memory, {what} (MB)" for what in peaks) + " |")
    print("|---|---|---|---|---|" + "---|" * len(peaks))
    for rank in range(len(written)):
        memory = " | ".join(str(p[rank]) if rank < len(p) else "-" for p in peaks.values())
        print(f"| {rank} | {written[rank]} | {written[rank] / share:.2f} | {read[rank]} | "
              f"{read[rank] / share:.2f} | {memory} |")


def print_iteration_table(plain: dict[int, float], sync: dict[int, float],
                          asynchronous: dict[int, float], windows: list[list[int]],
                          interval: int, warmup: int = 2) -> None:
    """The iteration wall times (ms): medians without a save, after a synchronous save and
    outside async saves; the mean over every iteration an async save was in flight for."""
    med = statistics.median
    plain_ms = med([ms for i, ms in plain.items() if i > warmup])
    in_flight = [i for window in windows for i in window if i > warmup]
    rows = (("no save (median)", plain_ms),
            ("sync run, iteration after a save (median)",
             med([ms for i, ms in sync.items() if i > warmup and (i - 1) % interval == 0])),
            (f"while an async save is in flight (mean of {len(in_flight)} iterations, "
             f"{len(windows)} saves)", statistics.mean(asynchronous[i] for i in in_flight)),
            ("async run, no save in flight (median)",
             med([ms for i, ms in asynchronous.items() if i > warmup and i not in in_flight])))
    print("| iteration wall time (ms) | value | / no save |")
    print("|---|---|---|")
    for what, value in rows:
        print(f"| {what} | {value:.1f} | {value / plain_ms:.2f} |")

if __name__ == "__main__":
    run_tool(main)
