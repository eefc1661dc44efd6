"""Sequence-sliced pipelines through the runtime (2 gloo ranks): 1F1B, Chimera and Chimera-ZB on
slices train as one process on the whole sequences (losses, clipped grad norms, weights)."""

from __future__ import annotations

import pytest

from .harness import spawn_world
from .slice_cases import run_sliced_cases
from .tp_cases import LLAMA_MODEL, TPCase

pytestmark = pytest.mark.distributed


@pytest.mark.timeout(200)
def test_sliced_pipelines_equal_one_process():
    spawn_world(run_sliced_cases, 2, [
        TPCase("gpt2", "1f1b", 1, 2, 2, slices=4),
        TPCase("gpt2", "chimera", 1, 2, 2, slices=2, model=LLAMA_MODEL, reset_positions=True),
        TPCase("gpt2", "chimera-zb", 1, 2, 2, slices=4),
    ], timeout_s=190)


FULL_RECOMPUTE = (("recompute_granularity", "full"), ("recompute_method", "uniform"),
                  ("recompute_num_layers", 1))


@pytest.mark.timeout(120)
def test_sliced_chimera_with_full_recomputation_equals_one_process():
    """--recompute-granularity full with slices: every slice's forward is replayed in its
    backward on the keys/values it cached (model/sequence_slices.py); training equals one
    process on the whole sequences."""
    spawn_world(run_sliced_cases, 2, [
        TPCase("gpt2", "chimera", 1, 2, 2, slices=4, model=FULL_RECOMPUTE)], timeout_s=110)
