"""End-to-end: bad inputs and diverging runs stop with one error line, early, naming the cause.

Every case runs ``pretrain_gpt2.py`` (one process, or two ranks started by hand so that each
rank's own output can be checked) and asserts: a non-zero exit, exactly one ``error:`` line on
the rank that found the problem (naming it), at most a quiet line naming that rank on the
others, and no traceback.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from megatron_chimera.data.indexed_dataset import IndexedDatasetBuilder

from .launcher import ROOT, TINY, RunResult, launch, launch_ranks

pytestmark = [pytest.mark.functional, pytest.mark.slow]

SMALL = [*TINY, "--num-layers", "4", "--log-interval", "1"]


def errors(result: RunResult) -> list[str]:
    return [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]


def assert_one_error(result: RunResult, *needles: str) -> str:
    lines = errors(result)
    assert result.returncode != 0, (result.stdout, result.stderr)
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def assert_ranks(results: list[RunResult], *needles: str) -> None:
    """One rank reports (one error line, no traceback), every other one names it quietly."""
    reporters = [r for r, res in enumerate(results) if errors(res)]
    assert len(reporters) == 1, [res.stderr for res in results]
    line = assert_one_error(results[reporters[0]], *needles)
    assert f"[rank {reporters[0]}]" in line or f"on rank {reporters[0]}" in line, line
    for rank, res in enumerate(results):
        assert res.returncode != 0 and "Traceback" not in res.stderr, (rank, res.stderr)
        if rank != reporters[0]:
            lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
            assert lines and lines[-1].startswith(f"rank {rank}: stopped (rank {reporters[0]} "), \
                lines


# ---------------------------------------------------------------------------- diverging runs
@pytest.mark.timeout(180)
def test_lr_1e10_stops_with_iteration_and_rank():
    results = launch_ranks("pretrain_gpt2.py", [*SMALL, "--lr", "1e10", "--train-iters", "8",
                                                "--pipeline-model-parallel-size", "2"], 2)
    assert_ranks(results, "error: iteration 2:", "--check-for-nan-in-loss-and-grad")


@pytest.mark.timeout(180)
def test_skipped_iterations_are_bounded_without_the_nan_check():
    result = launch("pretrain_gpt2.py", [*SMALL, "--lr", "1e10", "--train-iters", "8",
                                         "--no-check-for-nan-in-loss-and-grad",
                                         "--max-consecutive-skipped-iterations", "3"])
    assert_one_error(result, "iterations 2-4: 3 consecutive iterations skipped",
                     "--max-consecutive-skipped-iterations 3")


@pytest.mark.timeout(180)
def test_fp16_overflowing_at_every_step_is_bounded():
    result = launch("pretrain_gpt2.py", [*SMALL, "--fp16", "--loss-scale", "1e9",
                                         "--train-iters", "8",
                                         "--max-consecutive-skipped-iterations", "3"])
    assert_one_error(result, "iterations 1-3: 3 consecutive iterations skipped",
                     "loss scale 1e+09")


# ---------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def checkpoint_at_4(tmp_path_factory) -> Path:
    ckpt = tmp_path_factory.mktemp("ckpt4") / "ckpt"
    result = launch("pretrain_gpt2.py", [*SMALL, "--train-iters", "4", "--save", str(ckpt)])
    assert result.returncode == 0, result.stderr
    return ckpt


@pytest.mark.timeout(180)
def test_resume_past_train_iters_blames_train_iters(checkpoint_at_4):
    result = launch("pretrain_gpt2.py", [*SMALL, "--train-iters", "2", "--load",
                                         str(checkpoint_at_4)])
    assert_one_error(result, "--train-iters 2 is below the iteration 4 of the checkpoint")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("flags,needle", [
    (["--num-layers", "2"], "--num-layers: 4 in the checkpoint, 2 now"),
    (["--num-attention-heads", "8"], "--num-attention-heads: 4 in the checkpoint, 8 now"),
])
def test_checkpoint_of_another_model_is_refused(checkpoint_at_4, flags, needle):
    result = launch("pretrain_gpt2.py", [*SMALL, "--train-iters", "6", "--load",
                                         str(checkpoint_at_4), *flags])
    assert_one_error(result, "saved from a different model", needle)


@pytest.mark.timeout(180)
def test_corrupt_file_read_by_one_rank_is_reported_by_that_rank_alone(tmp_path):
    ckpt = tmp_path / "ckpt"
    two = ["--pipeline-model-parallel-size", "2"]
    result = launch("pretrain_gpt2.py", [*SMALL, *two, "--train-iters", "1", "--save",
                                         str(ckpt), "--ckpt-format", "torch"], nproc=2)
    assert result.returncode == 0, result.stderr
    (ckpt / "iter_0000001" / "layers_002-004.pt").write_bytes(b"garbage")  # stage 1 only
    results = launch_ranks("pretrain_gpt2.py", [*SMALL, *two, "--train-iters", "2", "--load",
                                                str(ckpt)], 2)
    assert_ranks(results, "layers_002-004.pt is corrupt or truncated", "[rank 1]")


def _others_can_reach(path: Path) -> bool:
    """Whether a user who is neither the owner nor in the group can read ``path``: every
    directory above it searchable by others and the file itself readable by others."""
    path = path.resolve()
    dirs_ok = all(os.stat(parent).st_mode & 0o001 for parent in path.parents)
    return dirs_ok and bool(os.stat(path).st_mode & 0o004)


@pytest.mark.timeout(180)
@pytest.mark.skipif(not hasattr(os, "geteuid"), reason="POSIX users")
def test_unwritable_save_fails_before_the_first_iteration():
    # root writes anywhere: run as `nobody` when we are root (a chmod a-w directory)
    base = Path(tempfile.mkdtemp(prefix="unwritable-save-", dir="/tmp"))
    try:
        os.chmod(base, 0o755)
        save = base / "ckpt"
        save.mkdir()
        os.chmod(save, 0o555)
        cmd = [sys.executable, str(ROOT / "pretrain_gpt2.py"), *SMALL, "--train-iters", "50",
               "--save", str(save), "--save-interval", "40"]
        if os.geteuid() == 0:
            setpriv = shutil.which("setpriv")
            if setpriv is None:
                pytest.skip("needs setpriv to drop root")
            if not _others_can_reach(ROOT / "pretrain_gpt2.py"):
                pytest.skip(f"user nobody cannot reach the checkout {ROOT} (a directory above "
                            "it lacks o+x, e.g. one made by mktemp -d)")
            cmd = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", *cmd]
        env = dict(os.environ, OMP_NUM_THREADS="1", HOME=str(base))
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=120)
        result = RunResult(proc.returncode, proc.stdout, proc.stderr)
        assert_one_error(result, f"--save {save} is not writable")
        assert "iteration" not in result.stdout, "must fail before training"
    finally:
        os.chmod(base / "ckpt", 0o755)
        shutil.rmtree(base)


# ---------------------------------------------------------------------------- data
def write_dataset(prefix: Path, docs: list[list[int]]) -> str:
    builder = IndexedDatasetBuilder(f"{prefix}.bin", np.uint16)
    for doc in docs:
        builder.add_document(np.asarray(doc), [len(doc)])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def data_run(prefix: str, *flags: str) -> RunResult:
    args = [*SMALL, "--train-iters", "2", "--data-path", prefix, "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "500", *flags]
    args.remove("--mock-data")
    return launch("pretrain_gpt2.py", args)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    rng = np.random.default_rng(0)
    return write_dataset(tmp_path_factory.mktemp("data") / "corpus",
                         [list(rng.integers(0, 500, 200)) for _ in range(20)])


@pytest.mark.timeout(180)
def test_token_ids_beyond_the_vocabulary_are_named(tmp_path):
    prefix = write_dataset(tmp_path / "big_ids", [list(range(100, 700))] * 10)
    assert_one_error(data_run(prefix, "--split", "100,0,0", "--eval-iters", "0"),
                     "big_ids.bin: token id 699 is outside the model's vocabulary of 512")


@pytest.mark.timeout(180)
def test_empty_corpus_is_named(tmp_path):
    prefix = write_dataset(tmp_path / "empty", [])
    assert_one_error(data_run(prefix), "empty.idx: the dataset is empty")


@pytest.mark.timeout(180)
def test_empty_training_split_is_named(corpus):
    assert_one_error(data_run(corpus, "--split", "0,50,50"),
                     "--split 0,50,50: the training split is empty")


@pytest.mark.timeout(180)
def test_longer_bin_from_another_corpus_is_refused(tmp_path, corpus):
    prefix = write_dataset(tmp_path / "short", [[1, 2, 3]] * 5)
    shutil.copy(f"{corpus}.bin", f"{prefix}.bin")
    assert_one_error(data_run(prefix), "short.bin: data file is", "indexes exactly 30 bytes")


@pytest.mark.timeout(180)
def test_split_without_validation_data_warns_when_evaluation_is_requested(corpus):
    result = data_run(corpus, "--split", "100,0,0", "--eval-iters", "1", "--eval-interval", "1")
    assert result.returncode == 0, result.stderr
    warnings = [ln for ln in result.stdout.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 2 and "--split 100,0,0: the validation split is empty" in \
        warnings[0], result.stdout
