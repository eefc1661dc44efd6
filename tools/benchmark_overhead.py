"""The pipeline runtime's own host cost per action, with zero-cost stages: ours next to torch's.

Run under torchrun with at least as many processes as the largest size::

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 8 tools/benchmark_overhead.py --sizes 2 8 \
        --num-microbatches 32 [--profile] [--json overhead.json]

For each D of ``--sizes`` the first D ranks run every schedule of ``--schedules`` on stages that
take no time (:class:`EmulatedStage` / :class:`EmulatedTorchStage` with zero costs, one tiny layer:
what is left is their real tensor work), while the other ranks wait; ``torch-*`` entries run
torch.distributed.pipelining's schedules on the same stages. No gradient reduction. Per row:

* **CPU ms/action**: the process CPU time of one iteration (every thread, gloo's included)
  divided by the rank's compute actions (F, B and W; torch: F and B, or F, I and W), median over
  every measured iteration; the mean and the maximum over the ranks. CPU time grows far less
  than wall time when other processes compete for the cores, so it is the figure to compare on
  a loaded machine.
* **wall ms/action**: the slowest rank's median iteration time over its actions. With more ranks
  than cores it includes waiting for a core.

The rows take turns: ``--rounds`` rounds of ``--iters`` iterations per row, so that load from
elsewhere falls on all of them alike.

``--profile`` then runs ``--iters`` more iterations per row under cProfile (CPU clock) on every
rank and splits the CPU time per action into the stages' own work, gloo (posting and waiting,
C++), the torch.distributed Python wrappers, and the runtime's Python (ours: executor, p2p,
transport; torch's: ``torch.distributed.pipelining``) with its most expensive functions.
cProfile's own cost per call is measured and subtracted and the split is scaled to the measured
CPU time per action; "all but stage" is the runtime's whole cost per action.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron_chimera.atomic import atomic_write
from megatron_chimera.config import ParallelConfig
from megatron_chimera.errors import ToolArgumentParser, run_tool
from megatron_chimera.pipeline.emulated import (
    EmulatedCosts,
    EmulatedStage,
    SleepingWeightGradStore,
    emulated_forward_step,
)
from megatron_chimera.pipeline.executor import Gradients, PipelineExecutor, StageWork
from megatron_chimera.pipeline.topology import PipelineTopology
from megatron_chimera.pipeline.torch_pipelining import build_torch_pipeline
from megatron_chimera.schedules import build_schedule
from megatron_chimera.schedules.registry import parse_schedule_spec
from megatron_chimera.training.initialize import initialize_distributed

DEFAULT_SCHEDULES = ("1f1b,interleaved:virtual_pipeline_size=2,chimera,chimera-zb,"
                     "torch-1f1b,torch-interleaved,torch-zbv")
SEQ, MICRO_BATCH, HIDDEN = 8, 2, 4
ZERO = EmulatedCosts(0.0, 0.0, 0.0)
CATEGORIES = ("stage", "gloo", "c10d-python", "runtime-python")


@dataclass
class Row:
    """One runtime, schedule and size."""

    schedule: str
    pipeline_size: int
    num_microbatches: int
    actions_per_rank: int
    cpu_ms_per_action: list[float]  # per rank (median over iterations)
    wall_ms_per_action: float  # slowest rank
    profile: dict[str, float] = field(default_factory=dict)  # category -> CPU ms per action
    top: list[tuple[str, float]] = field(default_factory=list)  # runtime functions, ms/action


# ----------------------------------------------------------------------------- the runtimes
def ours(name: str, options: dict[str, Any], d: int, n: int,
         group: dist.ProcessGroup | None) -> tuple[Callable[[], None], int]:
    """Our executor on zero-cost stages: (one iteration, compute actions of this rank)."""
    if name == "chimera-zb":
        options = {"costs": (1.0, 1.0, 1.0), **options}
    schedule = build_schedule(name, d, n, **options)
    rank = dist.get_rank(group)
    stages = {s: EmulatedStage(ZERO, s == 0, s == schedule.num_stages - 1, HIDDEN, s)
              for s in schedule.stages_of_rank(rank)}
    topology = PipelineTopology(pipeline_rank=rank, p2p_group=lambda src, dst: group)
    executor = PipelineExecutor(
        schedule, topology,
        StageWork(stages, emulated_forward_step, (SEQ, MICRO_BATCH, HIDDEN), torch.float32),
        Gradients(loss_scale_divisor=n, weight_grad_store_factory=SleepingWeightGradStore))
    batches = [torch.randn(SEQ, MICRO_BATCH, HIDDEN)] * n

    def step() -> None:
        for module in stages.values():
            module.zero_grad(set_to_none=True)
        executor.run(batches)

    return step, len(schedule.actions[rank])


def torchs(name: str, d: int, n: int, group: dist.ProcessGroup | None,
           ) -> tuple[Callable[[], None], int]:
    """torch.distributed.pipelining on the same zero-cost stages."""
    pipeline = build_torch_pipeline(name, d, n, ZERO, (MICRO_BATCH, SEQ, HIDDEN), group)
    return pipeline.step, pipeline.actions_per_rank


# ------------------------------------------------------------------------------- profiling
def _calibrate() -> tuple[float, float]:
    """cProfile's own CPU cost per profiled Python call and per builtin call, in seconds."""
    def nothing() -> None:
        pass

    calls, cost = 20000, []
    for fn in (nothing, time.perf_counter):
        start = time.process_time()
        for _ in range(calls):
            fn()
        plain = time.process_time() - start
        profiler = cProfile.Profile(time.process_time)
        start = time.process_time()
        profiler.enable()
        for _ in range(calls):
            fn()
        profiler.disable()
        cost.append(max(0.0, (time.process_time() - start - plain) / calls))
    return cost[0], cost[1]


GLOO_CALLS = ("send", "recv", "wait", "is_completed")  # torch._C._distributed_c10d builtins


def _intrinsic(func: tuple[str, int, str]) -> str | None:
    """The category a function belongs to by itself (None: that of its callers)."""
    filename, _, name = func
    base = os.path.basename(filename)
    if base == "emulated.py":  # the stages, torch's loss function included
        return "stage"
    if filename == "~":
        if "_distributed_c10d" in name and any(call in name for call in GLOO_CALLS):
            return "gloo"
        if "run_backward" in name:  # autograd's engine: the stage's backward
            return "stage"
        return None
    if filename.endswith(os.path.join("distributed", "distributed_c10d.py")):
        return "c10d-python"
    if os.path.join("megatron_chimera", "pipeline") in filename or "pipelining" in filename:
        return "runtime-python"
    return None


def _shares(table: dict[Any, tuple]) -> dict[Any, dict[str, float]]:
    """Per function, the share of its own time that belongs to each category: its intrinsic
    category, or its callers' shares weighted by the time spent on behalf of each caller
    (iterated until it settles, so the order of the table does not matter)."""
    share = {func: {cat: 1.0} for func in table if (cat := _intrinsic(func)) is not None}
    derived = [func for func in table if func not in share]
    for func in derived:
        share[func] = {"runtime-python": 1.0}
    for _ in range(50):
        changed = False
        for func in derived:
            callers = table[func][4]
            weight = sum(entry[2] for entry in callers.values())
            if not weight:
                continue
            mix: dict[str, float] = {}
            for caller, entry in callers.items():
                for cat, part in share.get(caller, {"runtime-python": 1.0}).items():
                    mix[cat] = mix.get(cat, 0.0) + part * entry[2] / weight
            if any(abs(mix.get(c, 0.0) - share[func].get(c, 0.0)) > 1e-6 for c in CATEGORIES):
                share[func], changed = mix, True
        if not changed:
            break
    return share


def categorize(stats: pstats.Stats, per_call: tuple[float, float],
               ) -> tuple[dict[str, float], dict[str, float]]:
    """CPU seconds per category, and per runtime function, with cProfile's own cost per call
    removed (:func:`_shares` says which category each function's own time belongs to)."""
    table = stats.stats  # func -> (primitive calls, calls, own time, cumulative, callers)
    totals = dict.fromkeys(CATEGORIES, 0.0)
    functions: dict[str, float] = {}
    for func, share in _shares(table).items():
        calls, own = table[func][1], table[func][2]
        own = max(0.0, own - calls * per_call[func[0] == "~"])
        for cat, part in share.items():
            totals[cat] += own * part
        runtime = share.get("runtime-python", 0.0) * own
        if runtime > 0:
            label = f"{os.path.basename(func[0])}:{func[2]}" if func[0] != "~" else func[2]
            functions[label] = functions.get(label, 0.0) + runtime
    return totals, functions


def profile(step: Callable[[], None], iters: int, actions: int, per_call: tuple[float, float],
            ) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """CPU ms per action by category and the runtime's six most expensive functions."""
    profiler = cProfile.Profile(time.process_time)
    for _ in range(iters):
        profiler.enable()
        step()
        profiler.disable()
    totals, functions = categorize(pstats.Stats(profiler), per_call)
    scale = 1e3 / (iters * actions)
    top = sorted(functions.items(), key=lambda kv: -kv[1])[:6]
    return {k: v * scale for k, v in totals.items()}, [(k, v * scale) for k, v in top]


# ----------------------------------------------------------------------------- measuring
@dataclass
class Setup:
    """One row being measured on this rank (a member of its ``group``)."""

    spec: str
    pipeline_size: int
    group: dist.ProcessGroup | None
    step: Callable[[], None]
    actions: int
    cpu: list[float] = field(default_factory=list)  # seconds per measured iteration
    wall: list[float] = field(default_factory=list)


def build(spec: str, d: int, n: int, group: dist.ProcessGroup | None) -> Setup:
    """Our executor or torch's runtime for ``spec`` on the first ``d`` ranks."""
    name, options = parse_schedule_spec(spec)
    if name.startswith("torch-"):
        step, actions = torchs(name, d, n, group)
    else:
        step, actions = ours(name, options, d, n, group)
    return Setup(spec, d, group, step, actions)


def measure(setup: Setup, iters: int, warmup: int) -> None:
    """``iters`` more timed iterations (after ``warmup`` untimed ones)."""
    for i in range(warmup + iters):
        dist.barrier(setup.group)
        start_cpu, start = time.process_time(), time.perf_counter()
        setup.step()
        if i >= warmup:
            setup.cpu.append(time.process_time() - start_cpu)
            setup.wall.append(time.perf_counter() - start)


def collect(setup: Setup, n: int, found: tuple[dict[str, float], list[tuple[str, float]]],
            ) -> Row | None:
    """The row of ``setup`` on global rank 0 (a collective over its group), else None."""
    scale = 1e3 / setup.actions
    mine = (statistics.median(setup.cpu) * scale, statistics.median(setup.wall) * scale, *found)
    every = [None] * setup.pipeline_size
    dist.all_gather_object(every, mine, group=setup.group)
    if dist.get_rank() != 0:
        return None
    d = setup.pipeline_size
    profile_mean = {c: statistics.mean(r[2][c] for r in every) for c in every[0][2]}
    top_mean: dict[str, float] = {}
    for r in every:
        for label, ms in r[3]:
            top_mean[label] = top_mean.get(label, 0.0) + ms / d
    return Row(setup.spec, d, n, setup.actions, [r[0] for r in every], max(r[1] for r in every),
               profile_mean, sorted(top_mean.items(), key=lambda kv: -kv[1])[:6])


def format_rows(rows: list[Row]) -> str:
    """Markdown table (and, with --profile, the breakdown per row)."""
    lines = ["| runtime | schedule | D | N | actions/rank | CPU ms/action (mean) | (max rank) | "
             "wall ms/action |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        runtime = "torch" if r.schedule.startswith("torch-") else "ours"
        lines.append(f"| {runtime} | {r.schedule} | {r.pipeline_size} | {r.num_microbatches} | "
                     f"{r.actions_per_rank} | {statistics.mean(r.cpu_ms_per_action):.3f} | "
                     f"{max(r.cpu_ms_per_action):.3f} | {r.wall_ms_per_action:.3f} |")
    profiled = [r for r in rows if r.profile]
    if profiled:
        lines += ["", "Where the CPU time per action goes (cProfile, its measured cost per call "
                  "removed, then scaled to the CPU ms/action above; mean over ranks):", "",
                  "| runtime | schedule | D | " + " | ".join(CATEGORIES)
                  + " | all but stage | profiled / measured "
                  "| runtime's top functions (ms/action, scaled) |", "|---|---|---|" + "---|" * 7]
        for r in profiled:
            measured = statistics.mean(r.cpu_ms_per_action)
            profiled_sum = sum(r.profile.values())
            scale = measured / profiled_sum if profiled_sum else 0.0
            values = " | ".join(f"{r.profile[c] * scale:.3f}" for c in CATEGORIES)
            top = ", ".join(f"{label} {ms * scale:.3f}" for label, ms in r.top[:4])
            runtime = "torch" if r.schedule.startswith("torch-") else "ours"
            host = measured - r.profile["stage"] * scale
            lines.append(f"| {runtime} | {r.schedule} | {r.pipeline_size} | {values} | "
                         f"{host:.3f} | {profiled_sum / measured:.2f} | {top} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags (see the module docstring)."""
    p = ToolArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[2, 8], help="pipeline sizes D")
    p.add_argument("--num-microbatches", type=int, default=32)
    p.add_argument("--schedules", default=DEFAULT_SCHEDULES,
                   help="comma-separated name[:key=value...] (torch-* for pipelining's)")
    p.add_argument("--iters", type=int, default=10, help="measured iterations per round")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds over all rows (median over every measured iteration)")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations before the first")
    p.add_argument("--profile", action="store_true",
                   help="also split the CPU time per action by cProfile (more iterations)")
    p.add_argument("--json", default=None, help="write the rows to this JSON file")
    args = p.parse_args(argv)
    if args.iters < 1 or args.rounds < 1 or args.warmup < 0 or min(args.sizes) < 2:
        p.error("--iters and --rounds must be >= 1, --warmup >= 0 and every size >= 2")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; global rank 0 prints the table (and writes --json)."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    initialize_distributed(ParallelConfig(pipeline_model_parallel_size=world,
                                          distributed_backend="gloo"))
    world, rank = dist.get_world_size(), dist.get_rank()
    if max(args.sizes) > world:
        raise SystemExit(f"--sizes {max(args.sizes)} needs at least as many ranks, have {world}")
    # one group per size, created in the same order on every rank
    groups = {d: None if d == world else dist.new_group(list(range(d))) for d in args.sizes}
    specs = [(spec, d) for d in args.sizes for spec in args.schedules.split(",") if spec]
    setups: dict[tuple[str, int], Setup] = {}
    # largest D first: then every rank of a row has created the same transports before it (the
    # NCCL-semantics test mode numbers a rank's transports and pairs them up by that number)
    for spec, d in sorted(specs, key=lambda key: -key[1]):
        if rank < d:
            try:
                setups[(spec, d)] = build(spec, d, args.num_microbatches, groups[d])
            except ValueError as exc:  # not defined for this (D, N): the same on every rank
                if rank == 0:
                    print(f"skipped {spec} D={d}: {exc}", file=sys.stderr, flush=True)
    # the rows take turns, round after round, so that load from elsewhere hits them alike
    for round_ in range(args.rounds):
        for key in specs:
            if key in setups:
                measure(setups[key], args.iters, args.warmup if round_ == 0 else 1)
            dist.barrier()
    per_call = _calibrate()
    rows: list[Row] = []
    for key in specs:
        if key in setups:
            setup = setups[key]
            found: tuple[dict[str, float], list[tuple[str, float]]] = ({}, [])
            if args.profile:
                dist.barrier(setup.group)
                found = profile(setup.step, args.iters, setup.actions, per_call)
            row = collect(setup, args.num_microbatches, found)
            if row is not None:
                rows.append(row)
        dist.barrier()
    if rank == 0:
        print(format_rows(rows))
        if args.json:
            atomic_write(args.json, lambda f: json.dump([asdict(r) for r in rows], f, indent=1),
                         mode="w")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    run_tool(main)
