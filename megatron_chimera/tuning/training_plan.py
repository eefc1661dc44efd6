"""A training layout the performance model prices: schedule, parallel sizes and batch shape.

:class:`TrainingPlan` holds what one candidate of the autotuner (or one ``--predict`` line)
fixes -- the schedule and its options, D, W, T, CP, EP, sequence slices, the micro-batch size B and
count N, recomputation, sequence parallelism and the distributed optimizer -- and builds its
schedule (data) for :class:`~megatron_chimera.tuning.perf_model.PerformanceModel` to cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_chimera.config import ConfigError
from megatron_chimera.schedules.actions import Schedule
from megatron_chimera.schedules.registry import ScheduleSpec, get_spec
from megatron_chimera.schedules.slices import sliced_schedule

#: runtimes other than ours a published row ran on, and the schedules each runs
RUNTIMES: dict[str, frozenset[str]] = {
    "megatron": frozenset({"1f1b", "interleaved"}),
    "zb": frozenset({"zb-h1", "zb-2p", "zbv"}),
}


@dataclass(frozen=True)
class TrainingPlan:
    """One point of the search: schedule and its typed options (the registry's), D, W, B, N,
    recomputation, the partition method, the tensor-parallel size T and sequence parallelism."""

    schedule: str  # --pipeline-schedule
    D: int  # pipeline stages (ranks per pipeline)
    W: int  # data-parallel width
    B: int  # micro-batch size
    N: int  # micro-batches per pipeline per iteration
    recompute: bool = False
    options: Any = None  # the schedule's options dataclass (None: its defaults)
    partition: str = "uniform"  # --partition-method: uniform | parameters
    T: int = 1  # --tensor-model-parallel-size
    sequence_parallel: bool = False  # --sequence-parallel (with T > 1)
    # --use-distributed-optimizer (with --overlap-param-gather): optimizer state sharded over
    # each stage-replica group, gradients reduce-scattered, parameters all-gathered
    distributed_optimizer: bool = False
    # with ``recompute``: --recompute-granularity full (the whole layer) or selective (the
    # attention core)
    recompute_granularity: str = "full"
    CP: int = 1  # --context-parallel-size (ring attention, --cp-comm-type p2p)
    slices: int = 1  # --pipeline-sequence-slices k (N sequences run as N k units)
    # --expert-model-parallel-size: MoE experts split over EP ranks folded out of T x CP x W
    # (the overlap of their all-to-alls is the schedule option
    # --overlap-moe-expert-parallel-comm)
    EP: int = 1
    # the runtime that runs the schedule (RUNTIMES): ours (async pipeline messages, the step
    # synchronises the ranks), megatron (Megatron-LM's blocking exchanges: 1f1b, interleaved)
    # or zb (the zero-bubble runtime: async messages, post-validated step, so back-to-back
    # iterations overlap at the step boundary)
    runtime: str = "ours"

    def __post_init__(self) -> None:
        if self.options is None:
            object.__setattr__(self, "options", self.spec.options_type())
        if self.recompute_granularity not in ("full", "selective"):
            raise ConfigError(f"--recompute-granularity must be 'full' or 'selective', got "
                              f"{self.recompute_granularity!r}")
        if self.runtime != "ours" and self.runtime not in RUNTIMES:
            raise ConfigError(f"runtime {self.runtime!r} is not one of "
                              f"{['ours', *sorted(RUNTIMES)]}")
        if self.runtime != "ours" and self.schedule not in RUNTIMES[self.runtime]:
            raise ConfigError(f"runtime {self.runtime!r} runs the schedules "
                              f"{sorted(RUNTIMES[self.runtime])}, not {self.schedule!r}")

    @staticmethod
    def runtime_of(schedule: str) -> str:
        """The runtime (not ours) that runs ``schedule``: ``megatron`` or ``zb``."""
        return next(name for name, schedules in RUNTIMES.items() if schedule in schedules)

    @property
    def p2p_exchange(self) -> str:
        """How the runtime moves pipeline messages (``CostModel.p2p_exchange``)."""
        if self.runtime != "megatron":
            return "async"
        return "blocking-paired" if self.schedule == "interleaved" else "blocking"

    @property
    def steps_overlap(self) -> bool:
        """Whether back-to-back iterations overlap at the step boundary (no synchronising
        step: the iteration period is the longest rank span, not the makespan)."""
        return self.runtime == "zb"

    @property
    def recompute_mode(self) -> str | None:
        """None, ``full`` or ``selective``."""
        return self.recompute_granularity if self.recompute else None

    @classmethod
    def of(cls, schedule: str, D: int, W: int, B: int, N: int, recompute: bool = False,
           partition: str = "uniform", T: int = 1, sequence_parallel: bool = False,
           distributed_optimizer: bool = False, recompute_granularity: str = "full",
           runtime: str = "ours", **options: Any) -> TrainingPlan:
        """A layout with the schedule's options given as keywords (``pipes=4, concat=...``)."""
        return cls(schedule, D, W, B, N, recompute, get_spec(schedule).options_type(**options),
                   partition, T, sequence_parallel, distributed_optimizer,
                   recompute_granularity, runtime=runtime)

    @property
    def num_gpus(self) -> int:
        """Ranks of the layout: T x CP x W x D."""
        return self.T * self.CP * self.W * self.D

    @property
    def spec(self) -> ScheduleSpec:
        """The registry's spec of the schedule."""
        return get_spec(self.schedule)

    @property
    def pipes(self) -> int:
        """Pipes of the schedule (2f for Chimera, 2 for BitPipe, else 1)."""
        return self.spec.pipes(self.options)

    @property
    def virtual(self) -> int:
        """Model chunks per rank and pipe (interleaved: v; V-shaped: 2), else 1."""
        return self.spec.stages_per_rank(self.options)

    @property
    def global_batch_size(self) -> int:
        """Samples per iteration: B x N x W."""
        return self.B * self.N * self.W

    @property
    def num_stages(self) -> int:
        """Model stages: D, or D x v for the interleaved and V-shaped schedules."""
        return self.D * self.virtual

    def build_schedule(self, attention_fraction: float = 0.0) -> Schedule:
        """The layout's schedule (ValueError if it cannot run at these sizes); with slices the
        sliced order, built for ``attention_fraction`` of the work in attention."""
        if self.slices > 1:
            if self.options != self.spec.options_type():
                raise ValueError("--pipeline-sequence-slices takes the schedule's default "
                                 "options only")
            return sliced_schedule(self.schedule, self.D, self.N, self.slices,
                                   attention_fraction=attention_fraction)
        return self.spec.build(self.D, self.N, self.options)

    @property
    def label(self) -> str:
        """Schedule label ``name[/variant][@partition]``: ``chimera/direct``, ``interleaved/v2``,
        ``1f1b@parameters`` (layers balanced by parameters instead of uniform)."""
        name = self.spec.label(self.options)
        return name if self.partition == "uniform" else f"{name}@{self.partition}"

    def describe(self) -> str:
        """Compact one-line description for tables."""
        pipes = f" pipes={self.pipes}" if self.pipes > 1 else ""
        tensor = f" T={self.T}" if self.T > 1 else ""
        sp = " sequence-parallel" if self.sequence_parallel and self.T > 1 else ""
        tensor += f" CP={self.CP}" if self.CP > 1 else ""
        tensor += f" k={self.slices}" if self.slices > 1 else ""
        tensor += f" EP={self.EP}" if self.EP > 1 else ""
        if getattr(self.options, "overlap_moe_expert_parallel_comm", None):
            tensor += " overlap-a2a"
        return (f"{self.label}{pipes}{tensor} D={self.D} W={self.W} B={self.B} N={self.N}"
                f"{' recompute' if self.recompute else ''}"
                f"{'-selective' if self.recompute_mode == 'selective' else ''}{sp}"
                f"{' dist-opt' if self.distributed_optimizer else ''}"
                f"{'' if self.runtime == 'ours' else f' on {self.runtime}'}")
