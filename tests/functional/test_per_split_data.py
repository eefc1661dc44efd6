"""End-to-end: --train-data-path / --valid-data-path / --test-data-path train and evaluate on the
files named.

R1 trains on A, validates on B, tests on C; R2 is ``--data-path A --split 1,0,0`` (A alone as the
training split): the same training losses. R3 swaps the evaluation files (validation C, test B):
the same training losses, and its test loss on B equals R1's validation loss on B (the same
weights -- both evaluate after the last iteration -- and the same first batch of B: one epoch of
B covers either sample count, so both index the same shuffled epoch).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from megatron_chimera.data.indexed_dataset import IndexedDatasetBuilder

from .launcher import TINY, launch, scalars

pytestmark = [pytest.mark.functional, pytest.mark.slow]

ITERS = 4


def write_corpus(prefix: Path, low: int, high: int, seed: int) -> str:
    """40 documents of 60 tokens drawn from ``[low, high)``."""
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", np.uint16)
    for _ in range(40):
        doc = rng.integers(low, high, 60)
        builder.add_document(doc, [len(doc)])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def run(tmp_path: Path, name: str, data: list[str]) -> Path:
    args = [a for a in TINY if a != "--mock-data"]
    tensorboard = tmp_path / f"tb-{name}"
    result = launch("pretrain_gpt2.py", [
        *args, "--num-layers", "2", "--train-iters", str(ITERS), "--eval-interval", str(ITERS),
        "--eval-iters", "1", "--tokenizer-type", "NullTokenizer",
        "--data-cache-path", str(tmp_path / f"cache-{name}"), *data,
        "--tensorboard-dir", str(tensorboard)])
    assert result.returncode == 0, result.stderr[-3000:]
    return tensorboard


@pytest.mark.timeout(300)
def test_per_split_files_train_and_evaluate(tmp_path):
    a = write_corpus(tmp_path / "a", 0, 150, 1)
    b = write_corpus(tmp_path / "b", 150, 300, 2)
    c = write_corpus(tmp_path / "c", 300, 450, 3)
    r1 = run(tmp_path, "r1", ["--train-data-path", a, "--valid-data-path", b,
                              "--test-data-path", c])
    r2 = run(tmp_path, "r2", ["--data-path", a, "--split", "1,0,0"])
    r3 = run(tmp_path, "r3", ["--train-data-path", a, "--valid-data-path", c,
                              "--test-data-path", b])
    train = scalars(r1, "lm loss")
    assert sorted(train) == list(range(1, ITERS + 1))
    assert scalars(r2, "lm loss") == train and scalars(r3, "lm loss") == train
    valid_b, test_c = scalars(r1, "lm loss validation"), scalars(r1, "lm loss test")
    valid_c, test_b = scalars(r3, "lm loss validation"), scalars(r3, "lm loss test")
    assert test_b == valid_b and valid_c == test_c, (valid_b, test_b, valid_c, test_c)
    assert valid_b[ITERS] != valid_c[ITERS]  # B and C give different losses: the files matter
