"""Context-parallel attention (``p2p`` ring, ``a2a``, ``allgather``) on gloo: outputs and
dQ/dK/dV of every rank's zigzag share equal whole-sequence attention computed in one process
(float64: 1e-12 relative, float32: 2e-6), at CP = 2 and 4, causal and bidirectional, grouped-
query attention, document masks."""

from __future__ import annotations

import pytest

from .cp_cases import run_attention_cases, run_zigzag_round_trip
from .harness import spawn_world

pytestmark = pytest.mark.distributed


@pytest.mark.timeout(150)
def test_context_parallel_attention_equals_full_attention():
    spawn_world(run_attention_cases, 4, timeout_s=140, nccl_semantics=False)


def test_zigzag_split_round_trip():
    run_zigzag_round_trip(0, 1)
