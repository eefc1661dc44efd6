"""What a forward leaves for its backward and the random-state helpers of the executor's
recomputation (split from :mod:`.executor`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch.autograd import Variable

from megatron_chimera.model.moe.expert_comm import BackwardTape
from megatron_chimera.pipeline.overlap import PairRuntime
from megatron_chimera.tensor_parallel import get_cuda_rng_tracker
from megatron_chimera.tensor_parallel.random import restored_tracker_states


class SavedForward(NamedTuple):
    """What a forward leaves for its backward: the stage input (with ``requires_grad``), and
    either the output (stored activations) or the RNG state to replay it (recomputation), and
    the cuts of its graph (``tape``: its backward runs in pieces, :mod:`.overlap`)."""

    input_tensor: torch.Tensor | None
    output: torch.Tensor | None
    rng_state: tuple | None
    tape: BackwardTape | None = None


def custom_backward(output: torch.Tensor, grad_output: torch.Tensor) -> None:
    """Backward without autograd's shape check, so ``output`` may have been deallocated."""
    Variable._execution_engine.run_backward(
        tensors=(output,), grad_tensors=(grad_output,), keep_graph=False, create_graph=False,
        inputs=(), allow_unreachable=True, accumulate_grad=True,
    )


@contextlib.contextmanager
def taping(runtime: PairRuntime, tape: BackwardTape | None) -> Iterator[None]:
    """The MoE layers record their cuts on ``tape`` within the block."""
    previous, runtime.tape = runtime.tape, tape
    try:
        yield
    finally:
        runtime.tape = previous


def saved_rng_state(device: torch.device) -> tuple:
    """The random streams a recomputation replays (default CPU, ``device``'s CUDA, tracker)."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda, get_cuda_rng_tracker().get_states()


@contextlib.contextmanager
def restored_rng(state: tuple | None, device: torch.device):
    """Replay the forward's random streams (dropout: the default generator and the
    tensor-parallel tracker's) during recomputation, then restore."""
    if state is None:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), restored_tracker_states(state[2]):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield
