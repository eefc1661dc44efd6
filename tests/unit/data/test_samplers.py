"""Pretraining sampler: data-parallel slicing, exact resume from consumed_samples, data iterator."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from megatron_chimera.config import ConfigError
from megatron_chimera.data.gpt_dataset import MockGPTDataset
from megatron_chimera.data.samplers import (
    MegatronPretrainingSampler,
    build_data_iterator,
    collate_samples,
    next_microbatches,
)

pytestmark = pytest.mark.timeout(60)


def test_data_parallel_slices():
    batches = {r: list(MegatronPretrainingSampler(20, 0, 2, r, 2)) for r in range(2)}
    assert batches[0][:3] == [[0, 1], [4, 5], [8, 9]]
    assert batches[1][:3] == [[2, 3], [6, 7], [10, 11]]
    assert len(batches[0]) == len(MegatronPretrainingSampler(20, 0, 2, 0, 2)) == 5
    # every step, the replicas together read a contiguous block, each sample once
    for step in zip(batches[0], batches[1]):
        assert sorted(step[0] + step[1]) == list(range(step[0][0], step[0][0] + 4))


@pytest.mark.parametrize("consumed", [0, 4, 8, 12])
def test_resume_is_exact(consumed):
    mbs, dp, total = 2, 2, 30
    for rank in range(dp):
        full = list(MegatronPretrainingSampler(total, 0, mbs, rank, dp))
        resumed = list(MegatronPretrainingSampler(total, consumed, mbs, rank, dp))
        assert resumed == full[consumed // (mbs * dp):]


def test_drop_last_false_and_errors():
    tail = list(MegatronPretrainingSampler(10, 0, 3, 0, 1, drop_last=False))
    assert tail[-1] == [9]
    with pytest.raises(ConfigError, match="consumed_samples"):
        MegatronPretrainingSampler(10, 10, 2, 0, 1)
    with pytest.raises(ConfigError, match="data_parallel_rank"):
        MegatronPretrainingSampler(10, 0, 2, 2, 2)


def test_iterator_and_microbatches():
    ds = MockGPTDataset("train", 64, 8, vocab_size=30, eod=29, seed=0)
    it0 = build_data_iterator(ds, consumed_samples=8, micro_batch_size=2, data_parallel_rank=1,
                              data_parallel_size=2, num_workers=0)
    it1 = build_data_iterator(ds, consumed_samples=8, micro_batch_size=2, data_parallel_rank=1,
                              data_parallel_size=2, num_workers=1)
    got = next_microbatches(it0, 4, needed=[0, 3])
    assert got[1] is None and got[2] is None
    assert got[0]["text"].shape == (2, 9) and got[0]["text"].dtype == torch.int64
    expected_first = np.stack([ds[10]["text"], ds[11]["text"]])  # 8 + rank 1 * mbs 2
    np.testing.assert_array_equal(got[0]["text"].numpy(), expected_first)
    np.testing.assert_array_equal(got[3]["text"].numpy(),
                                  np.stack([ds[22]["text"], ds[23]["text"]]))
    for a, b in itertools.islice(zip(build_data_iterator(ds, 8, 2, 1, 2, 0), it1), 6):
        assert torch.equal(a["text"], b["text"])
    assert build_data_iterator(None, 0, 2, 0, 1) is None
    assert next_microbatches(None, 3) == [None, None, None]


def test_collate_ints_and_arrays():
    out = collate_samples([{"a": np.arange(3), "n": 1}, {"a": np.arange(3) + 1, "n": 0}])
    assert out["a"].tolist() == [[0, 1, 2], [1, 2, 3]] and out["n"].tolist() == [1, 0]
