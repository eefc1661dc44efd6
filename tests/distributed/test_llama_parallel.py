"""A Llama-shaped GPT (RMSNorm, SwiGLU, grouped-query attention over T, bias-free, RoPE with
Llama 3.1's scaling and per-document positions, untied head) on gloo ranks under NCCL's rules
reproduces one process's losses, gradient norms and full weights over 3 steps (1e-5 relative,
fp32): T=2 x Chimera D=2 with sequence parallelism, T=2 Chimera-ZB (the split backward defers
the fused gate+up and the grouped QKV weight gradients), T=1 Chimera-ZB D=4, full recomputation
under sequence parallelism, selective recomputation with Qwen2's QKV bias."""

from __future__ import annotations

import pytest

from .harness import spawn_world
from .tp_cases import (
    LLAMA_MODEL,
    TPCase,
    run_checkpoint_round_trip,
    run_recompute_replays_tensor_parallel_dropout,
    run_tp_cases,
)

pytestmark = pytest.mark.distributed


def world_4() -> list[TPCase]:
    """The three layouts of the Llama-shaped model on four ranks."""
    return [
        TPCase("gpt2", "chimera", 2, 2, 4, sequence_parallel=True, model=LLAMA_MODEL,
               reset_positions=True),
        TPCase("gpt2", "chimera-zb", 2, 2, 4, model=LLAMA_MODEL, reset_positions=True),
        TPCase("gpt2", "chimera-zb", 1, 4, 8, model=LLAMA_MODEL),
        TPCase("gpt2", "1f1b", 2, 2, 4, sequence_parallel=True,
               model=(*LLAMA_MODEL, ("recompute_granularity", "full"),
                      ("recompute_method", "uniform"), ("recompute_num_layers", 1))),
        TPCase("gpt2", "chimera", 2, 2, 4,
               model=(*LLAMA_MODEL, ("recompute_granularity", "selective"),
                      ("add_qkv_bias", True))),
    ]


@pytest.mark.timeout(300)
def test_llama_shaped_model_in_every_layout():
    spawn_world(run_tp_cases, 4, world_4(), timeout_s=280)


@pytest.mark.timeout(300)
def test_llama_checkpoint_round_trip_across_tensor_parallel_sizes(tmp_path):
    """T=2 D=4 Chimera saves (strided gate+up shards joined into the full tensor), T=1 loads and
    saves the same full tensors, T=2 gets its shards back."""
    spawn_world(run_checkpoint_round_trip, 8, "gpt2", str(tmp_path), LLAMA_MODEL,
                timeout_s=280)


@pytest.mark.timeout(200)
def test_llama_recomputation_replays_keyed_dropout():
    """With dropout (attention probabilities of the grouped heads, sequence-parallel residuals),
    executor, full and selective recomputation give the stored run's weights bitwise."""
    spawn_world(run_recompute_replays_tensor_parallel_dropout, 4, "gpt2", LLAMA_MODEL,
                timeout_s=180)
