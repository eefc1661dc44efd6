"""Timers, throughput, bubble ratio, Megatron's stdout log line and TensorBoard scalars.

Besides Megatron's figures (loss, learning rate, loss scale, grad norm; TFLOP/s per GPU with
``--log-throughput``) every logged iteration reports the *measured* bubble ratio
``1 - sum(busy) / (ranks x iteration time)`` from each rank's compute-busy time, next to the
simulator's prediction for the same schedule. ``--log-timers-to-tensorboard`` writes Megatron's
timer names (:data:`TENSORBOARD_TIMERS`, as ``<name>-time``); ``--log-memory-to-tensorboard``
writes every rank's memory (:func:`gather_memory_stats`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_chimera.config import TrainConfig
from megatron_chimera.training.scalar_writers import create_writer
from megatron_chimera.training.straggler import StragglerDetector

# Megatron's timer names written with --log-timers-to-tensorboard (as "<name>-time"), in its
# order; "interval-time" (the whole iteration) is the "iteration-time" scalar.
TENSORBOARD_TIMERS = (
    "forward-backward", "batch-generator", "optimizer-copy-to-main-grad",
    "optimizer-unscale-and-check-inf", "optimizer-clip-main-grad", "optimizer-count-zeros",
    "optimizer-inner-step", "optimizer-copy-main-to-model-params", "optimizer",
    "save-checkpoint",
)


# ---------------------------------------------------------------------------------- timers
class _Timer:
    """Accumulating timer of one name.

    ``sync`` (``--timing-log-level`` >= 1, Megatron's accurate timers): the device is synchronised
    at start and stop and the host clock read, so each figure includes the device work queued in
    the interval. Otherwise, on CUDA, start and stop only record CUDA events on the current
    stream -- no device-wide sync inside the step, so communication and computation keep
    overlapping -- and the seconds are read from the events when :meth:`elapsed` is called (at the
    logging iteration, whose report waits for the device anyway). On the CPU both are the host
    clock. ``event_factory`` makes the events (a test passes stand-ins).
    """

    def __init__(self, sync: bool = True, event_factory: Callable[[], Any] | None = None) -> None:
        self._elapsed = 0.0
        self._start: float | None = None
        self._sync = sync
        self._event_factory = event_factory
        self._events: list[tuple[Any, Any]] = []
        self._start_event: Any = None

    def _use_events(self) -> bool:
        return not self._sync and (self._event_factory is not None or _cuda_active())

    def _event(self) -> Any:
        if self._event_factory is not None:
            return self._event_factory()
        return torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        """Start (must be stopped)."""
        if self._start is not None or self._start_event is not None:
            raise RuntimeError("timer already started")
        if self._use_events():
            self._start_event = self._event()
            self._start_event.record()
            return
        if self._sync:
            _synchronize()
        self._start = time.perf_counter()

    def stop(self) -> None:
        """Stop and accumulate."""
        if self._start_event is not None:
            end = self._event()
            end.record()
            self._events.append((self._start_event, end))
            self._start_event = None
            return
        if self._start is None:
            raise RuntimeError("timer is not started")
        if self._sync:
            _synchronize()
        self._elapsed += time.perf_counter() - self._start
        self._start = None

    def elapsed(self, reset: bool = True) -> float:
        """Accumulated seconds (of stopped intervals); reset to zero by default. Event-timed
        intervals are resolved here (waiting for their end events only)."""
        self._elapsed += _event_seconds(self._events)
        self._events = []
        value = self._elapsed
        if reset:
            self._elapsed = 0.0
        return value

    def take(self) -> TimerReading:
        """The accumulated interval, unresolved (no wait for events), and reset."""
        reading = TimerReading(self._elapsed, self._events)
        self._elapsed, self._events = 0.0, []
        return reading


def _event_seconds(events: list[tuple[Any, Any]]) -> float:
    total = 0.0
    for start, end in events:
        end.synchronize()
        total += start.elapsed_time(end) / 1000.0
    return total


@dataclass
class TimerReading:
    """One timer's figure for one iteration: host seconds plus event pairs still to be read."""

    host_seconds: float
    events: list[tuple[Any, Any]]

    def seconds(self) -> float:
        """The figure in seconds (waits for the events' completion)."""
        return self.host_seconds + _event_seconds(self.events)


def _cuda_active() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _synchronize() -> None:
    if _cuda_active():
        torch.cuda.synchronize()


class Timers:
    """Named timers as Megatron's ``timers('forward-backward').start()``.

    ``timing_log_level`` (Megatron's ``--timing-log-level``, default 0): at 1 or more every timer
    synchronises the device at start and stop (accurate per-part figures, at the cost of the
    overlap); at 0 none does (CUDA events on GPUs, read at the logging iteration).
    """

    def __init__(self, timing_log_level: int = 0,
                 event_factory: Callable[[], Any] | None = None) -> None:
        self.timing_log_level = timing_log_level
        self._event_factory = event_factory
        self._timers: dict[str, _Timer] = {}

    def __call__(self, name: str) -> _Timer:
        """The timer called ``name`` (created on first use)."""
        timer = self._timers.get(name)
        if timer is None:
            timer = self._timers[name] = _Timer(self.timing_log_level >= 1, self._event_factory)
        return timer

    def elapsed_all(self, reset: bool = True) -> dict[str, float]:
        """Seconds of every timer."""
        return {name: t.elapsed(reset) for name, t in self._timers.items()}

    def take_all(self) -> dict[str, TimerReading]:
        """Every timer's reading, unresolved, and reset: the training loop keeps an
        iteration's readings until its logging iteration resolves them (no wait before)."""
        return {name: t.take() for name, t in self._timers.items()}


# ---------------------------------------------------------------------------------- formulas
def measured_bubble_ratio(busy_seconds: Sequence[float], iteration_seconds: float) -> float:
    """``1 - sum(busy) / (ranks x iteration time)``: the idle share of the iteration."""
    if iteration_seconds <= 0 or not busy_seconds:
        return 0.0
    return 1.0 - sum(busy_seconds) / (len(busy_seconds) * iteration_seconds)


def predicted_bubble_ratio(
    schedule, forward_cost: float | Sequence[float] = 1.0,
    backward_cost: float | Sequence[float] = 2.0,
) -> float:
    """The simulator's bubble ratio of ``schedule`` (no communication; F=1, B=2 by default;
    a split backward spends half of B on the input gradient and half on W)."""
    from megatron_chimera.schedules.simulate import CostModel, simulate

    weight_cost = 0.0
    if schedule.split_backward:
        weight_cost = ([b / 2 for b in backward_cost] if isinstance(backward_cost, Sequence)
                       else backward_cost / 2)
    costs = CostModel(forward_cost=forward_cost, backward_cost=backward_cost,
                      weight_cost=weight_cost)
    return simulate(schedule, costs).bubble_ratio


def memory_stats() -> dict[str, float]:
    """This process's memory in bytes: the CUDA allocator's figures (Megatron's names), or on
    the CPU the current and peak resident set size."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return {"mem-reserved-bytes": float(torch.cuda.memory_reserved()),
                "mem-allocated-bytes": float(torch.cuda.memory_allocated()),
                "mem-max-allocated-bytes": float(torch.cuda.max_memory_allocated())}
    import resource

    peak = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux
    return {"mem-rss-bytes": _current_rss(peak), "mem-max-rss-bytes": peak}


def _current_rss(fallback: float) -> float:
    """Resident set size now (Linux ``/proc/self/statm``; ``fallback`` elsewhere)."""
    import os

    try:
        with open("/proc/self/statm") as f:
            return float(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return fallback


def gather_memory_stats(dst: int) -> list[dict[str, float]] | None:
    """Every rank's :func:`memory_stats` on global rank ``dst`` (a collective: every rank must
    call it; the others get None)."""
    import torch.distributed as dist

    mine = memory_stats()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    gathered: list | None = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(mine, gathered, dst=dst)
    return gathered


def _bubble(stats: IterationStats) -> float:
    return measured_bubble_ratio(stats.busy_seconds,
                                 stats.pipeline_seconds or stats.iteration_seconds)


# ---------------------------------------------------------------------------------- monitor
@dataclass
class IterationStats:
    """The reduced figures of one training iteration (known on the logging rank)."""

    iteration: int
    consumed_samples: int
    losses: dict[str, float]
    learning_rate: float
    loss_scale: float
    grad_norm: float | None
    skipped: bool
    iteration_seconds: float
    pipeline_seconds: float | None = None  # schedule execution only (the bubble's denominator)
    busy_seconds: list[float] = field(default_factory=list)
    busy_by_kind: list[dict[str, float]] = field(default_factory=list)  # per rank, per F/B/W
    timers: dict[str, float] = field(default_factory=dict)
    memory: list[dict[str, float]] | None = None  # per rank (--log-memory-to-tensorboard)
    batch_size: int | None = None  # this iteration's global batch (None: --global-batch-size)
    tokens: int | None = None  # its input tokens, counted by the packer (None: batch x seq)
    timer_readings: dict[str, TimerReading] | None = None  # until :meth:`resolve_timers`

    def resolve_timers(self) -> None:
        """Turn the iteration's timer readings into seconds (``timers``); the iteration time
        is the ``interval-time`` timer's when there is one."""
        if self.timer_readings is None:
            return
        self.timers = {name: r.seconds() for name, r in self.timer_readings.items()}
        self.timer_readings = None
        self.iteration_seconds = self.timers.get("interval-time", self.iteration_seconds)


class TrainingMonitor:
    """Writes Megatron's stdout line every ``--log-interval`` and TensorBoard scalars.

    Only the logging rank creates one with ``enabled=True``; elsewhere every method is a no-op.
    """

    def __init__(self, config: TrainConfig, flops_per_iteration: float, world_size: int,
                 predicted_bubble: float | None, enabled: bool, writer=None) -> None:
        self.config = config
        self.flops_per_iteration = flops_per_iteration
        self.world_size = world_size
        self.predicted_bubble = predicted_bubble
        self.enabled = enabled
        self.writer = writer
        self.straggler: StragglerDetector | None = None  # --log-straggler (set by the setup)
        self.skipped_total = 0
        self.nan_total = 0
        self._window: list[IterationStats] = []
        self._skipped_in_window = 0
        self._nan_in_window = 0

    @classmethod
    def create(cls, config: TrainConfig, flops_per_iteration: float, world_size: int,
               predicted_bubble: float | None, enabled: bool) -> TrainingMonitor:
        """Build the monitor and, on the logging rank, its writer (TensorBoard with
        ``--tensorboard-dir``, Weights & Biases with ``--wandb-project``)."""
        writer = create_writer(config) if enabled else None
        return cls(config, flops_per_iteration, world_size, predicted_bubble, enabled, writer)

    # ---------------------------------------------------------------- training iterations
    def _scalar(self, name: str, value: float, iteration: int, samples: int) -> None:
        self.writer.add_scalar(name, value, iteration)
        self.writer.add_scalar(f"{name} vs samples", value, samples)

    def record(self, stats: IterationStats) -> str | None:
        """Account one iteration; returns (and prints) the log line on log iterations."""
        if not self.enabled:
            return None
        nan = any(math.isnan(v) or math.isinf(v) for v in stats.losses.values())
        if stats.skipped:
            self.skipped_total += 1
            self._skipped_in_window += 1
        if nan:
            self.nan_total += 1
            self._nan_in_window += 1
        if not stats.skipped and not nan:
            self._window.append(stats)
        tb_interval = self.config.logging.tensorboard_log_interval
        if self.writer is not None and stats.iteration % tb_interval == 0:
            self._write_tensorboard(stats)
        if stats.iteration % self.config.logging.log_interval:
            return None
        line = self._log_line(stats)
        print(line, flush=True)
        self._check_stragglers(stats.iteration)
        self._window, self._skipped_in_window, self._nan_in_window = [], 0, 0
        return line

    def _check_stragglers(self, iteration: int) -> None:
        """With ``--log-straggler``: the interval's relative compute per rank (TensorBoard) and
        a line naming a rank that became a straggler."""
        if self.straggler is None:
            return
        warning = self.straggler.observe([s.busy_seconds for s in self._window],
                                         [s.busy_by_kind for s in self._window])
        if warning is not None:
            print(warning, flush=True)
        if self.writer is not None:
            for rank, value in enumerate(self.straggler.last):
                self.writer.add_scalar(f"straggler/relative compute rank {rank}", value,
                                       iteration)

    def _batch(self, stats: IterationStats) -> int:
        return stats.batch_size or self.config.training.global_batch_size

    def _tokens(self, stats: IterationStats) -> int:
        """Input tokens of an iteration: the packed micro-batches' own (``--sft``,
        ``--variable-seq-lengths``: padding left out), else batch x ``--seq-length``."""
        if stats.tokens is not None:
            return stats.tokens
        return self._batch(stats) * self.config.model.seq_length

    def _rates(self, seconds: float, batch: int, tokens: float) -> tuple[float, float, float]:
        """TFLOP/s per GPU, samples/s and tokens/s for one iteration of ``seconds`` on
        ``batch`` samples of ``tokens`` input tokens in all."""
        if seconds <= 0:
            return 0.0, 0.0, 0.0
        flops = self.flops_per_iteration * batch / self.config.training.global_batch_size
        tflops = flops / (seconds * self.world_size * 1e12)
        return tflops, batch / seconds, tokens / seconds

    def _write_tensorboard(self, stats: IterationStats) -> None:
        it, samples = stats.iteration, stats.consumed_samples
        w = self.writer
        tflops, samples_per_s, tokens_per_s = self._rates(
            stats.iteration_seconds, self._batch(stats), self._tokens(stats))
        self._scalar("learning-rate", stats.learning_rate, it, samples)
        self._scalar("batch-size", self._batch(stats), it, samples)
        for name, value in stats.losses.items():
            self._scalar(name, value, it, samples)
        self._scalar("loss-scale", stats.loss_scale, it, samples)
        if stats.grad_norm is not None:
            self._scalar("grad-norm", stats.grad_norm, it, samples)
        self._scalar("skipped-iterations", self.skipped_total, it, samples)
        self._scalar("iteration-time", stats.iteration_seconds, it, samples)
        if self.config.logging.log_throughput:  # Megatron writes it with --log-throughput
            self._scalar("throughput", tflops, it, samples)
        self._scalar("samples-per-second", samples_per_s, it, samples)
        self._scalar("tokens-per-second", tokens_per_s, it, samples)
        if stats.busy_seconds:
            self._scalar("bubble-ratio", _bubble(stats), it, samples)
        if self.predicted_bubble is not None:
            self._scalar("bubble-ratio-predicted", self.predicted_bubble, it, samples)
        if self.config.logging.log_timers_to_tensorboard:
            for name in TENSORBOARD_TIMERS:
                if name in stats.timers:
                    w.add_scalar(f"{name}-time", stats.timers[name], it)
        if self.config.logging.log_memory_to_tensorboard:
            self._write_memory(stats.memory or [memory_stats()], it)

    def _write_memory(self, per_rank: list[dict[str, float]], iteration: int) -> None:
        """Megatron's memory scalars (the maximum over ranks) and ``<name>/rank-<r>`` each."""
        for name in per_rank[0]:
            values = [stats.get(name, 0.0) for stats in per_rank]
            self.writer.add_scalar(name, max(values), iteration)
            for rank, value in enumerate(values):
                self.writer.add_scalar(f"{name}/rank-{rank}", value, iteration)

    def _log_line(self, stats: IterationStats) -> str:
        window = self._window
        seconds = (sum(s.iteration_seconds for s in window) / len(window) if window
                   else stats.iteration_seconds)
        tokens = (sum(map(self._tokens, window)) / len(window) if window
                  else self._tokens(stats))
        tflops, samples_per_s, tokens_per_s = self._rates(seconds, self._batch(stats), tokens)
        train_iters = self.config.training.total_train_iters
        parts = [
            f" iteration {stats.iteration:8d}/{train_iters:8d}",
            f" consumed samples: {stats.consumed_samples:12d}",
            f" elapsed time per iteration (ms): {seconds * 1000:.1f}",
        ]
        if self.config.logging.log_throughput:  # Megatron prints it only with --log-throughput
            parts.append(f" throughput per GPU (TFLOP/s/GPU): {tflops:.3f}")
        parts += [
            f" learning rate: {stats.learning_rate:.6E}",
            f" global batch size: {self._batch(stats):5d}",
        ]
        for name in stats.losses:
            values = [s.losses[name] for s in window]
            if values:
                parts.append(f" {name}: {sum(values) / len(values):.6E}")
        parts.append(f" loss scale: {stats.loss_scale:.1f}")
        norms = [s.grad_norm for s in window if s.grad_norm is not None]
        if norms:
            parts.append(f" grad norm: {sum(norms) / len(norms):.3f}")
        parts += [
            f" number of skipped iterations: {self._skipped_in_window:3d}",
            f" number of nan iterations: {self._nan_in_window:3d}",
            f" samples per second: {samples_per_s:.1f}",
            f" tokens per second: {tokens_per_s:.1f}",
        ]
        bubbles = [_bubble(s) for s in window if s.busy_seconds]
        if bubbles:
            parts.append(f" bubble ratio measured: {sum(bubbles) / len(bubbles):.3f}")
        if self.predicted_bubble is not None:
            parts.append(f" bubble ratio predicted: {self.predicted_bubble:.3f}")
        return "".join(f"{part} |" for part in parts)

    # ---------------------------------------------------------------- schedule rebuild
    def log_memory_report(self, iteration: int, lines: list[str],
                          scalars: dict[str, float]) -> None:
        """Print the memory report (one line per rank) and write its scalars at ``iteration``."""
        if not self.enabled:
            return
        print(f" memory report after iteration {iteration} (predicted || measured):", flush=True)
        for line in lines:
            print(line, flush=True)
        if self.writer is not None:
            for name, value in scalars.items():
                self.writer.add_scalar(name, value, iteration)

    def log_schedule_rebuild(self, iteration: int, line: str, scalars: dict[str, float]) -> None:
        """Print the rebuild's one line and write its scalars (and the line as text) to
        TensorBoard at ``iteration``."""
        if not self.enabled:
            return
        print(f" schedule rebuild after iteration {iteration}:{line}", flush=True)
        if self.writer is not None:
            for name, value in scalars.items():
                self.writer.add_scalar(name, value, iteration)
            self.writer.add_text("schedule-rebuild", line, iteration)

    # ---------------------------------------------------------------- evaluation
    def log_evaluation(self, prefix: str, iteration: int, consumed_samples: int,
                       losses: dict[str, float]) -> str | None:
        """Megatron's ``validation loss at iteration N | lm loss value: | lm loss PPL: |``."""
        if not self.enabled:
            return None
        parts = [f" {prefix} loss at iteration {iteration}"]
        suffix = "validation" if prefix.startswith("validation") else "test"
        for name, value in losses.items():
            ppl = math.exp(min(20.0, value))
            parts.append(f" {name} value: {value:.6E}")
            parts.append(f" {name} PPL: {ppl:.6E}")
            if self.writer is not None:
                self._scalar(f"{name} {suffix}", value, iteration, consumed_samples)
                self._scalar(f"{name} {suffix} ppl", ppl, iteration, consumed_samples)
        line = "".join(f"{part} |" for part in parts)
        rule = "-" * len(line)
        print(f"{rule}\n{line}\n{rule}", flush=True)
        return line

    def close(self) -> None:
        """Flush and close the writers (TensorBoard, W&B)."""
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
            self.writer = None
