"""End-to-end: GPT's document flags on a pipeline, and the logging flags.

With --reset-attention-mask every pipeline stage needs the document ids of its micro-batch, not
only the first and last: a Chimera D=4 run (every rank holds a middle stage of one pipe) must
reproduce the one-process losses (fp32, 1e-5 relative as every layout test).
"""

from __future__ import annotations

import pytest

from .launcher import scalars, train

pytestmark = [pytest.mark.functional]

DOC_FLAGS = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]
LOG_FLAGS = ["--log-throughput", "--log-timers-to-tensorboard", "--log-memory-to-tensorboard"]
ITERS = ["--train-iters", "6", "--log-interval", "3"]


@pytest.mark.timeout(300)
def test_gpt_document_flags_on_chimera_match_one_process(tmp_path):
    one = train("pretrain_gpt2.py", [*ITERS, *DOC_FLAGS], 1, tmp_path / "one")
    chimera = ["--pipeline-model-parallel-size", "4", "--chimera-pipes", "2"]
    train("pretrain_gpt2.py", [*ITERS, *DOC_FLAGS, *LOG_FLAGS, *chimera], 4, tmp_path / "four")
    plain = train("pretrain_gpt2.py", ITERS, 1, tmp_path / "plain")
    want, got = scalars(tmp_path / "one", "lm loss"), scalars(tmp_path / "four", "lm loss")
    assert sorted(got) == sorted(want) == list(range(1, 7))
    for step, value in want.items():
        assert abs(got[step] - value) <= 1e-5 * abs(value), (step, got[step], value)
    differs = scalars(tmp_path / "plain", "lm loss")
    assert any(abs(differs[s] - want[s]) > 1e-3 for s in want), "the flags must change the loss"
    # logging flags: throughput only when asked, Megatron's timer names, memory of every rank
    assert "throughput per GPU" not in one.stdout and "throughput per GPU" not in plain.stdout
    four_tags = set(_tags(tmp_path / "four"))
    assert {"throughput", "forward-backward-time", "optimizer-time", "batch-generator-time",
            "optimizer-inner-step-time"} <= four_tags
    assert {f"mem-rss-bytes/rank-{r}" for r in range(4)} <= four_tags
    assert "mem-max-rss-bytes" in four_tags
    assert not any(t.startswith("mem-") or t == "throughput" for t in _tags(tmp_path / "one"))


def _tags(directory) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return events.Tags()["scalars"]
