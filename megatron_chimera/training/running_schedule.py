"""The schedule a run executes now, and everything that depends on it.

:class:`RunningSchedule` is the one owner of the running schedule: its training and evaluation
executors (built by :class:`ExecutorFactory`), the micro-batches this rank reads, the per-N cache
of ``--rampup-batch-size`` (each N's schedule, executor and read micro-batches, built on first
use and kept), and the profile-guided rebuild (``--profile-iterations``: the profiling window,
the switch to the rebuilt order, the measured-costs record the checkpoints keep). The loop asks
it for the executor of each iteration and never swaps its parts itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_chimera import parallel_state
from megatron_chimera.checkpoint.checkpointing import StageSlice
from megatron_chimera.config import TrainConfig
from megatron_chimera.distributed.grad_sync import GradientSynchronizer
from megatron_chimera.model.dropout_rng import keyed_forward_step
from megatron_chimera.model.loss_normalization import microbatch_units
from megatron_chimera.optimizer import MegatronOptimizer
from megatron_chimera.pipeline.executor import (
    ExecutorPolicy,
    Gradients,
    PipelineExecutor,
    StageWork,
    make_transport,
)
from megatron_chimera.pipeline.profiling import ProfileRebuild, profiled_record
from megatron_chimera.pipeline.topology import PipelineTopology
from megatron_chimera.pipeline.transport import Transport
from megatron_chimera.schedules.actions import Schedule
from megatron_chimera.schedules.measured import RebuildReport
from megatron_chimera.training.config_checks import schedule_for_microbatches


def p2p_tensor_shape(config: TrainConfig) -> tuple[int, int, int]:
    """Shape of every pipeline message: ``[s/CP, b, h]`` (this context rank's tokens), or
    ``[s/(CP T), b, h]`` (this rank's chunk of them) under sequence parallelism; ``s/k`` tokens
    of one slice with ``--pipeline-sequence-slices k``."""
    model, parallel = config.model, config.parallel
    seq = model.seq_length // parallel.context_parallel_size // parallel.pipeline_sequence_slices
    if model.sequence_parallel and parallel.tensor_model_parallel_size > 1:
        seq //= parallel.tensor_model_parallel_size
    return (seq, config.training.micro_batch_size, model.hidden_size)


def needed_microbatches(schedule: Schedule, pipeline_rank: int,
                        all_stages: bool) -> list[int] | None:
    """Micro-batches whose first or last stage this rank holds (None: every one). A sliced
    schedule's units are read by every stage (each keeps its sequence's key/value cache)."""
    if all_stages or schedule.sequence_slices > 1:
        return None
    last = schedule.num_stages - 1
    pipes = {pipe for pipe, stage in schedule.replicas_of_rank(pipeline_rank)
             if stage in (0, last)}
    return [m for p in sorted(pipes) for m in schedule.microbatches_of_pipe(p)]


class ExecutorFactory:
    """Both executors (training, evaluation) of any schedule of this run; each lowers and
    validates it. They share the transport of the running schedule, so its connections stay
    and only a direction it never used is connected, in the one global order, before the first
    iteration (message tags depend on the pipes and N: other ones get their own transport).
    They share the one gradient synchronizer too: it depends on the buffers, not on the
    order."""

    def __init__(self, config: TrainConfig, stages: list[StageSlice],
                 forward_step_func: Callable, grad_sync: GradientSynchronizer,
                 optimizer: MegatronOptimizer, device: torch.device) -> None:
        self.topology = PipelineTopology.from_parallel_state()
        model = config.model
        self.work = StageWork({s.stage: s.module for s in stages},
                              keyed_forward_step(forward_step_func, device),
                              p2p_tensor_shape(config), model.torch_dtype, device)
        self.data_parallel_size = config.parallel.data_parallel_size
        self.grad_sync, self.scale_loss = grad_sync, optimizer.scale_loss
        self.transports: dict[tuple[int, int], Transport] = {}
        # compute time per action kind, only where --log-straggler reads it
        self.train_policy = ExecutorPolicy(time_kinds=config.logging.log_straggler)

    def _transport(self, schedule: Schedule) -> Transport:
        sizes = (schedule.num_pipes, schedule.num_microbatches)
        if sizes not in self.transports:
            self.transports[sizes] = make_transport(self.topology, lambda m: m.tag(*sizes))
        return self.transports[sizes]

    def train_executor(self, schedule: Schedule) -> PipelineExecutor:
        """The training executor of ``schedule`` (losses divided by its sequences x W: a
        sliced schedule's slice losses already sum to their sequence's)."""
        divisor = microbatch_units(schedule.num_sequences, self.data_parallel_size)
        return PipelineExecutor(schedule, self.topology, self.work,
                                Gradients(divisor, self.grad_sync, self.scale_loss),
                                self.train_policy, transport=self._transport(schedule))

    def __call__(self, schedule: Schedule) -> tuple[PipelineExecutor, PipelineExecutor]:
        divisor = microbatch_units(schedule.num_sequences, self.data_parallel_size)
        return (self.train_executor(schedule),
                PipelineExecutor(schedule, self.topology, self.work, Gradients(divisor),
                                 ExecutorPolicy(time_kinds=False),
                                 transport=self._transport(schedule)))


@dataclass(frozen=True)
class _Training:
    """One N's training schedule, its executor and the micro-batches this rank reads."""

    schedule: Schedule
    executor: PipelineExecutor
    needed: list[int] | None


class RunningSchedule:
    """The running schedule, its executors and read micro-batches, the ramp-up's per-N cache and
    the profile-guided rebuild (module docstring)."""

    def __init__(self, config: TrainConfig, schedule: Schedule, executors: ExecutorFactory,
                 all_stages: bool) -> None:
        self.config = config
        self.executors = executors
        self.all_stages = all_stages  # every micro-batch is read on every rank
        self.profile: ProfileRebuild | None = None  # the profiling window, while it lasts
        self.profiled: dict[str, Any] | None = None  # measured costs and the schedule they rebuilt
        self._by_microbatches: dict[int, _Training] = {}
        executor, self.eval_executor = executors(schedule)
        self._training = _Training(schedule, executor, self._needed(schedule))
        self.eval_needed_microbatches = self._training.needed  # its N stays during a ramp-up

    def _needed(self, schedule: Schedule) -> list[int] | None:
        return needed_microbatches(schedule, parallel_state.get_pipeline_model_parallel_rank(),
                                   all_stages=self.all_stages)

    @property
    def schedule(self) -> Schedule:
        """The training schedule running now."""
        return self._training.schedule

    @property
    def executor(self) -> PipelineExecutor:
        """The training executor of the running schedule."""
        return self._training.executor

    @property
    def needed_microbatches(self) -> list[int] | None:
        """The training micro-batches this rank reads (None: all)."""
        return self._training.needed

    def batch_size(self) -> int:
        """The global batch of the running schedule (smaller during ``--rampup-batch-size``)."""
        training = self.config.training
        return self.schedule.num_sequences * (training.global_batch_size
                                              // training.num_microbatches)

    def use_microbatches(self, num_microbatches: int) -> None:
        """Train with ``num_microbatches`` per iteration from now on (``--rampup-batch-size``):
        each N's schedule, executor and read micro-batches are built on first use and kept."""
        current = self.schedule.num_sequences  # data micro-batches (a sliced one: k units)
        if num_microbatches == current:
            return
        self._by_microbatches[current] = self._training
        if num_microbatches not in self._by_microbatches:
            schedule = schedule_for_microbatches(self.config, num_microbatches)
            self._by_microbatches[num_microbatches] = _Training(
                schedule, self.executors.train_executor(schedule), self._needed(schedule))
        self._training = self._by_microbatches[num_microbatches]

    def start_profiling(self, profile: ProfileRebuild | None) -> None:
        """Profile the next iterations with ``profile`` (None: no profiling window)."""
        self.profile = profile

    def start_iteration(self) -> None:
        """Before an iteration: time it while the profiling window lasts."""
        if self.profile is not None:
            self.profile.start_iteration(self.executor)

    def finish_iteration(self) -> RebuildReport | None:
        """After an iteration: the rebuild decided at the end of the profiling window (a
        collective then, on every rank), else None."""
        if self.profile is None:
            return None
        return self.profile.finish_iteration(self.executor)

    def adopt(self, report: RebuildReport) -> None:
        """End the profiling window with ``report``: keep its record for the checkpoints and,
        when the order changed, run the rebuilt schedule (both executors, the same placement:
        the same stages) from the next iteration on."""
        self.profile = None
        self.profiled = profiled_record(report)
        if not report.changed:
            return
        executor, self.eval_executor = self.executors(report.schedule)
        self._training = _Training(report.schedule, executor, self._needed(report.schedule))
        self.eval_needed_microbatches = self._training.needed
