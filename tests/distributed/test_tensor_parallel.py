"""Tensor (and sequence) parallelism in the runtime: GPT-2 and BERT on T x W x D gloo ranks under
NCCL's rules reproduce one process's losses, gradient norms and full weights over 3 steps (1e-5
relative, fp32), with Chimera, Chimera-ZB and 1F1B, and with Megatron's data-parallel flags all
on (distributed optimizer, overlapped bucketed reduction, background parameter gather);
sequence parallelism sends 1/T of the pipeline bytes (the 1F1B pair of the world of 4);
recomputation replays the tensor-parallel random streams; checkpoints move between T = 2 and
T = 1 unchanged."""

from __future__ import annotations

import pytest

from .harness import spawn_world
from .tp_cases import (
    SHARDED_OVERLAP,
    TPCase,
    run_checkpoint_round_trip,
    run_recompute_replays_tensor_parallel_dropout,
    run_tp_cases,
)

pytestmark = pytest.mark.distributed

FAMILIES = ("gpt2", "bert")


def world_4(family: str) -> list[TPCase]:
    """T=2 x D=2: 1F1B, Chimera-ZB, 1F1B and Chimera with sequence parallelism; Chimera with
    sequence parallelism, the distributed optimizer (sharded over the two pipes' replicas of each
    tensor rank's shard, the tied embedding over the embedding group) and overlapped bucketed
    reduction."""
    return [
        TPCase(family, "1f1b", 2, 2, 4),
        TPCase(family, "chimera-zb", 2, 2, 4),
        TPCase(family, "1f1b", 2, 2, 4, sequence_parallel=True),
        TPCase(family, "chimera", 2, 2, 4, sequence_parallel=True, untied=family == "gpt2"),
        TPCase(family, "chimera", 2, 2, 4, sequence_parallel=True, ddp=SHARDED_OVERLAP),
    ]


def world_8(family: str) -> list[TPCase]:
    """T=2 x D=4 Chimera (2 pipes), T=2 x W=2 x D=2 Chimera, T=2 x D=4 Chimera-ZB + SP."""
    return [
        TPCase(family, "chimera", 2, 4, 4, (("pipes", 2),)),
        TPCase(family, "chimera", 2, 2, 4),
        TPCase(family, "chimera-zb", 2, 4, 8, sequence_parallel=True),
    ]


def world_4_v(family: str) -> list[TPCase]:
    """T=2 x D=2 on V-shaped chunks: ZBV, and BitPipe-ZB with sequence parallelism."""
    return [TPCase(family, "zbv", 2, 2, 4),
            TPCase(family, "bitpipe-zb", 2, 2, 4, sequence_parallel=True)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_parallel_v_shaped_world_of_4(family):
    spawn_world(run_tp_cases, 4, world_4_v(family), timeout_s=280)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_parallel_world_of_4(family):
    spawn_world(run_tp_cases, 4, world_4(family), timeout_s=280)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_parallel_world_of_8(family):
    spawn_world(run_tp_cases, 8, world_8(family), timeout_s=380)


@pytest.mark.timeout(200)
def test_recomputation_replays_tensor_parallel_dropout():
    spawn_world(run_recompute_replays_tensor_parallel_dropout, 4, "gpt2", timeout_s=180)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_round_trip_across_tensor_parallel_sizes(family, tmp_path):
    """Save with T=2 D=4 Chimera, load with T=1 D=2 1F1B and save, load with T=2 D=4 again:
    identical full weights and optimizer state throughout."""
    spawn_world(run_checkpoint_round_trip, 8, family, str(tmp_path), timeout_s=280)
