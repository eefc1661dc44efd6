"""Keyed dropout: every dropout mask is a function of (seed, micro-batch, layer), not of the rank.

With one global random stream per rank, a dropout mask depends on which rank runs a layer, in
which order it runs its micro-batches, and on every other draw from that stream (a data loader's
seed, ...). Then neither a schedule change, nor a layout change, nor a resume that draws one
number more gives the same masks. Here the training driver wraps each micro-batch with its
*key* (the global index of its first sample and the seed) and runs its forward inside
:func:`dropout_stream`; each dropout site (the embedding, every transformer layer by its global
number) reseeds the generator from ``(key, site)`` before it draws. So a micro-batch gets the
same masks on any rank, in any schedule, on any (D, pipes, W) with the same micro-batch size,
and before or after a resume. The rank's own random stream is restored after each forward.

Recomputation replays the same masks: the executor re-runs the wrapped forward step (same key),
and activation checkpointing inside the model captures the key when it first runs (see
:func:`current_stream`). Outside a stream (evaluation, tests, user code) dropout uses the
global generator as usual.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, NamedTuple

import torch

_STREAM: ContextVar[int | None] = ContextVar("megatron_chimera_dropout_stream", default=None)
EMBEDDING_SITE = "embedding"


class KeyedMicrobatch(NamedTuple):
    """A micro-batch (or None on a stage that reads no data) and its dropout key."""

    key: int
    batch: Any


def microbatch_key(seed: int, first_sample: int) -> int:
    """The dropout key of the micro-batch whose first sample is global sample ``first_sample``."""
    return _digest(f"microbatch:{seed}:{first_sample}")


def slice_key(key: int, index: int) -> int:
    """The dropout key of slice ``index`` of the micro-batch keyed ``key`` (sequence-sliced
    pipelines: each slice draws its own masks)."""
    return _digest(f"slice:{key}:{index}")


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(),
                          "little") & ((1 << 63) - 1)


_MASK64 = (1 << 64) - 1


@functools.cache
def _site_key(site: str) -> int:
    """A site name's 64-bit key (a digest, so that it is the same in every process)."""
    return _digest(f"site:{site}")


def _site_seed(stream: int, site: str) -> int:
    """The seed of ``site`` in micro-batch ``stream``: SplitMix64's finaliser of the two keys
    combined, in integer arithmetic (every layer of every micro-batch reseeds: no string
    hashing there)."""
    z = (stream * 0x9E3779B97F4A7C15 + _site_key(site)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1  # 63 bits: a valid manual_seed on every generator


def current_stream() -> int | None:
    """The key of the micro-batch whose forward is running, or None outside a stream."""
    return _STREAM.get()


class _Stream:
    """The context of :func:`dropout_stream` and :func:`in_stream`: make ``key`` the current
    stream and, with ``fork``, put the CPU (and ``device``'s CUDA) generator back on exit. A
    class rather than a generator context: it is entered once per micro-batch forward on the
    host's critical path, and ``torch.random.fork_rng`` costs more than the layers it wraps at
    host-bound sizes."""

    __slots__ = ("key", "fork", "cuda_device", "_token", "_cpu_state", "_cuda_state")

    def __init__(self, key: int | None, fork: bool, device: torch.device | None) -> None:
        self.key, self.fork = key, fork
        self.cuda_device = device if device is not None and device.type == "cuda" else None

    def __enter__(self) -> None:
        if self.fork:
            self._cpu_state = torch.default_generator.get_state()
            if self.cuda_device is not None:
                self._cuda_state = torch.cuda.get_rng_state(self.cuda_device)
        self._token = _STREAM.set(self.key)

    def __exit__(self, *exc_info: object) -> None:
        _STREAM.reset(self._token)
        if self.fork:
            torch.default_generator.set_state(self._cpu_state)
            if self.cuda_device is not None:
                torch.cuda.set_rng_state(self._cuda_state, self.cuda_device)


def dropout_stream(key: int, device: torch.device | None = None
                   ) -> contextlib.AbstractContextManager[None]:
    """Run a micro-batch's forward with keyed dropout; the rank's RNG state (CPU, and
    ``device``'s on CUDA) is restored after."""
    return _Stream(key, True, device)


def seed_site(stream: int | None, site: str) -> None:
    """Reseed the CPU (and current CUDA device) generator for dropout site ``site`` of the
    micro-batch ``stream``; a no-op when ``stream`` is None (no keyed stream)."""
    if stream is None:
        return
    seed = _site_seed(stream, site)
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():  # (initialised implies available; checked per layer: cheap)
        torch.cuda.manual_seed(seed)


@contextlib.contextmanager
def keyed_site(stream: int, site: str) -> Iterator[None]:
    """Run the block on a generator seeded from ``(stream, site)`` and put the previous state
    back after: a side stream (e.g. dropout on tensor-split data, keyed by the tensor rank in
    ``site``) that leaves the layer's own stream exactly where it was."""
    cuda = torch.cuda.is_initialized()
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else []):
        seed_site(stream, site)
        yield


def in_stream(stream: int | None) -> contextlib.AbstractContextManager[None]:
    """Make ``stream`` the current one for the block (without touching any generator): for a
    recomputation in the backward, where the forward's stream is no longer current."""
    return _Stream(stream, False, None)


def with_current_stream(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` bound to the stream current now, so activation checkpointing's recomputation
    draws the same keyed masks as the forward did."""
    stream = current_stream()

    def bound(*args: Any) -> Any:
        with in_stream(stream):
            return function(*args)

    return bound


def layer_site(layer_number: int) -> str:
    """The site name of the transformer layer with 1-based global number ``layer_number``."""
    return f"layer:{layer_number}"


def keyed_forward_step(forward_step_func: Callable[[Any, Any], Any],
                       device: torch.device | None = None) -> Callable[[Any, Any], Any]:
    """``forward_step_func`` taking :class:`KeyedMicrobatch` entries (plain batches pass
    through unkeyed, e.g. in evaluation)."""

    def forward_step(batch: Any, model: Any) -> Any:
        if not isinstance(batch, KeyedMicrobatch):
            return forward_step_func(batch, model)
        with dropout_stream(batch.key, device):
            return forward_step_func(batch.batch, model)

    return forward_step
