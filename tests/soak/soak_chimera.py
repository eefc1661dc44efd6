#!/usr/bin/env python
"""Soak run: Chimera D=4 on CPU for 2,000 iterations with evaluation and checkpoints every 200.

Not part of the test suite (its name is not ``test_*``); run it by hand::

    OMP_NUM_THREADS=1 nice python tests/soak/soak_chimera.py --report soak.json

It launches ``torchrun --standalone --nproc-per-node 4 pretrain_gpt2.py`` (a tiny GPT, mock data,
one data-loader worker per loader) and samples every worker process from ``/proc`` once a
second: resident memory (``VmRSS``), open file descriptors (``/proc/PID/fd``) and threads
(``/proc/PID/task``), each sample tagged with the last iteration the log reported. Pass/fail:

* resident memory after warm-up grows by less than ``--max-rss-growth`` (5%): the median of the
  samples in the last window (iterations 1820-1980 by default, before the final evaluation and
  save) versus the median in the window right after the first evaluation and checkpoint
  (iterations 220-400), per rank;
* file descriptors and threads do not leak: per rank, the fewest seen in the last window are
  no more than the most seen in the first window (transient files of a save do not count);
* the run exits 0 at iteration 2,000 with finite losses.

Exit status 0 when all hold; the figures are printed and written to ``--report`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOG_LINE = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|")
LOSS = re.compile(r"lm loss: ([0-9.eE+\-naNinf]+)")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--interval", type=int, default=200, help="eval and save interval")
    parser.add_argument("--log-interval", type=int, default=20)
    parser.add_argument("--num-workers", type=int, default=1, help="data-loader workers")
    parser.add_argument("--max-rss-growth", type=float, default=0.05)
    parser.add_argument("--sample-seconds", type=float, default=1.0)
    parser.add_argument("--workdir", default=None, help="checkpoints and logs (default: temp)")
    parser.add_argument("--report", default=None, help="write the figures here (JSON)")
    return parser.parse_args()


def children(pid: int) -> list[int]:
    """Pids whose parent is ``pid``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def sample(pid: int) -> dict[str, int] | None:
    """RSS (kB), open fds and threads of ``pid`` from /proc, or None if it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        rss = int(re.search(r"VmRSS:\s+(\d+)", status).group(1))
        return {"rss_kb": rss, "fds": len(os.listdir(f"/proc/{pid}/fd")),
                "threads": len(os.listdir(f"/proc/{pid}/task"))}
    except (OSError, AttributeError):
        return None


def rank_of(pid: int) -> int | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in environ:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


class Sampler(threading.Thread):
    """Samples the launcher's workers every ``period`` seconds, tagged with the iteration."""

    def __init__(self, launcher: int, period: float) -> None:
        super().__init__(daemon=True)
        self.launcher, self.period = launcher, period
        self.iteration = 0
        self.samples: dict[int, list[tuple[int, dict[str, int]]]] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        ranks: dict[int, int] = {}
        while not self.stop.wait(self.period):
            for pid in children(self.launcher):
                if pid not in ranks:
                    rank = rank_of(pid)
                    if rank is None:
                        continue
                    ranks[pid] = rank
                figures = sample(pid)
                if figures is not None:
                    self.samples.setdefault(ranks[pid], []).append((self.iteration, figures))


def window(samples: list[tuple[int, dict[str, int]]], lo: int, hi: int, key: str) -> list[int]:
    return [fig[key] for it, fig in samples if lo <= it <= hi]


def main() -> int:
    args = parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           str(ROOT / "pretrain_gpt2.py"),
           "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
           "--seq-length", "32", "--max-position-embeddings", "32",
           "--micro-batch-size", "1", "--global-batch-size", "8", "--lr", "1e-3",
           "--mock-data", "--vocab-size", "500", "--num-workers", str(args.num_workers),
           "--pipeline-model-parallel-size", "4", "--chimera-pipes", "2",
           "--train-iters", str(args.iters), "--log-interval", str(args.log_interval),
           "--eval-interval", str(args.interval), "--eval-iters", "2",
           "--save", str(workdir / "ckpt"), "--save-interval", str(args.interval),
           "--distributed-timeout-minutes", "5"]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    start = time.monotonic()
    launcher = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    sampler = Sampler(launcher.pid, args.sample_seconds)
    sampler.start()
    losses: dict[int, float] = {}
    with open(workdir / "soak.log", "w") as log:
        for line in launcher.stdout:
            log.write(line)
            match = LOG_LINE.search(line)
            if match:
                sampler.iteration = int(match.group(1))
                loss = LOSS.search(line)
                if loss:
                    losses[sampler.iteration] = float(loss.group(1))
    launcher.wait()
    sampler.stop.set()
    sampler.join()
    seconds = time.monotonic() - start

    first = (args.interval + args.log_interval, 2 * args.interval)  # after the 1st eval + save
    # the last window stops before the final iteration's report: what follows is the final
    # evaluation, save and shutdown, not steady-state training
    last = (args.iters - args.interval + args.log_interval, args.iters - args.log_interval)
    report: dict[str, object] = {
        "returncode": launcher.returncode, "seconds": round(seconds, 1),
        "last_iteration": max(losses, default=0), "windows": {"first": first, "last": last},
        "ranks": {}, "workdir": str(workdir)}
    ok = launcher.returncode == 0 and max(losses, default=0) == args.iters and all(
        math.isfinite(v) for v in losses.values())
    for rank, samples in sorted(sampler.samples.items()):
        rss_a, rss_b = window(samples, *first, "rss_kb"), window(samples, *last, "rss_kb")
        if not rss_a or not rss_b:
            ok = False
            report["ranks"][rank] = {"error": "no samples in a window"}
            continue
        base, final = statistics.median(rss_a), statistics.median(rss_b)
        figures = {
            "rss_mb_first": round(base / 1024, 1), "rss_mb_last": round(final / 1024, 1),
            "rss_growth": round(final / base - 1, 4),
            "rss_mb_peak_after_warmup": round(max(window(samples, first[0], args.iters,
                                                         "rss_kb")) / 1024, 1),
            "fds_first_max": max(window(samples, *first, "fds")),
            "fds_last_min": min(window(samples, *last, "fds")),
            "threads_first_max": max(window(samples, *first, "threads")),
            "threads_last_min": min(window(samples, *last, "threads")),
            "samples": len(samples)}
        report["ranks"][rank] = figures
        ok &= figures["rss_growth"] < args.max_rss_growth
        ok &= figures["fds_last_min"] <= figures["fds_first_max"]
        ok &= figures["threads_last_min"] <= figures["threads_first_max"]
    if len(report["ranks"]) != 4:
        ok = False
    report["passed"] = bool(ok)
    text = json.dumps(report, indent=2)
    print(text)
    if args.report:
        Path(args.report).write_text(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
