"""Straggler drill: is a slow rank named, do clean runs stay silent, what does detection cost?

    OMP_NUM_THREADS=1 python tools/straggler_drill.py            # 8 ranks, Chimera D=4 x W=2
    OMP_NUM_THREADS=1 python tools/straggler_drill.py --part overhead   # one process, ~30 s

``--part detect`` runs ``pretrain_gpt2.py`` under torchrun on mock data twice with the same layout,
with ``--log-straggler`` and a TensorBoard directory (each rank's relative compute per interval):

1. ``--clean-iters`` iterations, nothing slowed: every straggler line is a false alarm (target 0
   over 200 iterations); it also prints the highest relative compute any rank had in any
   interval (the margin below the ``1 + threshold`` a rank must exceed);
2. one rank's compute stretched by ``--slowdown`` (CPU time burnt inside each of its compute
   actions, ``MEGATRON_CHIMERA_SLOW_RANK``): the log interval at which the rank is first named,
   the line (target: within 5 log intervals) and that rank's relative compute per interval.

``--part overhead`` prices detection in one process, in log intervals of the same run that take
turns on, off and off again (the control, whose ratio to off is the machine's noise floor): the
drill model's middle stage (its real forward and backward) runs one Chimera rank's actions per
iteration under the executor's busy timer, with the per-kind CPU timing ``--log-straggler``
turns on or without it; every log interval the figures are pickled as the gather does (with or
without the per-kind times) and, when on, the detector observes all the ranks' figures, as the
logging rank does. It prints the median on/off and control/off ratios of an interval's wall and
CPU time, and the detection work timed apart (per timed action and per interval) as a share of
an interval (target <= 2%). The logging rank does the most of that work, and the denominator
is compute only (a real iteration adds bubbles and messages), so the share bounds the added
iteration time from above. ``--part all`` (the default) runs both.
"""

from __future__ import annotations

import os
import random
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

from megatron_chimera.errors import ToolArgumentParser, run_tool
from megatron_chimera.schedules.registry import build_schedule
from megatron_chimera.training.straggler import (
    StragglerDetector,
    expected_busy_by_kind,
    stages_held,
)

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


def relative_compute(directory: str) -> dict[int, list[tuple[int, float]]]:
    """Per rank, (iteration, relative compute) of every log interval, from the TensorBoard
    scalars ``--log-straggler`` writes."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(directory, size_guidance={"scalars": 0})
    events.Reload()
    prefix = "straggler/relative compute rank "
    return {int(tag[len(prefix):]): [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"] if tag.startswith(prefix)}


def longest_run(flags: list[bool]) -> int:
    """The longest run of consecutive True values."""
    best = current = 0
    for flag in flags:
        current = current + 1 if flag else 0
        best = max(best, current)
    return best


def detect(args, base: list[str]) -> None:
    """The clean run's false alarms and margin, the slowed run's first naming."""
    with tempfile.TemporaryDirectory(prefix="straggler_drill_") as tmp:
        clean_tb, slow_tb = os.path.join(tmp, "clean"), os.path.join(tmp, "slow")
        clean = run(args.nproc, [*base, "--train-iters", str(args.clean_iters),
                                 "--log-straggler", "--tensorboard-dir", clean_tb])
        clean_values = relative_compute(clean_tb)
        slow = run(args.nproc, [*base, "--train-iters", str(args.slow_iters), "--log-straggler",
                                "--tensorboard-dir", slow_tb],
                   env={"MEGATRON_CHIMERA_SLOW_RANK": f"{args.slow_rank}:{args.slowdown}"})
        slow_values = relative_compute(slow_tb)
    alarms = named_at(clean, args.log_interval)
    print(f"clean run, {args.clean_iters} iterations with --log-straggler: {len(alarms)} false "
          f"alarms (target 0)")
    for line in dict.fromkeys(line for _, _, line in alarms):
        print(f"  {line}")
    top = max((value, rank, step) for rank, pairs in clean_values.items()
              for step, value in pairs)
    everything = sorted(v for pairs in clean_values.values() for _, v in pairs)
    bar = 1.0 + StragglerDetector([]).threshold
    above = sum(v > bar for v in everything)
    streak = max(longest_run([v > bar for _, v in sorted(pairs)])
                 for pairs in clean_values.values())
    print(f"  relative compute over {len(everything)} rank-intervals: highest {top[0]:.3f} "
          f"(rank {top[1]}, iteration {top[2]}), median {statistics.median(everything):.3f}, "
          f"lowest {everything[0]:.3f}; {above} above {bar:.2f}, at most {streak} in a row for "
          f"a rank (naming takes {StragglerDetector([]).patience})")
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
    mine = [f"{v:.2f}" for _, v in slow_values.get(args.slow_rank, [])]
    rest = max((v for r, pairs in slow_values.items() if r != args.slow_rank for _, v in pairs),
               default=float("nan"))
    print(f"  rank {args.slow_rank}'s relative compute per interval: {', '.join(mine)}; the "
          f"other ranks' highest: {rest:.3f}")


def overhead(args) -> None:
    """Detection on and off in alternating log intervals of one process (see the module
    docstring); prints the median on/off ratios of an interval's wall and CPU time."""
    import pickle

    import torch

    from megatron_chimera.config import ModelConfig
    from megatron_chimera.model.dropout_rng import dropout_stream
    from megatron_chimera.model.gpt2 import GPTModel
    from megatron_chimera.pipeline.busy_timer import BusyTimer
    from megatron_chimera.schedules.actions import Action

    torch.set_num_threads(1)
    torch.manual_seed(0)
    depth, pipes, microbatches = 4, 2, 8  # the drill's Chimera D=4 x W=2, N = 16 / (1 x 2)
    config = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64,
                         max_position_embeddings=64)
    model = GPTModel(config, pre_process=False, post_process=False)
    schedule = build_schedule("chimera", num_ranks=depth, pipes=pipes,
                              num_microbatches=microbatches)
    actions = [a for a in schedule.actions[1] if a.kind in ("F", "B")]
    kinds = expected_busy_by_kind(schedule, [2.0] * depth, [r // 2 for r in range(args.nproc)])
    detector = StragglerDetector([sum(k.values()) for k in kinds], expected_kinds=kinds,
                                 positions=stages_held(schedule, [r // 2
                                                                  for r in range(args.nproc)]))
    keys = iter(range(1 << 30))

    def iteration(on: bool) -> tuple[float, dict[str, float]]:
        timer = BusyTimer(torch.device("cpu"), [], kinds=on)
        outputs: dict[Action, torch.Tensor] = {}
        for action in actions:
            key = Action("F", action.pipe, action.stage, action.microbatch)
            with timer(action):
                if action.kind == "F":
                    model.set_input_tensor(torch.randn(64, 1, 64, requires_grad=True))
                    with dropout_stream(next(keys)):
                        outputs[key] = model(None, None)
                else:
                    outputs.pop(key).backward(torch.ones(64, 1, 64))
        for p in model.parameters():
            p.grad = None
        return timer.total(), timer.by_kind

    def interval(on: bool) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.thread_time()
        figures = [iteration(on) for _ in range(args.log_interval)]
        payload = [({}, busy, by_kind if on else {}) for busy, by_kind in figures]
        pickle.loads(pickle.dumps((0, payload)))  # what gather_object does to each rank's
        if on:  # the logging rank: every rank's figures (this one's, jittered) observed
            rng = random.Random(len(figures))
            rows = [[{k: v * rng.uniform(0.95, 1.05) for k, v in by_kind.items()}
                     for _ in range(args.nproc)] for _, by_kind in figures]
            detector.observe([[sum(k.values()) for k in row] for row in rows], rows)
        return time.perf_counter() - wall, time.thread_time() - cpu

    interval(True), interval(False)  # warm-up
    # three arms in rotating order: on, off, and off again (the control: its ratio to off is
    # the noise floor of this machine at this moment)
    arms: dict[str, list[tuple[float, float]]] = {"on": [], "off": [], "control": []}
    for round_ in range(args.overhead_rounds):
        names = list(arms)[round_ % 3:] + list(arms)[:round_ % 3]
        for name in names:
            arms[name].append(interval(name == "on"))
    off_ms = statistics.median(wall for wall, _ in arms["off"]) * 1000

    def ratio(name: str, clock: int) -> str:
        values = sorted(a[clock] / b[clock] for a, b in zip(arms[name], arms["off"]))
        quarter = len(values) // 4
        return (f"{statistics.median(values):.4f} (quartiles {values[quarter]:.3f}-"
                f"{values[-1 - quarter]:.3f})")

    print(f"detection overhead, one process, {args.overhead_rounds} rounds of log intervals of "
          f"{args.log_interval} iterations ({len(actions)} F/B actions of the drill's middle "
          f"stage each; an interval {off_ms:.0f} ms off), median of the rounds' ratios:")
    for clock, index in (("wall", 0), ("CPU", 1)):
        least = {name: min(a[index] for a in values) for name, values in arms.items()}
        print(f"  {clock}: on / off {ratio('on', index)}; control off / off "
              f"{ratio('control', index)}; least interval on / off "
              f"{least['on'] / least['off']:.4f}, control {least['control'] / least['off']:.4f}")
    added = detection_work(actions[0], detector, args.log_interval, args.nproc)
    per_interval = added["span"] * len(actions) * args.log_interval + added["observe"]
    print(f"  detection's own work, timed apart: {added['span'] * 1e6:.2f} us per timed action "
          f"(the thread's CPU clock, per kind), {added['observe'] * 1e6:.0f} us per log interval "
          f"(the detector on {args.nproc} ranks' figures, their pickling): "
          f"{per_interval * 1e3:.2f} ms per interval = {per_interval / (off_ms / 1e3):.3%} of "
          f"it (target <= 2%)")


def detection_work(action, detector: StragglerDetector, log_interval: int, nproc: int,
                   repeats: int = 20000) -> dict[str, float]:
    """Seconds detection adds, timed apart (least of 5 tries each): per timed action (the busy
    timer with per-kind CPU timing minus without) and per log interval (the detector observing
    ``nproc`` ranks' figures, plus pickling them with their per-kind times minus without)."""
    import pickle

    import torch

    from megatron_chimera.pipeline.busy_timer import BusyTimer

    def spans(kinds: bool) -> float:
        timer = BusyTimer(torch.device("cpu"), [], kinds=kinds)
        started = time.perf_counter()
        for _ in range(repeats):
            with timer(action):
                pass
        return (time.perf_counter() - started) / repeats

    rng = random.Random(0)
    rows = [[{"F": rng.uniform(0.9, 1.1), "B": rng.uniform(1.8, 2.2)} for _ in range(nproc)]
            for _ in range(log_interval)]
    busy = [[sum(k.values()) for k in row] for row in rows]

    def observe() -> float:
        started = time.perf_counter()
        for _ in range(100):
            detector.observe(busy, rows)
        return (time.perf_counter() - started) / 100

    def pickled(kinds: bool) -> float:
        payload = (0, [({}, 1.0, dict(rows[0][0]) if kinds else {})] * log_interval)
        started = time.perf_counter()
        for _ in range(1000):
            pickle.loads(pickle.dumps(payload))
        return (time.perf_counter() - started) / 1000

    span = min(spans(True) - spans(False) for _ in range(5))
    gather = min(pickled(True) - pickled(False) for _ in range(5))
    return {"span": max(span, 0.0), "observe": min(observe() for _ in range(5))
            + nproc * max(gather, 0.0)}


def main(argv: list[str] | None = None) -> None:
    """Run the drill's parts and print the figures."""
    parser = ToolArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("all", "detect", "overhead"), default="all")
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--layout", default=LAYOUT)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--log-interval", type=int, default=5)
    parser.add_argument("--clean-iters", type=int, default=200)
    parser.add_argument("--slow-iters", type=int, default=50)
    parser.add_argument("--slow-rank", type=int, default=5)
    parser.add_argument("--slowdown", type=float, default=0.3)
    parser.add_argument("--overhead-rounds", type=int, default=30)
    args = parser.parse_args(argv)
    if args.part in ("all", "detect"):
        detect(args, [*shlex.split(args.model), *shlex.split(args.layout), "--log-interval",
                      str(args.log_interval)])
    if args.part in ("all", "overhead"):
        overhead(args)


if __name__ == "__main__":
    run_tool(main)
