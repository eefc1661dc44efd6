"""The named steps that build a training run, each a small function: the stage modules of this
rank, the data-parallel state and optimizer, the checkpoint to resume from, the datasets, the
executors of a schedule and the monitor. :func:`setup_run` calls them in order and returns the
:class:`Run` the loop (:mod:`.training`) works on.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron_chimera import parallel_state
from megatron_chimera.checkpoint.async_save import AsyncCheckpointer
from megatron_chimera.checkpoint.checkpointing import StageSlice, get_rng_state, read_tracker
from megatron_chimera.checkpoint.host_memory import PeakHostMemory
from megatron_chimera.checkpoint.loading import (
    CheckpointTarget,
    load_checkpoint,
    resolve_checkpoint_dir,
)
from megatron_chimera.checkpoint.saved_args import check_checkpoint_args
from megatron_chimera.config import TrainConfig
from megatron_chimera.distributed.data_parallel import build_data_parallel
from megatron_chimera.distributed.grad_sync import GradientSynchronizer
from megatron_chimera.model.family import ModelFamily
from megatron_chimera.model.flops import training_flops
from megatron_chimera.model.stage_split import format_layout, stage_partition
from megatron_chimera.optimizer import (
    MegatronOptimizer,
    OptimizerParamScheduler,
    get_data_parallel_optimizer,
)
from megatron_chimera.pipeline.chrome_trace import PipelineTrace, traced_iterations
from megatron_chimera.pipeline.hang import HangWatch
from megatron_chimera.schedules.actions import Schedule
from megatron_chimera.schedules.measured import TraceFormat
from megatron_chimera.training.data_order import check_data_order
from megatron_chimera.training.memory_report import MemoryFigures, MemoryReport, predicted_memory
from megatron_chimera.training.monitor import Timers, TrainingMonitor, predicted_bubble_ratio
from megatron_chimera.training.preflight import check_resume_iteration
from megatron_chimera.training.restart import (
    recorded_progress,
    restart_count,
    restart_load,
    restart_report,
)
from megatron_chimera.training.running_schedule import ExecutorFactory, RunningSchedule
from megatron_chimera.training.startup_block import startup_block
from megatron_chimera.training.straggler import (
    StragglerDetector,
    expected_busy_by_kind,
    stages_held,
)

ModelProvider = Callable[..., nn.Module]
DatasetsProvider = Callable[[list[int]], tuple[Any, Any, Any]]


@dataclass
class TrainState:
    """Progress counters of a run (restored from checkpoints)."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    last_saved_iteration: int | None = None
    consecutive_skipped: int = 0


@dataclass(frozen=True)
class Instruments:
    """What watches the run without changing it: the ``--pipeline-trace`` recorder, the memory
    report of the first iteration and the hang watch (who waits for whom when an iteration
    stops moving)."""

    trace: PipelineTrace | None
    memory: MemoryReport | None
    hang_watch: HangWatch | None


@dataclass(frozen=True)
class Run:
    """Everything the loop works on: the configuration, this rank's stages, optimizer and LR
    schedule, the running schedule (with its executors and the profile-guided rebuild), the
    monitor and timers, the RNG state to start from (seeded or restored, re-applied before the
    loop), the instruments and the ``--async-save`` writer."""

    config: TrainConfig
    family: ModelFamily
    partition: list[tuple[int, int]]
    stages: list[StageSlice]
    optimizer: MegatronOptimizer
    scheduler: OptimizerParamScheduler
    pipeline: RunningSchedule
    monitor: TrainingMonitor
    timers: Timers
    rank: int
    world_size: int
    device: torch.device
    rng_state: dict[str, Any] | None
    instruments: Instruments
    checkpointer: AsyncCheckpointer | None  # --async-save: its own gloo group


def train_valid_test_num_samples(config: TrainConfig) -> list[int]:
    """Megatron's sample counts: train, and ``eval_iters`` per evaluation for valid and test."""
    training = config.training
    iters = training.total_train_iters
    evals = (iters // training.eval_interval + 1) * training.eval_iters
    return [training.total_train_samples, evals * training.global_batch_size,
            training.eval_iters * training.global_batch_size]


# ------------------------------------------------------------------------------ the steps
def build_stages(config: TrainConfig, family: ModelFamily, schedule: Schedule,
                 model_provider: ModelProvider, device: torch.device
                 ) -> tuple[list[tuple[int, int]], list[StageSlice]]:
    """The layer partition and this rank's stage modules (on ``device``); each stage's lowest
    replica rank writes its checkpoint file."""
    rank = dist.get_rank()
    if config.training.partition_method == "time":
        from megatron_chimera.tuning.profile import time_partition

        partition = time_partition(config, family, schedule, device, rank == 0)
    else:
        partition = stage_partition(config.training.layer_split,
                                    config.training.partition_method, config.model, family,
                                    schedule.num_stages,
                                    config.parallel.pipeline_model_parallel_size)
    if rank == 0:
        print(f" pipeline stages: {format_layout(partition)} (layers per stage "
              f"{[end - start for start, end in partition]})", flush=True)
    last = schedule.num_stages - 1
    stages = []
    for stage in sorted(schedule.stages_of_rank(parallel_state.get_pipeline_model_parallel_rank())):
        module = model_provider(pre_process=stage == 0, post_process=stage == last,
                                layer_range=partition[stage], stage=stage).to(device)
        writer = rank == min(parallel_state.get_stage_replica_ranks(stage))
        stages.append(StageSlice(stage, partition[stage], module, writer=writer))
    return partition, stages


def build_optimizer(config: TrainConfig, stages: list[StageSlice]
                    ) -> tuple[GradientSynchronizer, MegatronOptimizer, OptimizerParamScheduler]:
    """The gradient synchronizer, the optimizer over this rank's stages and the LR schedule."""
    data_parallel = build_data_parallel(config.ddp, {s.stage: s.module for s in stages})
    optimizer = get_data_parallel_optimizer(config.optimizer, data_parallel)
    train_samples = config.training.total_train_samples
    scheduler = OptimizerParamScheduler.from_config(optimizer, config.optimizer, train_samples)
    return data_parallel.grad_sync, optimizer, scheduler


def load_state(config: TrainConfig, family: ModelFamily, schedule: Schedule,
               stages: list[StageSlice], optimizer: MegatronOptimizer,
               scheduler: OptimizerParamScheduler, state: TrainState) -> dict[str, Any]:
    """Resume from ``--load`` when it holds a checkpoint (its model arguments checked against
    this run); returns the loaded checkpoint's arguments (empty when nothing was loaded)."""
    ckpt = config.checkpoint
    rank, world_size = dist.get_rank(), dist.get_world_size()
    saved_args: dict[str, Any] = {}
    load = restart_load(ckpt.load, ckpt.save)
    if load is None:
        return saved_args
    if load != ckpt.load:
        os.makedirs(load, exist_ok=True)  # (the first attempt may have died before saving)
        ckpt = dataclasses.replace(ckpt, load=load)

    def check_args(args: dict[str, Any], path: str) -> None:
        check_checkpoint_args(config, args, path, family=family)
        saved_args.update(args)
        if not ckpt.finetune and (saved_iteration or 0) > 0:  # (iteration 0: nothing consumed)
            note = check_data_order(config, args, path)
            if note is not None and rank == 0:
                print(note, flush=True)

    saved_iteration = read_tracker(ckpt.load)
    if saved_iteration is not None and not ckpt.finetune:
        check_resume_iteration(saved_iteration, config,
                               resolve_checkpoint_dir(ckpt.load, saved_iteration))
    memory = PeakHostMemory()
    target = CheckpointTarget(
        stages, schedule.num_stages, optimizer, scheduler, load_optim=not ckpt.no_load_optim,
        load_rng=not ckpt.no_load_rng, finetune=ckpt.finetune, check_args=check_args)
    loaded = load_checkpoint(ckpt.load, target, rank=rank, world_size=world_size)
    if rank == 0 and restart_count() > 0:
        print(restart_report(restart_count(), load, loaded and loaded.iteration,
                             recorded_progress(ckpt.save)), flush=True)
    if loaded is not None:
        state.iteration = loaded.iteration
        state.consumed_train_samples = loaded.consumed_train_samples
        state.consumed_valid_samples = loaded.consumed_valid_samples
        _report_load(loaded, memory, rank, world_size)
    elif rank == 0:
        print(f" no checkpoint in {ckpt.load} (no tracker file): training from scratch",
              flush=True)
    return saved_args


def _report_load(loaded: Any, memory: PeakHostMemory, rank: int, world_size: int) -> None:
    """Rank 0 prints the loaded checkpoint, the load time, every rank's bytes read and peak host
    memory added while loading (one gather of three numbers per rank)."""
    figures: list[Any] = [None] * world_size
    peak = memory.added_bytes()
    dist.all_gather_object(figures, (loaded.bytes_read, time.perf_counter() - memory.started,
                                     None if peak is None else round(peak / 2**20, 1)))
    if rank == 0:
        print(f" loaded checkpoint {loaded.path} at iteration {loaded.iteration} in "
              f"{max(f[1] for f in figures):.2f} s; checkpoint bytes read per rank: "
              f"{[f[0] for f in figures]}; peak host memory added per rank (MB): "
              f"{[f[2] for f in figures]}", flush=True)


def build_datasets(provider: DatasetsProvider, config: TrainConfig) -> tuple[Any, Any, Any]:
    """(train, valid, test) datasets. Megatron's pattern: rank 0 builds the dataset index
    caches (atomically, once); after the barrier every other rank finds them on disk and only
    memory-maps them."""
    num_samples = train_valid_test_num_samples(config)
    rank = dist.get_rank()
    datasets = provider(num_samples) if rank == 0 else None
    dist.barrier()
    return provider(num_samples) if rank != 0 else datasets


def build_monitor(config: TrainConfig, family: ModelFamily, schedule: Schedule,
                  partition: list[tuple[int, int]]) -> TrainingMonitor:
    """The log lines and TensorBoard writer, on the logging rank (the last: where the executor
    gathers losses and busy times). With uneven stages asked for (a layout, first/last layers)
    the predicted bubble costs each stage by its layers."""
    world_size = dist.get_world_size()
    flops = training_flops(config.model, family, config.training.global_batch_size)
    predicted = None
    if config.logging.log_bubble_ratio:
        layers = [float(end - start) for start, end in partition]
        predicted = (predicted_bubble_ratio(schedule, layers, [2 * n for n in layers])
                     if config.training.layer_split.given else predicted_bubble_ratio(schedule))
    monitor = TrainingMonitor.create(config, flops, world_size, predicted,
                                     enabled=dist.get_rank() == world_size - 1)
    if config.logging.log_straggler and monitor.enabled:
        layout = config.parallel.layout
        pipeline_rank_of = [layout.coordinates(rank)[0] for rank in range(world_size)]
        kinds = expected_busy_by_kind(
            schedule, [float(end - start) for start, end in partition], pipeline_rank_of)
        monitor.straggler = StragglerDetector(
            [sum(k.values()) for k in kinds], minmax_count=config.logging.straggler_minmax_count,
            expected_kinds=kinds, positions=stages_held(schedule, pipeline_rank_of))
    return monitor


def setup_run(config: TrainConfig, family: ModelFamily, schedule: Schedule,
              model_provider: ModelProvider, forward_step_func: Callable,
              state: TrainState, device: torch.device) -> tuple[Run, dict[str, Any]]:
    """Stages, optimizer, the resumed state, executors and monitor of this rank (after the
    process groups exist); returns the run and the loaded checkpoint's arguments."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == 0 and "replaces" in schedule.meta:
        print(f" running {schedule.describe()} instead of {schedule.meta['replaces']}",
              flush=True)
    if rank == 0:
        for line in startup_block(config, schedule, world_size, predicted_bubble_ratio(schedule)):
            print(line, flush=True)
    partition, stages = build_stages(config, family, schedule, model_provider, device)
    grad_sync, optimizer, scheduler = build_optimizer(config, stages)
    saved_args = load_state(config, family, schedule, stages, optimizer, scheduler, state)
    rng_state = get_rng_state()  # seeded, or restored from the checkpoint
    executors = ExecutorFactory(config, stages, forward_step_func, grad_sync, optimizer, device)
    pipeline = RunningSchedule(config, schedule, executors,
                               all_stages=every_stage_reads_batch(config, family))
    run = Run(config=config, family=family, partition=partition, stages=stages,
              optimizer=optimizer, scheduler=scheduler, pipeline=pipeline,
              monitor=build_monitor(config, family, schedule, partition),
              timers=Timers(config.logging.timing_log_level), rank=rank,
              world_size=world_size, device=device, rng_state=rng_state,
              instruments=build_instruments(config, family, partition, state, pipeline, device),
              checkpointer=build_checkpointer(config))
    return run, saved_args


def every_stage_reads_batch(config: TrainConfig, family: ModelFamily) -> bool:
    """Whether every stage reads the whole batch: BERT's padding mask, GPT's document mask
    (--reset-attention-mask, --variable-seq-lengths) and the per-document rotary positions
    (--reset-position-ids with RoPE) reach every stage; with --calculate-per-token-loss every
    rank counts the trained tokens of all its replica's micro-batches (a Chimera pipe's last
    stage reads only its pipe's)."""
    rotary_positions = (config.data.reset_position_ids
                        and config.model.position_embedding_type == "rope")
    return (family.every_stage_reads_batch or config.data.reset_attention_mask
            or config.data.variable_seq_lengths or rotary_positions
            or config.training.calculate_per_token_loss)


def build_instruments(config: TrainConfig, family: ModelFamily,
                      partition: list[tuple[int, int]], state: TrainState,
                      pipeline: RunningSchedule, device: torch.device) -> Instruments:
    """The trace recorder, the memory report and the started hang watch of the run."""
    trace = build_trace(config, state, device)
    memory = build_memory_report(config, family, pipeline.schedule, partition, state, device)
    # the report done before the backend's own timeout error: 60% of the timeout
    threshold = 0.6 * 60 * config.parallel.distributed_timeout_minutes
    hang_watch = HangWatch(lambda: pipeline.executor, threshold).start()
    return Instruments(trace=trace, memory=memory, hang_watch=hang_watch)


def build_checkpointer(config: TrainConfig) -> AsyncCheckpointer | None:
    """The background writer of ``--async-save`` (every rank creates its group, in the same
    order), else None."""
    if not config.checkpoint.async_save:
        return None
    return AsyncCheckpointer(dist.new_group(backend="gloo"))


def build_memory_report(config: TrainConfig, family: ModelFamily, schedule: Schedule,
                        partition: list[tuple[int, int]], state: TrainState,
                        device: torch.device) -> MemoryReport:
    """The memory report of the run's first iteration, with every rank's prediction (zeros, and
    a line saying why, when the model cannot be costed)."""
    try:
        predicted = predicted_memory(config, family, schedule, partition, device.type)
    except (ValueError, KeyError) as exc:
        if dist.get_rank() == 0:
            print(f" memory prediction unavailable: {exc}", flush=True)
        predicted = [MemoryFigures(0, 0, 0, 0, 0, 0)] * schedule.num_ranks
    return MemoryReport(state.iteration + 1, predicted)


def build_trace(config: TrainConfig, state: TrainState, device: torch.device
                ) -> PipelineTrace | None:
    """The recorder of ``--pipeline-trace`` (None without it): two iterations after a warm-up."""
    path = config.logging.pipeline_trace
    if path is None:
        return None
    place = {TraceFormat.PIPELINE_RANK: parallel_state.get_pipeline_model_parallel_rank(),
             TraceFormat.DATA_PARALLEL_RANK: parallel_state.get_data_parallel_rank(),
             TraceFormat.TENSOR_RANK: parallel_state.get_tensor_model_parallel_rank()}
    place["place"] = ", ".join(f"{k.split('_')[0]} {v}" for k, v in place.items())
    iterations = traced_iterations(state.iteration, config.training.total_train_iters)
    return PipelineTrace(path, iterations, dist.get_rank(), device, place)

