"""Autotuner: enumerate T, schedules, D, W, B, N, recomputation and the distributed optimizer;
keep what fits; rank by throughput.

For ``P`` GPUs and a mini-batch ``B̂`` it tries every allowed tensor-parallel size ``T``
(``SearchSpace.tensor_parallel_sizes``; None, the CLI's default: every T that divides the
attention heads and fits in one node; with sequence parallelism when T > 1; T must also divide
the hidden and MLP sizes), every ``D`` dividing ``P / T`` with at most one stage per layer (odd
sizes and D = 1 included: the schedules that need an even D reject the others; at D = 1 one
plain schedule stands for all), ``W = P / (T D)``, every micro-batch size ``B`` with
``N = B̂ / (W B)`` integral, every registered schedule variant the sizes allow (GPipe, 1F1B,
interleaved with ``v`` dividing the layers, Chimera and Chimera-ZB with 2 and 4 pipes and every
concatenation, ZB-H1), layers partitioned uniformly or balanced by parameters
(``--partition-method``; the balanced split moves layers off the stages holding the embedding
and the LM head), with and without recomputation (``SearchSpace.recompute_granularities``: full
and/or selective), and with and without the distributed optimizer
(``SearchSpace.distributed_optimizer``; only where a stage-replica group has more than one
rank). The memory model drops layouts over the device memory before anything is simulated; a
recomputing layout is simulated only when the same layout with less recomputation does not fit
(recomputation only adds work, so otherwise it is dominated). The rest are simulated by
:class:`~megatron_chimera.tuning.perf_model.PerformanceModel` and ranked by samples/s.
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_chimera.config import ConfigError
from megatron_chimera.layout import ParallelLayout
from megatron_chimera.model.stage_split import empty_stages, expand_layout, is_layout
from megatron_chimera.schedules.registry import (
    PAIRED_SCHEDULES,
    SCHEDULE_NAMES,
    ScheduleSpec,
    get_spec,
)
from megatron_chimera.schedules.slices import SLICED_SCHEDULES
from megatron_chimera.schedules.walk import no_cyclic_gc
from megatron_chimera.tuning.perf_model import PerformanceModel, Prediction
from megatron_chimera.tuning.training_plan import TrainingPlan

# the MoE overlap schedules (DualPipe, DualPipeV, combined 1F1B) only when asked for (--schedules;
# with EP > 1 the others are also tried with --overlap-moe-expert-parallel-comm)
DEFAULT_SCHEDULES = tuple(n for n in SCHEDULE_NAMES if n not in PAIRED_SCHEDULES)
JSON_KEYS = ("schedule", "pipes", "T", "CP", "EP", "k", "D", "W", "B", "N", "recompute",
             "recompute_granularity",
             "sequence_parallel", "distributed_optimizer", "iteration_s", "samples_per_s",
             "peak_memory_bytes")


@dataclass(frozen=True)
class SearchSpace:
    """What the tuner may choose from."""

    num_gpus: int
    global_batch_size: int
    num_layers: int
    schedules: tuple[str, ...] = DEFAULT_SCHEDULES
    micro_batch_sizes: tuple[int, ...] | None = None  # None: powers of two that divide B̂ / W
    recompute: tuple[bool, ...] = (False, True)
    # schedule option -> values to try, overriding the registry's search values
    # (e.g. {"pipes": (2, 4, 8), "virtual_pipeline_size": (2,)})
    option_values: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    partition_methods: tuple[str, ...] = ("uniform", "parameters")
    # T to try (--tensor-model-parallel-sizes); None: every T dividing ``num_attention_heads``
    # up to ``gpus_per_node`` (tensor parallelism stays inside a node)
    tensor_parallel_sizes: tuple[int, ...] | None = (1,)
    sequence_parallel: bool = True  # with T > 1, split the residual stream too
    distributed_optimizer: tuple[bool, ...] = (False, True)
    recompute_granularities: tuple[str, ...] = ("full",)  # what a recomputing layout recomputes
    # D to try (--pipeline-model-parallel-sizes); None: every divisor of P / T up to the layers
    pipeline_parallel_sizes: tuple[int, ...] | None = None
    num_attention_heads: int = 0  # for the automatic T (0: T = 1 only)
    gpus_per_node: int = 1  # for the automatic T
    # CP to try (--context-parallel-sizes: ring attention over CP ranks per sequence)
    context_parallel_sizes: tuple[int, ...] = (1,)
    # k to try (--pipeline-sequence-slices: the sliced orders of 1f1b, zb-h1, chimera,
    # chimera-zb; k > 1 with the schedule's default options, D > 1 and CP = 1)
    sequence_slices: tuple[int, ...] = (1,)
    # MoE: the experts per layer (0: a dense model) and the EP to try
    # (--expert-model-parallel-sizes; None: every EP dividing the experts and T x CP x W);
    # ``overlap_all_to_all``: with EP > 1 each schedule that can pair is also tried with
    # --overlap-moe-expert-parallel-comm (building the paired orders costs search time)
    num_experts: int = 0
    expert_parallel_sizes: tuple[int, ...] | None = (1,)
    overlap_all_to_all: bool = False

    def __post_init__(self) -> None:
        if self.num_gpus < 1:
            raise ConfigError(f"--num-gpus must be positive, got {self.num_gpus}")
        if not self.recompute_granularities or set(self.recompute_granularities) - {
                "full", "selective"}:
            raise ConfigError(f"--recompute-granularity: choose full and/or selective, got "
                              f"{self.recompute_granularities}")
        if self.global_batch_size < 1:
            raise ConfigError(f"--global-batch-size must be positive, got "
                              f"{self.global_batch_size}")
        unknown = {m for m in self.partition_methods if not is_layout(m)} - {"uniform",
                                                                               "parameters"}
        if unknown or not self.partition_methods:
            raise ConfigError(f"--partition-methods: choose from uniform, parameters or "
                              f"layout strings; got {self.partition_methods}")
        for method in filter(is_layout, self.partition_methods):  # the search proposes runs
            if empty_stages(method):
                raise ConfigError(f"--pipeline-model-parallel-layout {method!r}: stage "
                                  f"{empty_stages(method)[0]} holds no transformer layer, which "
                                  f"training refuses (--predict prices it)")
        if self.micro_batch_sizes is not None and min(self.micro_batch_sizes, default=0) < 1:
            raise ConfigError(f"--micro-batch-sizes must be positive, got "
                              f"{self.micro_batch_sizes}")
        for name in self.schedules:
            get_spec(name)  # ValueError naming the choices for an unknown schedule
        if self.pipeline_parallel_sizes is not None and min(self.pipeline_parallel_sizes,
                                                            default=0) < 1:
            raise ConfigError(f"--pipeline-model-parallel-sizes must be positive, got "
                              f"{self.pipeline_parallel_sizes}")
        for flag, sizes in (("--context-parallel-sizes", self.context_parallel_sizes),
                            ("--pipeline-sequence-slices", self.sequence_slices)):
            if not sizes or min(sizes) < 1:
                raise ConfigError(f"{flag} must be positive, got {sizes}")
        if self.expert_parallel_sizes is not None and (
                not self.expert_parallel_sizes or min(self.expert_parallel_sizes) < 1):
            raise ConfigError(f"--expert-model-parallel-sizes must be positive, got "
                              f"{self.expert_parallel_sizes}")
        if self.tensor_parallel_sizes is not None and (
                not self.tensor_parallel_sizes or min(self.tensor_parallel_sizes) < 1):
            raise ConfigError(f"--tensor-model-parallel-sizes must be positive, got "
                              f"{self.tensor_parallel_sizes}")

    def candidate_tensor_sizes(self) -> list[int]:
        """The T to try before the GPU count is considered: the given ones, or every divisor
        of the heads up to one node."""
        if self.tensor_parallel_sizes is not None:
            return sorted(set(self.tensor_parallel_sizes))
        heads = max(self.num_attention_heads, 1)
        return [t for t in range(1, max(self.gpus_per_node, 1) + 1) if heads % t == 0]

    def tensor_sizes(self) -> list[int]:
        """The allowed T that divide the GPU count."""
        return [t for t in self.candidate_tensor_sizes() if self.num_gpus % t == 0]

    def pipeline_sizes(self, tensor_parallel: int = 1) -> list[int]:
        """Every D dividing the GPU count / T (odd and 1 included), at most one stage per
        layer."""
        gpus = self.num_gpus // tensor_parallel
        allowed = self.pipeline_parallel_sizes
        return [d for d in range(1, gpus + 1) if gpus % d == 0 and d <= self.num_layers
                and (allowed is None or d in allowed)]

    def why_empty(self) -> str | None:
        """One line naming the size constraint that leaves no layout to try (None: some
        (T, D, B) combination exists)."""
        if not self.tensor_sizes():
            return (f"no tensor-parallel size T: none of {self.candidate_tensor_sizes()} "
                    f"divides --num-gpus {self.num_gpus}")
        if not any(self.pipeline_sizes(t) for t in self.tensor_sizes()):
            given = ("" if self.pipeline_parallel_sizes is None else
                     f" among --pipeline-model-parallel-sizes {self.pipeline_parallel_sizes}")
            return (f"no pipeline size D: --num-gpus {self.num_gpus} / T has no divisor <= "
                    f"--num-layers {self.num_layers}{given}")
        widths = sorted({self.num_gpus // (t * d) for t in self.tensor_sizes()
                         for d in self.pipeline_sizes(t)})
        if not any(self.micro_batches_for(w) for w in widths):
            return (f"no micro-batch size: --global-batch-size {self.global_batch_size} is not "
                    f"a multiple of any data-parallel width W in {widths} (times a "
                    f"--micro-batch-sizes value)")
        ranks = sorted({t * c * (self.num_gpus // (t * d * c)) for t in self.tensor_sizes()
                        for c in self.context_parallel_sizes
                        if self.num_gpus % (t * c) == 0 for d in self.pipeline_sizes(t * c)})
        if self.num_experts and not any(self.expert_sizes(r) for r in ranks):
            return (f"no expert-parallel size EP: none of --expert-model-parallel-sizes "
                    f"{self.expert_parallel_sizes} divides both --num-experts "
                    f"{self.num_experts} and T x CP x W in {ranks}")
        return None

    def expert_sizes(self, ranks: int) -> list[int]:
        """The EP to try where expert ranks fold ``ranks`` (T x CP x W) ranks: those dividing
        both ``ranks`` and the experts (1 only for a dense model)."""
        if not self.num_experts:
            return [1]
        allowed = self.expert_parallel_sizes
        return [e for e in range(1, ranks + 1) if ranks % e == 0 and self.num_experts % e == 0
                and (allowed is None or e in allowed)]

    def micro_batches_for(self, W: int) -> list[int]:
        """Micro-batch sizes B with B̂ / (W B) a positive integer."""
        if self.global_batch_size % W:
            return []
        per_replica = self.global_batch_size // W
        if self.micro_batch_sizes is not None:
            return [b for b in self.micro_batch_sizes if per_replica % b == 0]
        sizes, b = [], 1
        while b <= per_replica:
            if per_replica % b == 0:
                sizes.append(b)
            b *= 2
        return sizes


def _variants(space: SearchSpace, spec: ScheduleSpec, D: int, N: int) -> Iterator[Any]:
    """The schedule's option sets (the registry's search values) that fit the model's layers."""
    for options in spec.variants(D, N, dict(space.option_values)):
        if space.num_layers % (D * spec.stages_per_rank(options)) == 0:
            yield options


def _partitions_for(space: SearchSpace, num_stages: int) -> Iterator[str]:
    """The partition methods to try at ``num_stages`` stages: every method name, and the layout
    strings with that many stages."""
    for method in space.partition_methods:
        if not is_layout(method) or len(expand_layout(method)) == num_stages:
            yield method


def _recomputations(space: SearchSpace) -> Iterator[tuple[bool, str]]:
    """(recompute, granularity) pairs to try: none, then selective before full."""
    for recompute in space.recompute:
        if not recompute:
            yield False, "full"
            continue
        for granularity in sorted(space.recompute_granularities, reverse=True):
            yield True, granularity


def _without_pipeline(specs: Sequence[ScheduleSpec]) -> list[ScheduleSpec]:
    """The schedules to try at D = 1: every schedule is then one rank running its micro-batches
    in turn, so only the first plain one (one pipe, one chunk per rank) is kept."""
    plain = [s for s in specs if s.pipes() == 1 and s.stages_per_rank() == 1
             and not s.split_backward]
    return plain[:1]


def _slices_for(space: SearchSpace, spec: ScheduleSpec, D: int, CP: int) -> list[int]:
    """The k to try for ``spec``: 1, and the others where the sliced orders exist."""
    sliced = (D > 1 and CP == 1 and spec.name in SLICED_SCHEDULES
              and space.num_layers % D == 0)
    return [k for k in sorted(set(space.sequence_slices)) if k == 1 or sliced]


def enumerate_layouts(space: SearchSpace) -> Iterator[TrainingPlan]:
    """Every layout of the search space (sizes not yet checked against the generators); at
    D = 1 one schedule (:func:`_without_pipeline`); context-parallel sizes CP and sequence
    slices k as the space allows (a sliced layout with the schedule's default options)."""
    specs = [get_spec(name) for name in space.schedules]
    for T, CP, D, W, B, N in _sizes(space):
        sequence_parallel = space.sequence_parallel and T > 1
        for spec in specs if D > 1 else _without_pipeline(specs):
            for k in _slices_for(space, spec, D, CP):
                variants = ([spec.options_type()] if k > 1
                            else list(_variants(space, spec, D, N)))
                for options in variants:
                    replicated = W * CP * getattr(options, "pipes", 1) > 1
                    stages = D * getattr(options, "virtual_pipeline_size", 1)
                    for partition in _partitions_for(space, stages):
                        for recompute, granularity in _recomputations(space):
                            for sharded in space.distributed_optimizer:
                                if sharded and not replicated:
                                    continue  # every stage-replica group has one rank
                                for EP, opts in _experts(space, T * CP * W, options):
                                    yield TrainingPlan(spec.name, D, W, B, N, recompute,
                                                       opts, partition, T,
                                                       sequence_parallel, sharded,
                                                       granularity, CP, k, EP)


def _experts(space: SearchSpace, ranks: int, options: Any) -> Iterator[tuple[int, Any]]:
    """(EP, options) to try: every EP of :meth:`SearchSpace.expert_sizes`, with EP > 1 and
    ``space.overlap_all_to_all`` also with the all-to-all overlap where the schedule has the
    option and it is not set."""
    for EP in space.expert_sizes(ranks):
        yield EP, options
        if (EP > 1 and space.overlap_all_to_all
                and getattr(options, "overlap_moe_expert_parallel_comm", True) is None):
            yield EP, dataclasses.replace(options, overlap_moe_expert_parallel_comm=True)


def _sizes(space: SearchSpace) -> Iterator[tuple[int, int, int, int, int, int]]:
    """(T, CP, D, W, B, N) of the space: W = P / (T CP D)."""
    for T in space.tensor_sizes():
        for CP in sorted(set(space.context_parallel_sizes)):
            if space.num_gpus % (T * CP):
                continue
            for D in space.pipeline_sizes(T * CP):
                W = ParallelLayout.from_world(space.num_gpus, T, D, CP).data
                for B in space.micro_batches_for(W):
                    yield T, CP, D, W, B, space.global_batch_size // (W * B)


@dataclass
class TuneResult:
    """Outcome of a search: ranked fitting predictions, rejected layouts and bookkeeping."""

    ranked: list[Prediction]
    over_memory: list[tuple[TrainingPlan, int]]  # layout, its peak bytes
    invalid: list[tuple[TrainingPlan, str]]  # layout, the generator's reason
    dominated: int = 0  # recomputing layouts skipped because the plain one fits
    pruned: int = 0  # layouts never built: their work bound exceeds the keep-th best time
    duplicates: int = 0  # balanced partitions equal to the uniform one
    memory_limit_bytes: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    empty_reason: str | None = None  # the size constraint that left nothing to try

    def why_empty(self) -> str:
        """One line naming the constraint that emptied the search."""
        if self.empty_reason is not None:
            return f"no layout to try: {self.empty_reason}"
        if self.over_memory:
            layout, peak = min(self.over_memory, key=lambda lp: lp[1])
            return (f"no layout fits in memory: the smallest peak is {peak / 2**30:.2f} GiB per "
                    f"rank ({layout.describe()}) over the {self.memory_limit_bytes / 2**30:.2f} "
                    f"GiB limit: raise --gpu-memory-gb, add GPUs, allow recomputation or lower "
                    f"--global-batch-size / --micro-batch-sizes")
        if self.invalid:
            reasons: dict[str, int] = {}
            for _, reason in self.invalid:
                reasons[reason] = reasons.get(reason, 0) + 1
            reason = max(reasons, key=reasons.get)
            return (f"every one of the {len(self.invalid)} layouts is invalid; the most common "
                    f"reason: {reason}")
        return "no layout to try: the schedules allow none of the sizes"

    @property
    def best(self) -> Prediction:
        """The highest-throughput layout that fits."""
        if not self.ranked:
            raise ConfigError(self.why_empty())
        return self.ranked[0]


@no_cyclic_gc()  # the search allocates millions of short-lived tuples, no cycles
def autotune(model: PerformanceModel, space: SearchSpace, memory_limit_bytes: int,
             keep: int | None = None) -> TuneResult:
    """Search ``space`` with ``model``; layouts whose peak rank memory exceeds the limit drop out.

    With ``keep`` set, branch and bound: layouts are visited by increasing work lower bound
    (:meth:`PerformanceModel.work_lower_bound`) and the search stops once that bound exceeds the
    ``keep``-th best iteration time found, so the first ``keep`` ranked layouts are exactly those
    of the exhaustive search (``keep=None``) while far fewer schedules are built and simulated.
    """
    start = time.perf_counter()
    result = TuneResult([], [], [], memory_limit_bytes=memory_limit_bytes,
                        empty_reason=space.why_empty())
    layouts = list(enumerate_layouts(space))
    bounds = {layout: model.work_lower_bound(layout) for layout in layouts}
    if keep is not None:
        layouts.sort(key=lambda layout: bounds[layout])
    fits: dict[TrainingPlan, bool] = {}
    times: list[float] = []  # sorted iteration times of the fitting layouts found so far
    for index, layout in enumerate(layouts):
        if keep is not None and len(times) >= keep and bounds[layout] > times[keep - 1]:
            result.pruned = len(layouts) - index
            break
        lighter = [dataclasses.replace(layout, recompute=False, recompute_granularity="full")]
        if layout.recompute_mode == "full":  # selective recomputes less
            lighter.append(dataclasses.replace(layout, recompute_granularity="selective"))
        if layout.recompute and any(fits.get(other, False) for other in lighter):
            result.dominated += 1
            continue
        try:
            if layout.partition != "uniform":
                uniform = dataclasses.replace(layout, partition="uniform")
                if model.partition(layout) == model.partition(uniform):
                    result.duplicates += 1  # the balanced split is the uniform one
                    continue
            memory = model.memory(layout)
        except (ValueError, ConfigError) as exc:
            result.invalid.append((layout, str(exc).splitlines()[0]))
            continue
        peak = max(m.total_bytes for m in memory)
        fits[layout] = peak <= memory_limit_bytes
        if not fits[layout]:
            result.over_memory.append((layout, peak))
            continue
        prediction = model.predict(layout, with_memory=False)
        prediction.memory = memory
        result.ranked.append(prediction)
        bisect.insort(times, prediction.iteration_s)
    result.ranked.sort(key=lambda p: (-p.samples_per_s, p.peak_memory_bytes))
    result.seconds = time.perf_counter() - start
    return result


def to_records(predictions: Sequence[Prediction]) -> list[dict]:
    """The ``--json`` records: exactly :data:`JSON_KEYS` per layout, in ranked order."""
    return [
        {
            "schedule": p.layout.label,
            "pipes": p.layout.pipes,
            "T": p.layout.T,
            "CP": p.layout.CP,
            "EP": p.layout.EP,
            "k": p.layout.slices,
            "D": p.layout.D,
            "W": p.layout.W,
            "B": p.layout.B,
            "N": p.layout.N,
            "recompute": p.layout.recompute,
            "recompute_granularity": p.layout.recompute_mode,
            "sequence_parallel": p.layout.sequence_parallel,
            "distributed_optimizer": p.layout.distributed_optimizer,
            "iteration_s": p.iteration_s,
            "samples_per_s": p.samples_per_s,
            "peak_memory_bytes": p.peak_memory_bytes,
        }
        for p in predictions
    ]


def format_table(predictions: Sequence[Prediction], memory_limit_bytes: int,
                 over_memory: Sequence[tuple[TrainingPlan, int]] = ()) -> str:
    """Text table: configuration, iteration time, samples/s, bubble ratio, peak memory, fits."""
    header = (f"{'#':>3}  {'schedule':<32}{'pipes':>5}{'T':>4}{'D':>5}{'W':>5}{'B':>5}{'N':>6}"
              f"{'recomp':>7}{'dist-opt':>9}{'iter [s]':>11}{'samples/s':>11}{'bubble':>8}"
              f"{'peak mem [GiB]':>16}{'fits':>6}")
    lines = [header, "-" * len(header)]

    def row(index: str, layout: TrainingPlan, cells: str, peak: int) -> str:
        fits = "yes" if peak <= memory_limit_bytes else "no"
        tensor = f"{layout.T}{'s' if layout.sequence_parallel else ''}"
        label = layout.label + (f" CP={layout.CP}" if layout.CP > 1 else "") + (
            f" k={layout.slices}" if layout.slices > 1 else "") + (
            f" EP={layout.EP}" if layout.EP > 1 else "") + (
            "+a2a" if getattr(layout.options, "overlap_moe_expert_parallel_comm", None)
            else "")
        recompute = {None: "no", "full": "yes", "selective": "sel"}[layout.recompute_mode]
        sharded = "yes" if layout.distributed_optimizer else "no"
        return (f"{index:>3}  {label:<32}{layout.pipes:>5}{tensor:>4}{layout.D:>5}"
                f"{layout.W:>5}{layout.B:>5}{layout.N:>6}{recompute:>7}{sharded:>9}"
                f"{cells}{peak / 2**30:>16.2f}{fits:>6}")

    for i, p in enumerate(predictions, 1):
        cells = f"{p.iteration_s:>11.4f}{p.samples_per_s:>11.1f}{p.bubble_ratio:>8.3f}"
        lines.append(row(str(i), p.layout, cells, p.peak_memory_bytes))
    for layout, peak in over_memory:
        lines.append(row("-", layout, f"{'-':>11}{'-':>11}{'-':>8}", peak))
    return "\n".join(lines)
