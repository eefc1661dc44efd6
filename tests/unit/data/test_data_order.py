"""Elastic resume keeps the data order: global batch i holds the same samples on every layout
(data-parallel size, micro-batch size, pipes), and a resume with another global batch size is
refused naming both values (or allowed and logged on request)."""

from __future__ import annotations

import hashlib

import pytest

from megatron_chimera.config import ConfigError
from megatron_chimera.data.samplers import MegatronPretrainingSampler
from megatron_chimera.training.arguments import parse_args
from megatron_chimera.training.data_order import check_data_order

TOTAL, GLOBAL = 4096, 32


def batch_hashes(first: int, last: int, consumed: int, micro: int, replicas: int) -> list[str]:
    """The hash of the sorted sample ids of global batches ``first..last`` as the samplers of
    ``replicas`` data-parallel ranks read them, resuming at ``consumed`` samples."""
    per_replica = GLOBAL // (micro * replicas)  # the micro-batches of one replica
    streams = [iter(MegatronPretrainingSampler(TOTAL, consumed, micro, r, replicas))
               for r in range(replicas)]
    hashes = []
    for _ in range(first, last + 1):
        ids = sorted(i for s in streams for _ in range(per_replica) for i in next(s))
        assert len(ids) == GLOBAL == len(set(ids))
        hashes.append(hashlib.sha1(repr(ids).encode()).hexdigest())
    return hashes


@pytest.mark.parametrize("before,after", [
    ((1, 4), (1, 2)),  # W = 4 -> 2
    ((1, 2), (1, 4)),  # W = 2 -> 4
    ((2, 2), (1, 4)),  # another micro-batch size and W (T = 2 -> 1, Chimera -> 1F1B: same W)
])
def test_global_batches_after_a_resume_hold_the_uninterrupted_runs_samples(before, after):
    uninterrupted = batch_hashes(1, 20, 0, *before)
    resumed_at = 7  # the checkpoint: iterations 1..7 done
    resumed = batch_hashes(resumed_at + 1, 20, resumed_at * GLOBAL, *after)
    assert resumed == uninterrupted[resumed_at:]
    assert len(set(uninterrupted)) == 20  # the check can fail: every batch differs


FLAGS = ("--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 16 "
         "--micro-batch-size 1 --train-iters 10 --lr 1e-3 --mock-data --vocab-size 64 ")


def test_another_global_batch_size_is_refused_naming_both_values():
    config = parse_args((FLAGS + "--global-batch-size 16").split(), world_size=1)
    saved = {"training": {"global_batch_size": 32, "rampup_batch_size": None}}
    assert check_data_order(config, {"training": {"global_batch_size": 16}}, "ck") is None
    with pytest.raises(ConfigError, match=r"--global-batch-size 16 differs from the "
                                          r"checkpoint's 32 \(ck\).*--allow-data-order-change"):
        check_data_order(config, saved, "ck")
    allowed = parse_args((FLAGS + "--global-batch-size 16 --allow-data-order-change").split(),
                         world_size=1)
    note = check_data_order(allowed, saved, "ck")
    assert "0 samples skipped or repeated" in note and "instead of 32" in note
