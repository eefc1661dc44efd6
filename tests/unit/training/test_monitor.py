"""monitor: FLOP formula, bubble ratios, Megatron's log line and TensorBoard scalar names."""

from __future__ import annotations

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_chimera.config import ModelConfig
from megatron_chimera.model.family import BERT, GPT2
from megatron_chimera.model.flops import training_flops
from megatron_chimera.schedules import build_schedule
from megatron_chimera.training.arguments import parse_args
from megatron_chimera.training.monitor import (
    IterationStats,
    Timers,
    TrainingMonitor,
    measured_bubble_ratio,
    predicted_bubble_ratio,
)


def test_gpt_flops_match_megatron_formula():
    # GPT-2 1.3B-like: 72 B s L h^2 (1 + s/(6h) + V/(12 L h)) computed term by term
    model = ModelConfig(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=1024,
                        vocab_size=50257)
    b, s, layers, h, v = 8, 1024, 24, 2048, 50304  # vocab padded to a multiple of 128
    per_layer = 24 * s * h * h + 4 * s * s * h  # forward matmul FLOPs of one layer, one sequence
    logits = 2 * s * h * v
    expected = 3 * b * (layers * per_layer + logits)  # forward + backward (2x)
    assert training_flops(model, GPT2, b) == pytest.approx(expected, rel=1e-12)
    megatron = 72 * b * s * layers * h * h * (1 + s / (6 * h) + v / (12 * layers * h))
    assert training_flops(model, GPT2, b) == pytest.approx(megatron, rel=1e-12)
    # BERT adds its LM-head transform (Megatron's + 1/(12 L)); recomputation a fourth pass
    bert = megatron * (1 + 1 / (12 * layers) / (1 + s / (6 * h) + v / (12 * layers * h)))
    assert training_flops(model, BERT, b) == pytest.approx(bert, rel=1e-12)
    recompute = ModelConfig(num_layers=24, hidden_size=2048, num_attention_heads=16,
                            seq_length=1024, vocab_size=50257, recompute_granularity="full",
                            recompute_method="uniform", recompute_num_layers=1)
    assert training_flops(recompute, GPT2, b) == pytest.approx(megatron * 96 / 72, rel=1e-12)


def test_bubble_ratios():
    assert measured_bubble_ratio([1.0, 1.0, 0.5, 0.5], 1.0) == pytest.approx(0.25)
    # 1F1B with F = B = 1: (D-1)/(N+D-1)
    one_f_one_b = build_schedule("1f1b", 4, 8)
    ratio = predicted_bubble_ratio(one_f_one_b, 1.0, 1.0)
    assert ratio == pytest.approx(3 / 11)
    chimera = build_schedule("chimera", 4, 4, pipes=2)
    assert predicted_bubble_ratio(chimera, 1.0, 1.0) == pytest.approx(2 / (8 + 2))


def test_timers_accumulate():
    timers = Timers()
    timers("x").start()
    timers("x").stop()
    timers("x").start()
    timers("x").stop()
    assert timers.elapsed_all()["x"] >= 0.0
    with pytest.raises(RuntimeError):
        timers("x").stop()


def test_log_line_and_tensorboard(tmp_path, capsys):
    config = parse_args(
        ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
         "--micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --train-iters 4 --mock-data "
         "--vocab-size 500 --log-interval 2 --log-throughput "
         f"--tensorboard-dir {tmp_path}").split(),
        world_size=1)
    monitor = TrainingMonitor.create(config, flops_per_iteration=1e12, world_size=1,
                                     predicted_bubble=0.25, enabled=True)
    losses = [5.0, 4.0, 3.0, 2.0]
    for it, loss in enumerate(losses, start=1):
        monitor.record(IterationStats(
            iteration=it, consumed_samples=8 * it, losses={"lm loss": loss}, learning_rate=1e-3,
            loss_scale=1.0, grad_norm=0.5, skipped=(it == 3), iteration_seconds=0.5,
            busy_seconds=[0.4, 0.3]))
    monitor.close()
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "iteration" in ln]
    assert len(lines) == 2
    for field in ("consumed samples:", "elapsed time per iteration (ms): 500.0",
                  "throughput per GPU (TFLOP/s/GPU): 2.000", "learning rate: 1.000000E-03",
                  "global batch size:     8", "loss scale: 1.0", "grad norm: 0.500",
                  "number of nan iterations:   0", "bubble ratio measured: 0.300",
                  "bubble ratio predicted: 0.250", "tokens per second: 512.0"):
        assert field in lines[0], field
    assert "lm loss: 4.500000E+00" in lines[0]
    # iteration 3 was skipped: the second window averages iteration 4 only
    assert "lm loss: 2.000000E+00" in lines[1]
    assert "number of skipped iterations:   1" in lines[1]
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for name in ("lm loss", "learning-rate", "loss-scale", "grad-norm", "throughput",
                 "iteration-time", "bubble-ratio", "bubble-ratio-predicted"):
        assert name in tags and f"{name} vs samples" in tags, name
    assert [e.value for e in events.Scalars("lm loss")] == losses
    assert [e.step for e in events.Scalars("lm loss vs samples")] == [8, 16, 24, 32]


def _monitor(tmp_path, extra: str = "") -> TrainingMonitor:
    config = parse_args(
        ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
         "--micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --train-iters 4 --mock-data "
         f"--vocab-size 500 --log-interval 1 --tensorboard-dir {tmp_path} {extra}").split(),
        world_size=1)
    return TrainingMonitor.create(config, flops_per_iteration=1e12, world_size=1,
                                  predicted_bubble=None, enabled=True)


def _stats(iteration: int, **extra) -> IterationStats:
    return IterationStats(iteration=iteration, consumed_samples=8 * iteration,
                          losses={"lm loss": 1.0}, learning_rate=1e-3, loss_scale=1.0,
                          grad_norm=0.5, skipped=False, iteration_seconds=0.5, **extra)


def _tags(directory) -> set[str]:
    events = EventAccumulator(str(directory))
    events.Reload()
    return set(events.Tags()["scalars"])


def test_tokens_per_second_counts_the_packed_tokens(tmp_path, capsys):
    """Packed samples (--sft, --variable-seq-lengths): tokens per second counts the tokens the
    packer put in the iteration, not global batch x --seq-length (8 x 32 = 256 here)."""
    monitor = _monitor(tmp_path)
    monitor.record(_stats(1, tokens=100))
    monitor.record(_stats(2))  # an unpacked iteration: 256 tokens
    monitor.close()
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "iteration" in ln]
    assert "tokens per second: 200.0 |" in lines[0]  # 100 tokens in 0.5 s
    assert "tokens per second: 512.0 |" in lines[1]
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [e.value for e in events.Scalars("tokens-per-second")] == [200.0, 512.0]


def test_throughput_only_with_log_throughput(tmp_path, capsys):
    """Megatron prints (and writes) TFLOP/s per GPU only with --log-throughput."""
    monitor = _monitor(tmp_path / "off")
    monitor.record(_stats(1))
    monitor.close()
    assert "throughput" not in capsys.readouterr().out
    assert "throughput" not in _tags(tmp_path / "off")
    monitor = _monitor(tmp_path / "on", "--log-throughput")
    monitor.record(_stats(1))
    monitor.close()
    assert "throughput per GPU (TFLOP/s/GPU): 2.000 |" in capsys.readouterr().out
    assert "throughput" in _tags(tmp_path / "on")


def test_timers_and_memory_to_tensorboard(tmp_path):
    """Megatron's timer names as "<name>-time"; per-rank memory plus the maximum over ranks."""
    timers = {"forward-backward": 0.3, "batch-generator": 0.01, "optimizer": 0.1,
              "optimizer-inner-step": 0.05, "interval-time": 0.5, "not-a-megatron-timer": 1.0}
    memory = [{"mem-allocated-bytes": 10.0, "mem-reserved-bytes": 20.0},
              {"mem-allocated-bytes": 30.0, "mem-reserved-bytes": 25.0}]
    monitor = _monitor(tmp_path / "none")
    monitor.record(_stats(1, timers=timers, memory=memory))
    monitor.close()
    assert not any(t.endswith("-time") and t != "iteration-time"
                   for t in _tags(tmp_path / "none"))
    assert not any(t.startswith("mem-") for t in _tags(tmp_path / "none"))
    monitor = _monitor(tmp_path / "all",
                       "--log-timers-to-tensorboard --log-memory-to-tensorboard")
    monitor.record(_stats(1, timers=timers, memory=memory))
    monitor.close()
    events = EventAccumulator(str(tmp_path / "all"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {t for t in tags if t.endswith("-time")} == {
        "forward-backward-time", "batch-generator-time", "optimizer-time",
        "optimizer-inner-step-time", "iteration-time"}
    assert events.Scalars("forward-backward-time")[0].value == pytest.approx(0.3)
    assert events.Scalars("mem-allocated-bytes")[0].value == 30.0  # max over ranks
    assert events.Scalars("mem-allocated-bytes/rank-0")[0].value == 10.0
    assert events.Scalars("mem-reserved-bytes/rank-1")[0].value == 25.0


def test_memory_stats_on_cpu():
    from megatron_chimera.training.monitor import gather_memory_stats, memory_stats

    stats = memory_stats()
    assert set(stats) == {"mem-rss-bytes", "mem-max-rss-bytes"}
    assert 10e6 < stats["mem-rss-bytes"] <= stats["mem-max-rss-bytes"] * 1.01
    assert gather_memory_stats(0)[0].keys() == stats.keys()  # one process: no collective


class _FakeEvent:
    """A CUDA event stand-in: ``record`` stamps a fake clock, ``synchronize`` counts waits."""

    clock = 0.0
    waits = 0

    def record(self) -> None:
        self.at = _FakeEvent.clock

    def synchronize(self) -> None:
        _FakeEvent.waits += 1

    def elapsed_time(self, end: _FakeEvent) -> float:
        return (end.at - self.at) * 1000.0  # milliseconds, as CUDA's


def test_level_0_timers_record_events_and_resolve_them_only_when_read(monkeypatch):
    """--timing-log-level 0: start/stop neither synchronise the device nor wait for events;
    an iteration's readings are resolved later (the logging iteration) to the events' time."""
    from megatron_chimera.training import monitor

    syncs = []
    monkeypatch.setattr(monitor, "_synchronize", lambda: syncs.append(1))
    _FakeEvent.clock, _FakeEvent.waits = 0.0, 0
    timers = Timers(timing_log_level=0, event_factory=_FakeEvent)
    for seconds in (0.5, 0.25):
        timers("forward-backward").start()
        _FakeEvent.clock += seconds
        timers("forward-backward").stop()
    readings = timers.take_all()
    assert syncs == [] and _FakeEvent.waits == 0
    assert readings["forward-backward"].seconds() == pytest.approx(0.75)
    assert _FakeEvent.waits == 2
    assert timers.take_all()["forward-backward"].seconds() == 0.0  # taken means reset


def test_level_1_timers_synchronise_at_start_and_stop(monkeypatch):
    from megatron_chimera.training import monitor

    syncs = []
    monkeypatch.setattr(monitor, "_synchronize", lambda: syncs.append(1))
    timers = Timers(timing_log_level=1, event_factory=_FakeEvent)
    timers("optimizer").start()
    timers("optimizer").stop()
    assert len(syncs) == 2
    assert timers.elapsed_all()["optimizer"] >= 0.0


def test_iteration_stats_take_the_interval_timer_when_resolved():
    timers = Timers()
    timers("interval-time").start()
    timers("interval-time").stop()
    stats = IterationStats(iteration=1, consumed_samples=8, losses={}, learning_rate=0.1,
                           loss_scale=1.0, grad_norm=None, skipped=False, iteration_seconds=-1.0,
                           timer_readings=timers.take_all())
    stats.resolve_timers()
    assert stats.iteration_seconds >= 0.0 and "interval-time" in stats.timers
    assert stats.timer_readings is None
