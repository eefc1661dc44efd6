"""Tensor-parallel random-number streams (Megatron-core's ``CudaRNGStatesTracker``), on CUDA and
on the CPU.

Dropout outside tensor-parallel regions (the residual stream, replicated on every tensor-parallel
rank) must draw the same mask on every rank: it uses the default generator, seeded alike on the
ranks of a tensor-parallel group. Dropout inside them (attention probabilities of this rank's
heads, and under sequence parallelism the residual stream of this rank's sequence chunk) must
differ: it runs inside ``get_cuda_rng_tracker().fork()``, which swaps in the tracker's
``model-parallel-rng`` state, seeded with ``seed + 2718 + tensor rank``
(:func:`model_parallel_cuda_manual_seed`, as Megatron). The tracker swaps the CPU generator and,
on a machine with CUDA, the current device's, so the same code runs on both.

The tracker is process state like Megatron's (one per process, reset by every seeding).
:func:`checkpoint` is activation checkpointing that also replays the tracker's streams, so a
recomputed dropout draws the mask its forward drew. :func:`get_rng_states` /
:func:`set_rng_states` save and restore all of the process's streams at once, and
:func:`forked_rng_states` derives independent ones from them (the paired runtime gives each
half of a pair its own, ``pipeline/overlap.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.utils.checkpoint

from megatron_chimera import parallel_state

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
TENSOR_PARALLEL_SEED_OFFSET = 2718

RngState = tuple[torch.Tensor, torch.Tensor | None]  # (CPU state, CUDA state or None)
Device = torch.device | str | None


def _cuda_active() -> bool:
    """Whether the CUDA generator is tracked too (on any machine with a CUDA device: seeding
    before the first CUDA operation must not leave the device's dropout on one stream)."""
    return torch.cuda.is_available()


def _current_state(device: Device = None) -> RngState:
    """CPU and CUDA state; CUDA's of ``device`` (None: the current device; a CPU device is
    never passed to CUDA)."""
    cuda = torch.cuda.get_rng_state(_cuda_device(device)) if _cuda_active() else None
    return torch.get_rng_state(), cuda


def _set_state(state: RngState, device: Device = None) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None and _cuda_active():
        torch.cuda.set_rng_state(state[1], _cuda_device(device))


def _cuda_device(device: Device) -> torch.device | str:
    """The CUDA device whose generator is meant: ``device`` when it is one, else ``"cuda"``
    (the current device)."""
    if device is not None and torch.device(device).type == "cuda":
        return device
    return "cuda"


class CudaRNGStatesTracker:
    """Named RNG states; :meth:`fork` runs a block on one of them (Megatron's name, CPU too)."""

    def __init__(self) -> None:
        self.states_: dict[str, RngState] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        """Forget every state."""
        self.states_.clear()
        self.seeds_.clear()

    def is_initialized(self) -> bool:
        """Whether any state was added."""
        return bool(self.states_)

    def get_states(self) -> dict[str, RngState]:
        """A copy of every named state."""
        return {name: (cpu.clone(), None if cuda is None else cuda.clone())
                for name, (cpu, cuda) in self.states_.items()}

    def set_states(self, states: dict[str, RngState]) -> None:
        """Replace every named state (from :meth:`get_states`)."""
        self.states_ = {name: (cpu.clone(), None if cuda is None else cuda.clone())
                        for name, (cpu, cuda) in states.items()}

    def add(self, name: str, seed: int) -> None:
        """A new state ``name`` seeded with ``seed`` (both must be new)."""
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists in the RNG tracker")
        if name in self.states_:
            raise ValueError(f"RNG state {name} already exists")
        self.seeds_.add(seed)
        cpu = torch.Generator().manual_seed(seed).get_state()
        cuda = None
        if _cuda_active():
            original = torch.cuda.get_rng_state()
            torch.cuda.manual_seed(seed)
            cuda = torch.cuda.get_rng_state()
            torch.cuda.set_rng_state(original)
        self.states_[name] = (cpu, cuda)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Run the block on state ``name`` (advancing it), then restore the default state.

        Without any state (a model used outside ``initialize_megatron``) and T = 1 this is a
        no-op: one process has no tensor-parallel peers to differ from.
        """
        if name not in self.states_:
            if not self.states_ and parallel_state.get_tensor_model_parallel_world_size() == 1:
                yield
                return
            raise RuntimeError(f"RNG state {name} is not added to the tracker: call "
                               f"model_parallel_cuda_manual_seed")
        original = _current_state()
        _set_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _current_state()
            _set_state(original)


_CUDA_RNG_STATE_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The process's tracker (Megatron's name; CPU states too)."""
    return _CUDA_RNG_STATE_TRACKER


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default generators with ``seed`` (equal on the ranks of a tensor-parallel group)
    and the tracker's ``model-parallel-rng`` with ``seed + 2718 + tensor rank``."""
    tensor_parallel_seed = (seed + TENSOR_PARALLEL_SEED_OFFSET
                            + parallel_state.get_tensor_model_parallel_rank())
    _CUDA_RNG_STATE_TRACKER.reset()
    torch.manual_seed(seed)
    _CUDA_RNG_STATE_TRACKER.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, tensor_parallel_seed)


@contextlib.contextmanager
def restored_tracker_states(states: dict[str, RngState] | None) -> Iterator[None]:
    """Run the block with the tracker's states set to ``states`` (None: unchanged), then put back
    the states it had (for replaying a forward's dropout during recomputation)."""
    if states is None:
        yield
        return
    current = _CUDA_RNG_STATE_TRACKER.get_states()
    _CUDA_RNG_STATE_TRACKER.set_states(states)
    try:
        yield
    finally:
        _CUDA_RNG_STATE_TRACKER.set_states(current)


class RngStates(NamedTuple):
    """Every random stream of this process: the default generators' (CPU, and CUDA's current
    device where CUDA is present) and the tracker's named states."""

    default: RngState
    tracker: dict[str, RngState]


def get_rng_states(device: Device = None) -> RngStates:
    """A copy of every random stream of this process (:class:`RngStates`); CUDA's of
    ``device`` (the paired runtime names its rank's device: never cuda:0 implicitly)."""
    return RngStates(_current_state(device), _CUDA_RNG_STATE_TRACKER.get_states())


def set_rng_states(states: RngStates, device: Device = None) -> None:
    """Put every random stream of this process where ``states`` says (from
    :func:`get_rng_states`)."""
    _set_state(states.default, device)
    _CUDA_RNG_STATE_TRACKER.set_states(states.tracker)


_SEED_BOUND = 1 << 62


def seeded_cuda_state(seed: int, device: Device) -> torch.Tensor:
    """The state of a CUDA generator of ``device`` seeded with ``seed``."""
    return torch.Generator(device=_cuda_device(device)).manual_seed(seed).get_state()


def _forked(state: RngState, device: Device = None) -> RngState:
    """A new stream seeded from one number drawn from a *copy* of ``state`` (the stream
    ``state`` describes is not advanced)."""
    cpu, cuda = state
    copy = torch.Generator()
    copy.set_state(cpu)
    seed = int(torch.randint(_SEED_BOUND, (1,), generator=copy))
    forked_cpu = torch.Generator().manual_seed(seed).get_state()
    forked_cuda = None
    if cuda is not None and _cuda_active():
        forked_cuda = seeded_cuda_state(seed, device)
    return forked_cpu, forked_cuda


def forked_rng_states(states: RngStates, device: Device = None) -> RngStates:
    """Streams of their own, derived deterministically from ``states`` (each seeded from a
    draw of a copy of its origin, so ``states`` themselves are untouched): for a second
    sequence of work that must not reuse the first one's random numbers (the second half of
    a paired F&B action, ``pipeline/overlap.py``)."""
    return RngStates(_forked(states.default, device),
                     {name: _forked(state, device) for name, state in states.tracker.items()})


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """``torch.utils.checkpoint`` (non-reentrant, default RNG states preserved) that also replays
    the tracker's states in the recomputation (Megatron's ``tensor_parallel.checkpoint``)."""
    states = _CUDA_RNG_STATE_TRACKER.get_states()

    def context_fn():
        return contextlib.nullcontext(), restored_tracker_states(states)

    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False,
                                             context_fn=context_fn)
