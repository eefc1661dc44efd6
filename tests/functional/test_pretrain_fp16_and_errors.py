"""End-to-end: fp16 overflow handling across ranks, and bad settings failing fast everywhere."""

from __future__ import annotations

import importlib.util
import time

import pytest
import torch.distributed as dist

from megatron_chimera.training.rank_errors import report_failure

from .launcher import ROOT, TINY, launch, launch_ranks, scalars, train

pytestmark = [pytest.mark.functional, pytest.mark.slow]


@pytest.mark.timeout(240)
def test_fp16_overflow_skips_and_backs_off(tmp_path):
    initial, hysteresis = 2.0**20, 2
    result = train("pretrain_gpt2.py", [
        "--train-iters", "8", "--fp16", "--initial-loss-scale", str(initial),
        "--hysteresis", str(hysteresis), "--log-interval", "1",
        "--pipeline-model-parallel-size", "2", "--chimera-pipes", "2"], 2, tmp_path)
    skipped_total = scalars(tmp_path, "skipped-iterations")
    scale = scalars(tmp_path, "loss-scale")
    lr = scalars(tmp_path, "learning-rate")
    skipped = [it for it in sorted(skipped_total)
               if skipped_total[it] > skipped_total.get(it - 1, 0)]
    # A scale of 2^20 overflows fp16 gradients of this model: the first steps are skipped ...
    assert skipped and skipped[0] == 1 and len(skipped) < 8, skipped
    # ... the scale backs off by 2 on every overflow once `hysteresis` overflows happened ...
    expected, overflows = initial, 0
    for it in sorted(scale):
        if it in skipped:
            overflows += 1
            if overflows >= hysteresis:
                expected /= 2
        assert scale[it] == expected, (it, scale[it], expected)
    # ... the LR schedule does not advance on skipped steps, and training resumes afterwards.
    for it in skipped:
        assert lr[it] == pytest.approx(lr.get(it - 1, 1e-3), rel=1e-6)  # float32 events
    assert lr[8] < 1e-3
    assert "number of skipped iterations:   1" in result.stdout
    losses = scalars(tmp_path, "lm loss")
    assert all(v == v and v < 10 for v in losses.values())


# (extra flags, world size, text the single error line must contain)
BAD_SETTINGS = [
    (["--pipeline-model-parallel-size", "3", "--pipeline-schedule", "chimera"], 3,
     "--pipeline-model-parallel-size"),
    (["--pipeline-model-parallel-size", "4", "--chimera-pipes", "3"], 4, "--chimera-pipes"),
    (["--micro-batch-size", "2", "--global-batch-size", "15"], 1, "--global-batch-size"),
    (["--pipeline-model-parallel-size", "4", "--chimera-pipes", "2",
      "--global-batch-size", "6"], 4, "--num-microbatches"),
    (["--pipeline-model-parallel-size", "4"], 6, "--pipeline-model-parallel-size"),
    (["--tensor-model-parallel-size", "2"], 3, "--tensor-model-parallel-size"),
    (["--tensor-model-parallel-size", "8"], 8, "--num-attention-heads"),
    (["--sequence-parallel"], 2, "--sequence-parallel"),
    (["--fp16", "--bf16"], 1, "--fp16"),
    (["--seq-length", "64"], 1, "--max-position-embeddings"),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"], 1, "--lr-warmup-fraction"),
    (["--train-samples", "100"], 1, "--train-samples"),
    (["--load", "/nonexistent/checkpoints"], 1, "--load"),
    (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "/nonexistent/vocab.json",
      "--merge-file", "/nonexistent/merges.txt"], 1, "--vocab-file"),
    (["--hidden-size", "66"], 1, "--num-attention-heads"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b",
      "--chimera-pipes", "2"], 2, "--chimera-pipes"),
]


def _pretrain_gpt2_main():
    """``pretrain_gpt2.main``, loaded from the entry script."""
    spec = importlib.util.spec_from_file_location("pretrain_gpt2_entry", ROOT / "pretrain_gpt2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags,world_size,needle", BAD_SETTINGS)
def test_bad_settings_fail_with_one_line_naming_the_flag(flags, world_size, needle, monkeypatch,
                                                         capsys):
    # Validation runs before any process group, so each rank can be checked in this process
    # as one that believes it is the last rank of the world (it would fail to connect if it got
    # that far); the entry script's own error path (run_main -> report_failure) prints the line.
    # It is local rank 0 of its node (the rank that prints; the runs of the entry script below
    # show the other local ranks exiting quietly with the same code).
    rank = world_size - 1
    for key, value in {"WORLD_SIZE": world_size, "RANK": rank, "LOCAL_RANK": 0,
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 1}.items():
        monkeypatch.setenv(key, str(value))
    main = _pretrain_gpt2_main()
    capsys.readouterr()
    with pytest.raises(Exception) as failure:  # noqa: PT011 - the error path takes any
        main([*TINY, "--train-iters", "2", *flags])
    assert not dist.is_initialized(), "a process group was created before the check"
    code = report_failure(failure.value)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 2, (flags, code, lines)
    assert len(lines) == 1 and lines[0].startswith("error: "), (flags, lines)
    assert needle in lines[0], (flags, lines[0])


@pytest.mark.timeout(180)
def test_bad_setting_exits_on_every_rank_without_hanging():
    """Before any process group: local rank 0 prints the one line, the others exit quietly with
    the same code."""
    start = time.monotonic()
    results = launch_ranks("pretrain_gpt2.py", [*TINY, "--train-iters", "2", "--load",
                                                "/nonexistent/checkpoints"], 4, timeout=120)
    for rank, result in enumerate(results):
        lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
        assert result.returncode == 2, (rank, result.stderr)
        if rank == 0:
            assert len(lines) == 1 and "--load" in lines[0], (rank, result.stderr)
        else:
            assert not lines, (rank, result.stderr)
    assert time.monotonic() - start < 120


@pytest.mark.timeout(240)
def test_a_misspelt_flag_under_torchrun_is_one_line_with_a_suggestion():
    # 2 workers: the quiet local rank 1 must not exit before local rank 0 has printed (else
    # torchrun's SIGTERM ends rank 0 with "terminated" instead of the error)
    result = launch("pretrain_gpt2.py", [*TINY, "--train-iters", "2", "--num-query-group", "2"],
                    nproc=2, timeout=220)
    output = result.stdout + result.stderr
    lines = [ln for ln in output.splitlines() if ln.startswith("error:")]
    assert result.returncode != 0 and len(lines) == 1, output[-3000:]
    assert "--num-query-group: did you mean --num-query-groups?" in lines[0], lines[0]
    # torchrun's own summary (and its ChildFailedError traceback) follow; no worker traceback
    assert 'pretrain_gpt2.py", line' not in output, output[-3000:]
