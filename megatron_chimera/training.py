"""``pretrain()``: Megatron's training driver for any pipeline schedule.

Initialise torch.distributed and the process groups of the schedule's placement, partition the
layers into stages, build this rank's stage modules with ``model_provider``, the optimizer over
all of them, the data iterators and the executors; then loop: run the schedule, step the
optimizer, step the LR schedule, log, evaluate, checkpoint, exit. Nothing here knows which
schedule is in use.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron_chimera import parallel_state
from megatron_chimera.arguments import build_schedule_for, parse_args_and_schedule
from megatron_chimera.checkpointing import StageSlice, load_checkpoint, save_checkpoint
from megatron_chimera.config import ConfigError, TrainConfig
from megatron_chimera.data.samplers import build_data_iterator, next_microbatches
from megatron_chimera.initialize import default_backend, initialize_megatron
from megatron_chimera.model.family import GPT2, ModelFamily
from megatron_chimera.model.flops import training_flops
from megatron_chimera.model.partition import partition_layers
from megatron_chimera.monitor import IterationStats, Timers, TrainingMonitor, predicted_bubble_ratio
from megatron_chimera.optimizer import OptimizerParamScheduler, get_megatron_optimizer
from megatron_chimera.pipeline.executor import PipelineExecutor
from megatron_chimera.pipeline.grad_sync import GradientSynchronizer, shared_embedding_weight
from megatron_chimera.pipeline.profile_rebuild import ProfileRebuild
from megatron_chimera.pipeline.topology import PipelineTopology
from megatron_chimera.schedules.actions import Schedule
from megatron_chimera.schedules.fallback import FallbackRefused
from megatron_chimera.schedules.rebuild import RebuildReport

ModelProvider = Callable[..., nn.Module]
DatasetsProvider = Callable[[list[int]], tuple[Any, Any, Any]]


@dataclass
class TrainState:
    """Progress counters of a run (restored from checkpoints)."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    last_saved_iteration: int | None = None


@dataclass
class _Run:
    """Everything ``pretrain`` builds for the loop."""

    config: TrainConfig
    schedule: Schedule
    partition: list[tuple[int, int]]
    stages: list[StageSlice]
    optimizer: Any
    scheduler: OptimizerParamScheduler
    executor: PipelineExecutor
    eval_executor: PipelineExecutor
    monitor: TrainingMonitor
    timers: Timers
    needed_microbatches: list[int] | None
    rank: int
    world_size: int
    make_executors: Callable[[Schedule], tuple[PipelineExecutor, PipelineExecutor]]
    profile: ProfileRebuild | None = None


# ------------------------------------------------------------------------------ setup
def build_tokenizer_for(config: TrainConfig) -> tuple[Any, TrainConfig]:
    """The run's tokenizer (NullTokenizer over ``--vocab-size`` for bare ``--mock-data``) and the
    config with the model's vocabulary set to the tokenizer's."""
    from megatron_chimera.data.tokenizers import build_tokenizer

    data = config.data
    tokenizer = build_tokenizer(
        data.tokenizer_type or "NullTokenizer", tokenizer_model=data.tokenizer_model,
        vocab_file=data.vocab_file, merge_file=data.merge_file, vocab_size=data.vocab_size,
        make_vocab_size_divisible_by=config.model.make_vocab_size_divisible_by)
    model = dataclasses.replace(config.model, vocab_size=tokenizer.vocab_size)
    return tokenizer, dataclasses.replace(config, model=model)


def initialize(config: TrainConfig, schedule) -> torch.device:
    """torch.distributed, the schedule's process groups and seeds (``initialize_megatron``).

    A plain ``python pretrain_*.py`` (no torchrun environment, world size 1) gets an in-memory
    store, so single-process runs need no port. Returns this rank's device.
    """
    parallel = config.parallel
    backend = parallel.distributed_backend or default_backend()
    if not dist.is_initialized() and "RANK" not in os.environ and parallel.world_size == 1:
        if backend == "nccl":
            torch.cuda.set_device(0)
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1,
            timeout=timedelta(minutes=parallel.distributed_timeout_minutes))
    initialize_megatron(parallel, schedule, config.training.seed)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _norm_filter(stage_modules: dict[int, nn.Module]) -> Callable[[nn.Parameter], bool]:
    """Count each stage once in the global grad norm: on its owner, tied copy with stage 0."""
    counted: set[int] = set()
    for stage, module in stage_modules.items():
        if not parallel_state.is_stage_owner(stage):
            continue
        shared = shared_embedding_weight(module)
        for param in module.parameters():
            if param is shared and stage != 0:
                continue
            counted.add(id(param))
    return lambda param: id(param) in counted


def _needed_microbatches(schedule, pipeline_rank: int, all_stages: bool) -> list[int] | None:
    """Micro-batches whose first or last stage this rank holds (None: every one)."""
    if all_stages:
        return None
    last = schedule.num_stages - 1
    pipes = {pipe for pipe, stage in schedule.replicas_of_rank(pipeline_rank)
             if stage in (0, last)}
    return [m for p in sorted(pipes) for m in schedule.microbatches_of_pipe(p)]


def _train_valid_test_num_samples(config: TrainConfig) -> list[int]:
    """Megatron's sample counts: train, and ``eval_iters`` per evaluation for valid and test."""
    training = config.training
    iters = training.total_train_iters
    evals = (iters // training.eval_interval + 1) * training.eval_iters
    return [iters * training.global_batch_size, evals * training.global_batch_size,
            training.eval_iters * training.global_batch_size]


def _setup(train_valid_test_datasets_provider: DatasetsProvider, model_provider: ModelProvider,
           forward_step_func: Callable, config: TrainConfig, family: ModelFamily,
           schedule: Schedule, state: TrainState) -> tuple[_Run, tuple[Any, Any, Any]]:
    parallel = config.parallel
    device = initialize(config, schedule)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    pipeline_rank = parallel_state.get_pipeline_model_parallel_rank()
    if rank == 0 and "replaces" in schedule.meta:
        print(f" running {schedule.describe()} instead of {schedule.meta['replaces']}",
              flush=True)
    if config.training.partition_method == "time":
        partition = time_partition(config, family, schedule, device, rank == 0)
    else:
        partition = partition_layers(config.model.num_layers, schedule.num_stages,
                                     config.training.partition_method, config=config.model,
                                     family=family)
    last = schedule.num_stages - 1
    modules: dict[int, nn.Module] = {}
    for stage in schedule.stages_of_rank(pipeline_rank):
        module = model_provider(pre_process=stage == 0, post_process=stage == last,
                                layer_range=partition[stage], stage=stage)
        modules[stage] = module.to(device)
    stages = [StageSlice(s, partition[s], m,
                         writer=rank == min(parallel_state.get_stage_replica_ranks(s)))
              for s, m in sorted(modules.items())]
    replica_group = parallel_state.get_model_replica_group()
    optimizer = get_megatron_optimizer(
        config.optimizer, [modules[s] for s in sorted(modules)], grad_norm_group=replica_group,
        found_inf_group=replica_group, norm_param_filter=_norm_filter(modules))
    train_samples = config.training.total_train_iters * config.training.global_batch_size
    scheduler = OptimizerParamScheduler.from_config(optimizer, config.optimizer, train_samples)

    ckpt = config.checkpoint
    if ckpt.load is not None:
        loaded = load_checkpoint(
            ckpt.load, stages, schedule.num_stages, optimizer, scheduler, rank=rank,
            world_size=world_size, load_optim=not ckpt.no_load_optim,
            load_rng=not ckpt.no_load_rng, finetune=ckpt.finetune)
        if loaded is not None:
            state.iteration = loaded.iteration
            state.consumed_train_samples = loaded.consumed_train_samples
            state.consumed_valid_samples = loaded.consumed_valid_samples
            if rank == 0:
                print(f" loaded checkpoint {loaded.path} at iteration {loaded.iteration}",
                      flush=True)
        elif rank == 0:
            print(f" no checkpoint in {ckpt.load} (no tracker file): training from scratch",
                  flush=True)
    # Megatron's pattern: rank 0 builds the dataset index caches (atomically, once); after the
    # barrier every other rank finds them on disk and only memory-maps them.
    num_samples = _train_valid_test_num_samples(config)
    datasets = train_valid_test_datasets_provider(num_samples) if rank == 0 else None
    dist.barrier()
    if rank != 0:
        datasets = train_valid_test_datasets_provider(num_samples)

    model, training = config.model, config.training
    common = dict(
        schedule=schedule, topology=PipelineTopology.from_parallel_state(), stage_modules=modules,
        forward_step_func=forward_step_func,
        tensor_shape=(model.seq_length, training.micro_batch_size, model.hidden_size),
        dtype=model.torch_dtype,
        loss_scale_divisor=training.num_microbatches * parallel.data_parallel_size,
        device=device)

    def make_executors(schedule: Schedule) -> tuple[PipelineExecutor, PipelineExecutor]:
        kwargs = dict(common, schedule=schedule)
        train_executor = PipelineExecutor(
            **kwargs, grad_sync=GradientSynchronizer.from_parallel_state(modules),
            scale_loss=optimizer.scale_loss)
        return train_executor, PipelineExecutor(**kwargs)

    executor, eval_executor = make_executors(schedule)
    logging_rank = world_size - 1  # where the executor gathers losses and busy times
    flops = training_flops(model, family, training.global_batch_size)
    predicted = predicted_bubble_ratio(schedule) if config.logging.log_bubble_ratio else None
    monitor = TrainingMonitor.create(config, flops, world_size, predicted,
                                     enabled=rank == logging_rank)
    needed = _needed_microbatches(schedule, pipeline_rank,
                                  all_stages=family.every_stage_reads_batch)
    run = _Run(config, schedule, partition, stages, optimizer, scheduler, executor,
               eval_executor, monitor, Timers(), needed, rank, world_size, make_executors)
    profile_iterations = config.training.profile_iterations
    if profile_iterations and schedule.split_backward:
        options = parallel.schedule_options
        run.profile = ProfileRebuild(schedule, options, profile_iterations, device,
                                     getattr(options, "fallback", None))
    elif profile_iterations and rank == 0:
        print(f" --profile-iterations {profile_iterations}: {schedule.name} runs the whole "
              f"backward, nothing to rebuild", flush=True)
    return run, datasets


def time_partition(config: TrainConfig, family: ModelFamily, schedule: Schedule,
                   device: torch.device, verbose: bool) -> list[tuple[int, int]]:
    """``--partition-method time``: time one transformer layer and the extra cost of the first
    (embeddings) and last stage (final norm, LM head, loss) with the real classes on this rank's
    device, average over all ranks (one all-reduce, so every rank splits alike), and balance the
    ranks' total time over the stages each holds (both replicas for Chimera)."""
    from megatron_chimera.tuning.costs import ModelSpec
    from megatron_chimera.tuning.profile import MeasuredCompute

    compute = MeasuredCompute(ModelSpec(config.model, family), device=str(device))
    layer, first, last = compute.measure(config.training.micro_batch_size)
    recompute = config.model.recompute_granularity == "full"  # the backward re-runs the forward
    seconds = [t.forward * (2 if recompute else 1) + t.backward for t in (layer, first, last)]
    times = torch.tensor(seconds, dtype=torch.float64, device=device)
    dist.all_reduce(times)
    unit = float(times[0]) / dist.get_world_size()
    layer_s, first_s, last_s = (round(float(t) / dist.get_world_size() / unit, 3)
                                for t in times)
    rank_stages = [schedule.stages_of_rank(r) for r in range(schedule.num_ranks)]
    partition = partition_layers(config.model.num_layers, schedule.num_stages, "time",
                                 layer_times=[layer_s] * config.model.num_layers,
                                 embedding_time=first_s, head_time=last_s,
                                 rank_stages=rank_stages)
    if verbose:
        print(f" --partition-method time: layer {unit * 1e3:.3g} ms (forward + backward per "
              f"micro-batch), first stage +{first_s:.3g} layers, last stage +{last_s:.3g} "
              f"layers -> layers per stage {[end - start for start, end in partition]}",
              flush=True)
    return partition


# ------------------------------------------------------------------------------ loop pieces
def _average_losses(losses: list[dict[str, float]]) -> dict[str, float]:
    if not losses:
        return {}
    return {name: sum(d[name] for d in losses) / len(losses) for name in losses[0]}


def train_step(run: _Run, data_iterator) -> tuple[Any, bool, float | None, float]:
    """One iteration: schedule, gradient sync, optimizer and LR step.

    Returns (executor result, skipped, grad norm, pipeline seconds).
    """
    batches = next_microbatches(data_iterator, run.config.training.num_microbatches,
                                run.needed_microbatches)
    run.optimizer.zero_grad()
    run.timers("forward-backward").start()
    result = run.executor.run(batches)
    run.timers("forward-backward").stop()
    run.timers("optimizer").start()
    update_successful, grad_norm, _ = run.optimizer.step()
    run.timers("optimizer").stop()
    if update_successful:
        run.scheduler.step(run.config.training.global_batch_size)
    return result, not update_successful, grad_norm, result.iteration_seconds


def evaluate(run: _Run, data_iterator, num_iters: int) -> dict[str, float]:
    """Average of the forward-only losses over ``num_iters`` iterations (on the logging rank)."""
    losses: list[dict[str, float]] = []
    for module in (s.module for s in run.stages):
        module.eval()
    with torch.no_grad():
        for _ in range(num_iters):
            batches = next_microbatches(data_iterator, run.config.training.num_microbatches,
                                        run.needed_microbatches)
            losses += run.eval_executor.run(batches, forward_only=True).losses
    for module in (s.module for s in run.stages):
        module.train()
    return _average_losses(losses)


def _evaluate_and_log(run: _Run, prefix: str, data_iterator, state: TrainState) -> None:
    if data_iterator is None or run.config.training.eval_iters == 0:
        return
    losses = evaluate(run, data_iterator, run.config.training.eval_iters)
    if prefix.startswith("validation"):
        state.consumed_valid_samples += (run.config.training.eval_iters
                                         * run.config.training.global_batch_size)
    run.monitor.log_evaluation(prefix, state.iteration, state.consumed_train_samples, losses)


def save(run: _Run, state: TrainState) -> None:
    """Collective checkpoint of the current iteration under ``--save``."""
    ckpt = run.config.checkpoint
    if ckpt.save is None or state.last_saved_iteration == state.iteration:
        return
    run.timers("save-checkpoint").start()
    path = save_checkpoint(
        ckpt.save, state.iteration, run.stages, run.partition, run.optimizer, run.scheduler,
        rank=run.rank, world_size=run.world_size,
        consumed_train_samples=state.consumed_train_samples,
        consumed_valid_samples=state.consumed_valid_samples,
        args=dataclasses.asdict(run.config), save_optim=not ckpt.no_save_optim,
        barrier=dist.barrier)
    run.timers("save-checkpoint").stop()
    state.last_saved_iteration = state.iteration
    if run.rank == 0:
        print(f" saved checkpoint {path} at iteration {state.iteration}", flush=True)


def train(run: _Run, state: TrainState, train_iterator, valid_iterator) -> None:
    """The training loop: steps, logging, evaluation, checkpoint cadence, exit interval."""
    training, ckpt = run.config.training, run.config.checkpoint
    total = training.total_train_iters
    while state.iteration < total:
        if run.profile is not None:
            run.profile.start_iteration(run.executor)
        run.timers("iteration").start()
        result, skipped, grad_norm, pipeline_seconds = train_step(run, train_iterator)
        run.timers("iteration").stop()
        state.iteration += 1
        if run.profile is not None:
            report = run.profile.finish_iteration(run.executor)
            if report is not None:
                apply_rebuild(run, report, state.iteration)
        state.consumed_train_samples += training.global_batch_size
        timers = run.timers.elapsed_all()
        run.monitor.record(IterationStats(
            iteration=state.iteration, consumed_samples=state.consumed_train_samples,
            losses=_average_losses(result.losses), learning_rate=run.scheduler.get_lr(),
            loss_scale=run.optimizer.get_loss_scale(), grad_norm=grad_norm, skipped=skipped,
            iteration_seconds=timers.get("iteration", pipeline_seconds),
            pipeline_seconds=pipeline_seconds, busy_seconds=result.busy_seconds_per_rank,
            timers=timers))
        if training.eval_interval and state.iteration % training.eval_interval == 0:
            _evaluate_and_log(run, "validation", valid_iterator, state)
        if ckpt.save_interval and state.iteration % ckpt.save_interval == 0:
            save(run, state)
        if training.exit_interval and state.iteration % training.exit_interval == 0:
            save(run, state)
            if run.rank == 0:
                print(f" exiting program at iteration {state.iteration}", flush=True)
            return


def apply_rebuild(run: _Run, report: RebuildReport, iteration: int) -> None:
    """Run the rebuilt schedule from the next iteration on, log the switch (stdout line and
    TensorBoard on the logging rank), and keep the measured costs next to the checkpoints
    (``<save>/profiled_stage_costs.json``, for ``--chimera-zb-costs @file``)."""
    run.profile = None
    if report.changed:
        run.schedule = report.schedule
        run.executor, run.eval_executor = run.make_executors(report.schedule)
        if run.monitor.predicted_bubble is not None:
            run.monitor.predicted_bubble = predicted_bubble_ratio(report.schedule)
    costs = report.costs
    scalars = {"schedule-predicted-iteration-before": report.before.makespan,
               "schedule-predicted-iteration-after": report.decision.chosen.makespan,
               "schedule-predicted-gain": report.predicted_gain,
               "schedule-rebuilt": float(report.changed),
               "schedule-unsplit-fallback": float(report.decision.fell_back)}
    for kind, values in (("F", costs.forward), ("B", costs.backward), ("W", costs.weight)):
        scalars.update({f"profiled-{kind}-stage{s}": v for s, v in enumerate(values)})
    run.monitor.log_schedule_rebuild(iteration, report.line(), scalars)
    save_dir = run.config.checkpoint.save
    if save_dir is not None and run.rank == 0:
        import json

        from megatron_chimera.atomic import atomic_write

        os.makedirs(save_dir, exist_ok=True)
        atomic_write(os.path.join(save_dir, "profiled_stage_costs.json"),
                     lambda handle: json.dump(costs.to_dict(), handle, indent=1), mode="w")


# ------------------------------------------------------------------------------ entry
def pretrain(
    train_valid_test_datasets_provider: DatasetsProvider,
    model_provider: ModelProvider,
    forward_step_func: Callable,
    config: TrainConfig,
    family: ModelFamily = GPT2,
    schedule: Schedule | None = None,
) -> TrainState:
    """Megatron's ``pretrain``: set up, train, final validation and test evaluation, save.

    ``model_provider(pre_process, post_process, layer_range, stage)`` builds one stage;
    ``train_valid_test_datasets_provider([train, valid, test] sample counts)`` returns datasets;
    ``forward_step_func(batch, model) -> (output, loss_func)`` as the executor contract says;
    ``family`` is the model family (GPT-2 or BERT); ``schedule`` the validated schedule of the
    run (built from ``config`` when not given).
    """
    state = TrainState()
    if schedule is None:
        schedule = build_schedule_for(config)
    run, (train_ds, valid_ds, test_ds) = _setup(
        train_valid_test_datasets_provider, model_provider, forward_step_func, config,
        family, schedule, state)
    training = config.training
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    workers = config.data.num_workers

    def iterator(dataset, consumed):
        return build_data_iterator(dataset, consumed, training.micro_batch_size, dp_rank,
                                   dp_size, workers)

    # On an exception the process exits without further collectives; torchrun stops the others.
    train_iterator = iterator(train_ds, state.consumed_train_samples)
    valid_iterator = iterator(valid_ds, state.consumed_valid_samples)
    train(run, state, train_iterator, valid_iterator)
    if state.iteration >= training.total_train_iters:
        if training.eval_iters and training.total_train_iters % training.eval_interval:
            _evaluate_and_log(run, "validation end of training", valid_iterator, state)
        save(run, state)
        _evaluate_and_log(run, "test end of training", iterator(test_ds, 0), state)
    run.monitor.close()
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return state


def pretrain_from_flags(
    argv: list[str] | None,
    train_valid_test_datasets_provider: Callable[..., tuple],
    model_provider: Callable[..., nn.Module],
    forward_step_for: Callable[[Any], Callable],
    family: ModelFamily,
) -> None:
    """The ``main`` of an entry script: parse and validate the flags (every rank, before any
    process group), build the tokenizer, then :func:`pretrain` with the providers bound to them.

    The datasets provider gets ``(config, tokenizer, num_samples)``, the model provider
    ``(config.model, seed, ...)``; ``forward_step_for(tokenizer)`` gives the forward step.
    """
    config, schedule = parse_args_and_schedule(argv)
    tokenizer, config = build_tokenizer_for(config)
    pretrain(
        functools.partial(train_valid_test_datasets_provider, config, tokenizer),
        functools.partial(model_provider, config.model, config.training.seed),
        forward_step_for(tokenizer),
        config,
        family=family,
        schedule=schedule,
    )


def run_main(main: Callable[[], None]) -> None:
    """Run an entry script's ``main``: a ConfigError (or a refused fallback after profiling,
    the same on every rank) prints ``error: <message>``, exit code 2."""
    try:
        main()
    except (ConfigError, FallbackRefused) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
