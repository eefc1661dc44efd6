"""``--cp-comm-type`` with one value per layer (Megatron's list form): each layer runs its own
context-parallel kernel (recorded at the kernel table) and the whole model at CP = 2 still
equals one process (loss and every gradient)."""

from __future__ import annotations

import pytest

from megatron_chimera.model import context_parallel

from .cp_model_cases import run_model_matches_one_process
from .harness import spawn_world

pytestmark = pytest.mark.distributed

PER_LAYER = ("a2a", "p2p", "allgather", "p2p")  # small_config's 4 layers, layer 1 first


def run_per_layer(rank, world_size, comm_types):
    """Llama-style (GQA, 2 key/value groups: a2a splits them over CP = 2) with a list of types:
    the kernels called in the forward are the list in layer order, and the model equals one
    process (``run_model_matches_one_process``'s 1e-6 loss / 1e-5 gradient bounds)."""
    called = []
    kernels = dict(context_parallel._KERNELS)

    def recording(name):
        def kernel(*args):
            called.append(name)
            return kernels[name](*args)
        return kernel

    context_parallel._KERNELS.update({name: recording(name) for name in kernels})
    try:
        run_model_matches_one_process(rank, world_size, comm_types, True, False)
    finally:
        context_parallel._KERNELS.update(kernels)
    assert tuple(called) == comm_types, called


@pytest.mark.timeout(120)
def test_per_layer_comm_types_run_their_own_kernel_and_equal_one_process():
    spawn_world(run_per_layer, 2, PER_LAYER, timeout_s=110, nccl_semantics=False)
