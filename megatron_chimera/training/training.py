"""``pretrain()``: Megatron's training driver for any pipeline schedule.

Initialise torch.distributed and the process groups of the schedule's placement, partition the
layers into stages, build this rank's stage modules with ``model_provider``, the optimizer over
all of them, the data iterators and the executors; then loop: run the schedule, step the
optimizer, step the LR schedule, log, evaluate, checkpoint, exit. Nothing here knows which
schedule is in use.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from megatron_chimera import parallel_state
from megatron_chimera.checkpoint.checkpointing import (
    FORMAT_TORCH_DIST,
    CheckpointContents,
    checkpoint_dir,
    prepare_sharded_save,
    save_checkpoint,
    set_rng_state,
    stage_named_parameters,
)
from megatron_chimera.checkpoint.saved_args import checkpoint_family_error
from megatron_chimera.config import ConfigError, TrainConfig
from megatron_chimera.data.samplers import (
    batch_tokens,
    build_data_iterator,
    microbatch_first_samples,
    next_microbatches,
)
from megatron_chimera.model.dropout_rng import KeyedMicrobatch, microbatch_key, slice_key
from megatron_chimera.model.family import GPT2, ModelFamily
from megatron_chimera.model.loss_normalization import add_token_mean
from megatron_chimera.model.moe.aux_loss import aux_loss_figures, reduce_aux_losses
from megatron_chimera.model.sequence_slices import split_into_slices
from megatron_chimera.pipeline.profiling import (
    PROFILED_KEY,
    profiling_for,
    rebuild_scalars,
    resumed_rebuild,
    save_profiled_costs,
)
from megatron_chimera.schedules.actions import Schedule
from megatron_chimera.schedules.measured import RebuildReport
from megatron_chimera.training.arguments import build_schedule_for, parse_args_and_schedule
from megatron_chimera.training.exit_conditions import ExitCheck, SignalFlag, agreed_start_time
from megatron_chimera.training.flag_catalog import family_flag_errors
from megatron_chimera.training.health import (
    check_loss_and_grad,
    check_skipped,
    grad_norm_covers_gradients,
    raise_nonfinite_grad_norm,
)
from megatron_chimera.training.initialize import initialize_megatron
from megatron_chimera.training.monitor import (
    IterationStats,
    gather_memory_stats,
    predicted_bubble_ratio,
)
from megatron_chimera.training.preflight import check_outputs, check_splits
from megatron_chimera.training.restart import (
    injected_kill,
    kill_if_injected,
    may_restart,
    record_progress,
    save_interval_advice,
)
from megatron_chimera.training.setup import (
    DatasetsProvider,
    ModelProvider,
    Run,
    TrainState,
    build_datasets,
    setup_run,
)
from megatron_chimera.training.varlen import microbatch_tokens, sequence_split


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


# ------------------------------------------------------------------------------ loop pieces
def _average_losses(losses: list[dict[str, float]]) -> dict[str, float]:
    if not losses:
        return {}
    return {name: sum(d[name] for d in losses) / len(losses) for name in losses[0]}


def keyed_microbatches(run: Run, batches: list[Any], consumed_samples: int) -> list[Any]:
    """Each micro-batch with its keyed-dropout key (from the global index of its first sample)."""
    training = run.config.training
    firsts = microbatch_first_samples(
        consumed_samples, len(batches), training.micro_batch_size,
        parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size())
    return [KeyedMicrobatch(microbatch_key(training.seed, first), batch)
            for first, batch in zip(firsts, batches)]


def sliced_units(batches: list[Any], slices: int) -> list[Any]:
    """The pipeline units of one iteration's micro-batches: each read micro-batch (a sequence)
    cut into ``slices`` consecutive slices (``--pipeline-sequence-slices``; unit ``q k + j`` is
    slice ``j`` of sequence ``q``), each slice keyed for its own dropout masks."""
    if slices == 1:
        return batches
    units: list[Any] = []
    for batch in batches:
        keyed = isinstance(batch, KeyedMicrobatch)
        data = batch.batch if keyed else batch
        parts = [None] * slices if data is None else split_into_slices(data, slices)
        units += ([KeyedMicrobatch(slice_key(batch.key, j), part)
                   for j, part in enumerate(parts)] if keyed else parts)
    return units


_NO_METER = contextlib.nullcontext()


def _watched(run: Run, section: str):
    """The hang watch armed for ``section`` (a no-op without one)."""
    watch = run.instruments.hang_watch
    return watch.watching(section) if watch is not None else _NO_METER


def train_step(run: Run, data_iterator, consumed_samples: int | None = None,
               iteration: int | None = None) -> tuple[Any, bool, float | None, float]:
    """One iteration: schedule, gradient sync, optimizer and LR step; ``consumed_samples`` (the
    samples before this iteration) keys the dropout masks (see ``model/dropout_rng.py``);
    ``iteration`` (its number) turns on the NaN/Inf check before the step (``health.py``).

    Returns (executor result, skipped, grad norm, pipeline seconds).
    """
    pipeline = run.pipeline
    batches, tokens = _iteration_units(run, data_iterator, consumed_samples)
    run.optimizer.zero_grad()
    trace = run.instruments.trace if iteration is not None else None
    if trace is not None:
        trace.begin(pipeline.executor, iteration)
    run.timers("forward-backward").start()
    memory = run.instruments.memory
    meter = memory.meter(run.stages, iteration) if memory and iteration else _NO_METER
    with meter:
        result = pipeline.executor.run(batches, microbatch_tokens=tokens)
    run.timers("forward-backward").stop()
    nan_check = iteration is not None and run.config.training.check_for_nan_in_loss_and_grad
    folded = nan_check and grad_norm_covers_gradients(run.config.optimizer)
    if nan_check and not folded:
        _check_nan(run, iteration, result)
    run.timers("optimizer").start()
    # the optimizer's own timers add device syncs: only when they are written
    detail = run.timers if run.config.logging.log_timers_to_tensorboard else None
    with trace.region("optimizer step", "optimizer") if trace else contextlib.nullcontext():
        update_successful, grad_norm, _ = run.optimizer.step(timers=detail)
    run.timers("optimizer").stop()
    if folded and grad_norm is not None and not math.isfinite(grad_norm):
        _check_nan(run, iteration, result)  # names the rank and the value, then raises
        raise_nonfinite_grad_norm(iteration, grad_norm)
    if update_successful:
        run.scheduler.step(pipeline.batch_size())
    if trace is not None:
        trace.end()
    if memory is not None and iteration is not None:
        memory.report(run, iteration)
    return result, not update_successful, grad_norm, result.iteration_seconds


def _iteration_units(run: Run, data_iterator, consumed_samples: int | None
                     ) -> tuple[list, list[int] | None]:
    """The iteration's pipeline units (keyed micro-batches, sequence slices, the global-token
    mean) and, with --variable-seq-lengths, each micro-batch's token count."""
    run.timers("batch-generator").start()
    schedule = run.pipeline.schedule
    batches = next_microbatches(data_iterator, schedule.num_sequences,
                                run.pipeline.needed_microbatches)
    run.timers("batch-generator").stop()
    tokens = (microbatch_tokens(batches, sequence_split(run.config))
              if run.config.data.variable_seq_lengths else None)
    if consumed_samples is not None:
        batches = keyed_microbatches(run, batches, consumed_samples)
    units = sliced_units(batches, schedule.sequence_slices)
    if run.config.training.calculate_per_token_loss:  # one all-reduce, before any compute
        add_token_mean(units, batches, parallel_state.get_data_parallel_group(), run.device)
    return units, tokens


def _check_nan(run: Run, iteration: int, result: Any) -> None:
    """Every rank: the NaN/Inf check of its losses and (fp32/bf16) gradients (a collective)."""
    check_loss_and_grad(
        iteration, result.local_losses,
        [(name, p) for stage in run.stages for name, p in stage_named_parameters(stage)
         .items()], check_grads=not run.config.optimizer.fp16,
        device=run.device or torch.device("cpu"))


#: evaluations of at least this many iterations show a progress bar on rank 0
EVAL_PROGRESS_MIN_ITERS = 20


def evaluate(run: Run, data_iterator, num_iters: int) -> dict[str, float]:
    """Average of the forward-only losses over ``num_iters`` iterations (on the logging rank)."""
    losses: list[dict[str, float]] = []
    for module in (s.module for s in run.stages):
        module.eval()
    results = []
    steps = tqdm(range(num_iters), desc=" evaluating", unit="iter", mininterval=5.0,
                 disable=run.rank != 0 or num_iters < EVAL_PROGRESS_MIN_ITERS, leave=False)
    with torch.no_grad():
        for _ in steps:
            batches = next_microbatches(data_iterator, run.config.training.num_microbatches,
                                        run.pipeline.eval_needed_microbatches)
            batches = sliced_units(batches, run.config.parallel.pipeline_sequence_slices)
            tokens = (microbatch_tokens(batches, sequence_split(run.config))
                      if run.config.data.variable_seq_lengths else None)
            results.append(run.pipeline.eval_executor.run(batches, forward_only=True,
                                                          microbatch_tokens=tokens))
    for module in (s.module for s in run.stages):
        module.train()
    for gathered in run.pipeline.eval_executor.gather(results) or []:
        losses += gathered.losses
    return _average_losses(losses)


def evaluation_announcement(prefix: str, iteration: int, training: Any) -> str:
    """The line printed before an evaluation starts: what it runs, on which split, and how to
    make it shorter (a long silent evaluation looks like a hang)."""
    split = "test" if prefix.startswith("test") else "validation"
    return (f" evaluating ({prefix}, iteration {iteration}): {training.eval_iters} iterations of "
            f"{training.global_batch_size} samples on the {split} split (--eval-iters sets how "
            "many)")


def _evaluate_and_log(run: Run, prefix: str, data_iterator, state: TrainState) -> None:
    if data_iterator is None or run.config.training.eval_iters == 0:
        return
    if run.rank == 0:
        print(evaluation_announcement(prefix, state.iteration, run.config.training), flush=True)
    losses = evaluate(run, data_iterator, run.config.training.eval_iters)
    if prefix.startswith("validation"):
        state.consumed_valid_samples += (run.config.training.eval_iters
                                         * run.config.training.global_batch_size)
    run.monitor.log_evaluation(prefix, state.iteration, state.consumed_train_samples, losses)


def save(run: Run, state: TrainState) -> None:
    """Collective checkpoint of the current iteration under ``--save``."""
    ckpt = run.config.checkpoint
    if ckpt.save is None or state.last_saved_iteration == state.iteration:
        return
    run.timers("save-checkpoint").start()
    contents = CheckpointContents(
        state.iteration, run.stages, run.partition, run.optimizer, run.scheduler,
        consumed_train_samples=state.consumed_train_samples,
        consumed_valid_samples=state.consumed_valid_samples,
        args={**dataclasses.asdict(run.config), "model_family": run.family.name,
              **({PROFILED_KEY: run.pipeline.profiled} if run.pipeline.profiled else {})},
        save_optim=not ckpt.no_save_optim)
    if ckpt.ckpt_format == FORMAT_TORCH_DIST:  # --async-save: staged now, written later
        job = prepare_sharded_save(ckpt.save, contents, rank=run.rank,
                                   world_size=run.world_size, copy=run.checkpointer is not None)
        if run.checkpointer is not None:
            run.checkpointer.start(job, _report_saved if run.rank == 0 else None)
        else:
            job.run(dist.barrier)
    else:
        save_checkpoint(ckpt.save, contents, rank=run.rank, world_size=run.world_size,
                        barrier=dist.barrier, ckpt_format=ckpt.ckpt_format)
    run.timers("save-checkpoint").stop()
    state.last_saved_iteration = state.iteration
    if run.rank == 0 and run.checkpointer is not None:
        print(f" started saving checkpoint {job.final} at iteration {state.iteration}",
              flush=True)
    elif run.rank == 0:
        _report_saved(job if ckpt.ckpt_format == FORMAT_TORCH_DIST else None,
                      checkpoint_dir(ckpt.save, state.iteration), state.iteration)


def _report_saved(job: Any, path: str | None = None, iteration: int | None = None) -> None:
    """Rank 0's line for a published checkpoint (a ``torch_dist`` one: with every rank's peak
    host memory from the capture to the publish)."""
    peaks = getattr(job, "peak_bytes_per_rank", None)
    memory = ("" if peaks is None else "; peak host memory added per rank (MB): "
              f"{[None if p is None else round(p / 2**20, 1) for p in peaks]}")
    if iteration is None:  # an async save, reported by its writer
        print(f" finished saving checkpoint {job.final} in the background{memory}", flush=True)
    else:
        print(f" saved checkpoint {path} at iteration {iteration}{memory}", flush=True)


def _report(run: Run, pending: list[tuple[IterationStats, Any]]) -> None:
    """Gather the losses and busy times of the pending iterations (one collective, every rank)
    and hand each iteration to the monitor in order (log line, TensorBoard)."""
    if not pending:
        return
    with _watched(run, "gathering the losses to the logging rank (collective)"):
        gathered = run.pipeline.executor.gather([result for _, result in pending])
    for stats, _ in pending:  # the iteration's timer events are complete by now
        stats.resolve_timers()
    aux = _moe_aux_losses(run)  # the interval's mean of every MoE auxiliary loss (collective)
    for (stats, _), figures in zip(pending, gathered or []):
        stats.losses = {**_average_losses(figures.losses), **aux}
        stats.busy_seconds = figures.busy_seconds_per_rank
        stats.busy_by_kind = figures.busy_by_kind_per_rank
        run.monitor.record(stats)
    pending.clear()


def _moe_aux_losses(run: Run) -> dict[str, float]:
    """The MoE auxiliary losses since the last report, averaged over their micro-batches and
    layers (a collective over the world; nothing without MoE layers)."""
    model = run.config.model
    if not model.moe.enabled:
        return {}
    per_layer = reduce_aux_losses([s.module for s in run.stages], model.num_layers,
                                  device=run.device)
    return aux_loss_figures(per_layer, model.moe.moe_per_layer_logging)


def train(run: Run, state: TrainState, train_iterator, valid_iterator,
          exits: ExitCheck | None = None, dataset: Any = None) -> str | None:
    """The training loop: steps, logging, evaluation, checkpoint cadence, early exits
    (``exits``: exit interval, SIGTERM, wall clock); returns why it stopped early, if it did.
    ``dataset`` (the training split) counts the tokens per second of packed samples.

    Losses and busy times stay on the device until the next log iteration (or the end), when
    one collective brings every pending iteration's figures to the logging rank.
    """
    exits = exits or ExitCheck(run.config.training, time.time())
    training, ckpt = run.config.training, run.config.checkpoint
    pending: list[tuple[IterationStats, Any]] = []
    progress = run.rank == 0 and may_restart()  # a restarted attempt says what was lost
    fault = injected_kill()  # a drill's kill -9 of one rank
    walls: list[float] = []  # host wall time of the iterations until the first save
    while state.iteration < training.total_train_iters:
        started = time.perf_counter()
        _iteration(run, state, train_iterator, pending, dataset)
        if walls is not None:
            walls.append(time.perf_counter() - started)
        if progress:
            record_progress(ckpt.save, state.iteration)
        check_skipped(state.consecutive_skipped, training.max_consecutive_skipped_iterations,
                      state.iteration, run.optimizer.get_loss_scale())
        if training.eval_interval and state.iteration % training.eval_interval == 0:
            _evaluate_and_log(run, "validation", valid_iterator, state)
        if ckpt.save_interval and state.iteration % ckpt.save_interval == 0:
            started = time.perf_counter()
            save(run, state)
            if walls is not None and run.rank == 0:
                _advise_save_interval(time.perf_counter() - started, walls, ckpt.save_interval)
            walls = None
        kill_if_injected(fault, run.rank, state.iteration)
        reason = exits.reason(state.iteration)
        if reason is not None:
            _report(run, pending)
            save(run, state)
            if run.rank == 0:
                print(f" {reason}", flush=True)
            return reason
    return None


def _advise_save_interval(save_seconds: float, walls: list[float], interval: int) -> None:
    """Rank 0's line after the first save: the save's cost against the iterations (their median
    wall time, the first one -- warm-up -- left out when there are others)."""
    steady = walls[1:] or walls
    print(save_interval_advice(save_seconds, statistics.median(steady), interval), flush=True)


def _iteration(run: Run, state: TrainState, train_iterator,
               pending: list[tuple[IterationStats, Any]], dataset: Any = None) -> None:
    """One training iteration of the loop: the running schedule for this iteration's batch
    size, the step, the rebuild at the end of a profiling window, the iteration's figures
    (reported at a log iteration)."""
    training, log = run.config.training, run.config.logging
    pipeline = run.pipeline
    pipeline.start_iteration()
    pipeline.use_microbatches(training.num_microbatches_at(state.consumed_train_samples))
    batch_size = pipeline.batch_size()
    run.timers("interval-time").start()
    with _watched(run, f"iteration {state.iteration + 1} outside the pipeline (collectives: "
                       f"gradient norm, NaN check, optimizer)"):
        result, skipped, grad_norm, pipeline_seconds = train_step(
            run, train_iterator, state.consumed_train_samples, state.iteration + 1)
    run.timers("interval-time").stop()
    state.iteration += 1
    state.consecutive_skipped = state.consecutive_skipped + 1 if skipped else 0
    report = pipeline.finish_iteration()
    if report is not None:
        apply_rebuild(run, report, state.iteration)
    tokens = (batch_tokens(dataset, state.consumed_train_samples, batch_size)
              if run.monitor.enabled else None)  # the packed ones, on the host
    state.consumed_train_samples += batch_size
    readings = run.timers.take_all()  # resolved at the logging iteration (no sync now)
    memory = None  # a collective: every rank, on the iterations TensorBoard is written
    if (log.log_memory_to_tensorboard and log.tensorboard_dir
            and state.iteration % log.tensorboard_log_interval == 0):
        memory = gather_memory_stats(run.world_size - 1)
    pending.append((IterationStats(
        iteration=state.iteration, consumed_samples=state.consumed_train_samples,
        batch_size=batch_size, tokens=tokens, losses={}, learning_rate=run.scheduler.get_lr(),
        loss_scale=run.optimizer.get_loss_scale(), grad_norm=grad_norm, skipped=skipped,
        iteration_seconds=pipeline_seconds, pipeline_seconds=pipeline_seconds,
        timer_readings=readings, memory=memory), result))
    if state.iteration % log.log_interval == 0 or state.iteration == training.total_train_iters:
        _report(run, pending)


def apply_rebuild(run: Run, report: RebuildReport, iteration: int) -> None:
    """Run the rebuilt schedule from the next iteration on, log the switch (stdout line and
    TensorBoard on the logging rank), and keep the measured costs next to the checkpoints
    (``<save>/profiled_stage_costs.json``, for ``--chimera-zb-costs @file``)."""
    run.pipeline.adopt(report)  # the record is saved with the checkpoints
    if report.changed and run.monitor.predicted_bubble is not None:
        run.monitor.predicted_bubble = predicted_bubble_ratio(report.schedule)
    run.monitor.log_schedule_rebuild(iteration, report.line(), rebuild_scalars(report))
    if run.config.checkpoint.save is not None and run.rank == 0:
        save_profiled_costs(run.config.checkpoint.save, report.costs)


# ------------------------------------------------------------------------------ entry
def pretrain(
    train_valid_test_datasets_provider: DatasetsProvider,
    model_provider: ModelProvider,
    forward_step_func: Callable,
    config: TrainConfig,
    family: ModelFamily = GPT2,
    schedule: Schedule | None = None,
    start_time: float | None = None,
) -> TrainState:
    """Megatron's ``pretrain``: set up, train, final validation and test evaluation, save.

    ``model_provider(pre_process, post_process, layer_range, stage)`` builds one stage;
    ``train_valid_test_datasets_provider([train, valid, test] sample counts)`` returns datasets;
    ``forward_step_func(batch, model) -> (output, loss_func)`` as the executor contract says;
    ``family`` is the model family (GPT-2 or BERT); ``schedule`` the validated schedule of the
    run (built from ``config`` when not given); ``start_time`` the job's start (``time.time()``,
    default now) for ``--exit-duration-in-mins``. With ``--exit-signal-handler`` a SIGTERM from
    here on is only recorded: the loop saves and returns at the next iteration boundary.
    """
    start_time = time.time() if start_time is None else start_time
    watch = (SignalFlag() if config.training.exit_signal_handler
             else contextlib.nullcontext())
    with watch as signals:
        return _pretrain(train_valid_test_datasets_provider, model_provider, forward_step_func,
                         config, family, schedule or build_schedule_for(config),
                         (start_time, signals))


def _exit_check(config: TrainConfig, device: torch.device, start_time: float,
                signals: SignalFlag | None) -> ExitCheck:
    training = config.training
    if training.exit_duration_in_mins is not None:  # a collective: every rank
        start_time = agreed_start_time(start_time, device)
    return ExitCheck(training, start_time, signals, device)


def _pretrain(train_valid_test_datasets_provider: DatasetsProvider,
              model_provider: ModelProvider, forward_step_func: Callable, config: TrainConfig,
              family: ModelFamily, schedule: Schedule,
              clock: tuple[float, SignalFlag | None]) -> TrainState:
    state = TrainState()
    check_outputs(config, family)  # every rank, before any process group: fail in seconds
    device = initialize_megatron(config.parallel, schedule, config.training.seed,
                                 experts=config.model.moe.enabled)
    exits = _exit_check(config, device, *clock)
    run, saved_args = setup_run(config, family, schedule, model_provider, forward_step_func,
                                state, device)
    train_ds, valid_ds, test_ds = build_datasets(train_valid_test_datasets_provider, config)
    _start_profiling(run, schedule, saved_args, state)
    training = config.training
    iterator = _iterator_builder(run)
    # On an exception the process exits without further collectives; torchrun stops the others.
    remaining = training.total_train_iters - state.iteration
    check_splits(config, train_ds, valid_ds, test_ds, remaining,
                 warn=(lambda line: print(line, flush=True)) if run.rank == 0 else None)
    train_iterator = iterator(train_ds, state.consumed_train_samples) if remaining > 0 else None
    valid_iterator = iterator(valid_ds, state.consumed_valid_samples)
    if run.rng_state is not None:  # nothing drawn since the restore reaches the first iteration
        set_rng_state(run.rng_state)
    train(run, state, train_iterator, valid_iterator, exits, dataset=train_ds)
    if state.iteration >= training.total_train_iters:
        if training.eval_iters and training.total_train_iters % training.eval_interval:
            _evaluate_and_log(run, "validation end of training", valid_iterator, state)
        save(run, state)
        _evaluate_and_log(run, "test end of training", iterator(test_ds, 0), state)
    _teardown(run)
    return state


def _start_profiling(run: Run, schedule: Schedule, saved_args: dict[str, Any],
                     state: TrainState) -> None:
    """Open the ``--profile-iterations`` window; a resume after it repeats the rebuild its
    checkpoint recorded instead."""
    config, verbose = run.config, run.rank == 0
    run.pipeline.start_profiling(profiling_for(config, schedule, run.device, verbose=verbose))
    report = resumed_rebuild(run.pipeline.profile, schedule, saved_args,
                             config.checkpoint.finetune, verbose=verbose)
    if report is not None:
        apply_rebuild(run, report, state.iteration)


def _iterator_builder(run: Run) -> Callable[[Any, int], Any]:
    """``iterator(dataset, consumed samples)``: this rank's data iterator over a dataset (it
    reads nothing when this rank holds neither end of any micro-batch's pipe)."""
    training = run.config.training
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    workers = run.config.data.num_workers
    needed = run.pipeline.needed_microbatches
    reads = needed is None or bool(needed)

    def iterator(dataset, consumed):
        return build_data_iterator(dataset, consumed, training.micro_batch_size, dp_rank,
                                   dp_size, workers, read=reads)
    return iterator


def _teardown(run: Run) -> None:
    """The end of a run: no collective in flight, the last checkpoint published, the watch and
    monitor closed, the process groups destroyed."""
    run.optimizer.finish_param_sync()  # no collective may be in flight at teardown
    if run.checkpointer is not None:
        run.checkpointer.wait()  # the last checkpoint is published before the exit
    if run.instruments.hang_watch is not None:
        run.instruments.hang_watch.stop()
    run.monitor.close()
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


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
    start_time = time.time()
    config, schedule = parse_args_and_schedule(argv)
    wrong_checkpoint = checkpoint_family_error(config.checkpoint.load, family)
    if wrong_checkpoint is not None:  # before its flags (--use-checkpoint-args) are blamed
        raise ConfigError(wrong_checkpoint)
    for message in family_flag_errors(config, family):
        raise ConfigError(message)
    tokenizer, config = build_tokenizer_for(config)
    pretrain(
        functools.partial(train_valid_test_datasets_provider, config, tokenizer),
        functools.partial(model_provider, config.model, config.training.seed),
        forward_step_for(tokenizer),
        config,
        family=family,
        schedule=schedule,
        start_time=start_time,
    )
