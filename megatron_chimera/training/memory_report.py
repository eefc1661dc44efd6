"""The per-rank memory report: weights, gradients, optimizer state, peak activations and pipeline
buffers of every rank, predicted from the configuration and measured after the run's first
iteration, one line per rank in the log and in TensorBoard (``memory/...``).

Predicted: :func:`megatron_chimera.tuning.rank_memory.rank_memory` for the run's schedule and stage
partition (uneven stages included) and :func:`~megatron_chimera.tuning.rank_memory.receive_buffers`
for the pooled receive buffers. Measured on the CPU from the tensors the rank holds: its stage
parameters, gradient buffers, optimizer state (main parameters and moments), the bytes saved for
backward at their peak during the iteration (``saved_tensors_hooks``; the split backward's
deferred (input, grad-output) pairs are not among them) and the receive buffers its pipeline
communicator allocated. On CUDA the allocator's figures are added as Megatron prints them
(``memory (MB) | allocated | max allocated | reserved | max reserved``), and the measured total
is the allocator's peak.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_chimera import parallel_state
from megatron_chimera.config import TrainConfig
from megatron_chimera.model.family import ModelFamily
from megatron_chimera.schedules.actions import Schedule

MB = 2**20
KINDS = ("weights", "grads", "optimizer", "activations", "buffers")


@dataclass(frozen=True)
class MemoryFigures:
    """Bytes of one rank by kind; ``total`` the peak (predicted: weights + grads + optimizer +
    max(activations, step transient) + buffers; measured on CUDA: the allocator's peak)."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    total: float

    def line(self) -> str:
        """``weights 1.2 | grads ... | total ...`` in MB."""
        return " | ".join(f"{kind} {getattr(self, kind) / MB:.2f}" for kind in
                          (*KINDS, "total"))


def predicted_memory(config: TrainConfig, family: ModelFamily, schedule: Schedule,
                     partition: list[tuple[int, int]], device_type: str) -> list[MemoryFigures]:
    """Predicted figures of every pipeline rank (one tensor rank's share; with context
    parallelism one context rank's: its s/CP tokens, the optimizer sharded over data x context
    ranks; with k sequence slices each live unit is one slice of s/k tokens plus the keys and
    values of its sequence's earlier slices, :func:`~megatron_chimera.tuning.rank_memory.
    slice_cache_bytes`)."""
    from megatron_chimera.tuning.analytic_costs import ModelSpec, pieces_of
    from megatron_chimera.tuning.rank_memory import (
        rank_memory,
        receive_buffers,
        slice_cache_bytes,
        sliced_rank_memory,
    )

    parallel, model = config.parallel, config.model
    cp, k = parallel.context_parallel_size, schedule.sequence_slices
    local = model if cp * k == 1 else dataclasses.replace(
        model, seq_length=model.seq_length // (cp * k),
        max_position_embeddings=model.max_positions)
    spec = ModelSpec(local, family)
    pieces = pieces_of(partition)
    ranks = rank_memory(spec, schedule, pieces, config.training.micro_batch_size,
                        model.recompute_granularity == "full", device_type,
                        parallel.tensor_model_parallel_size, model.sequence_parallel,
                        parallel.data_parallel_size * cp, config.ddp.use_distributed_optimizer,
                        config.ddp.grad_reduce_in_fp32,
                        expert_parallel=parallel.expert_model_parallel_size)
    ranks = sliced_rank_memory(ranks, schedule, slice_cache_bytes(
        ModelSpec(model, family), pieces, config.training.micro_batch_size, k,
        parallel.tensor_model_parallel_size))
    seq = local.seq_length
    if model.sequence_parallel and parallel.tensor_model_parallel_size > 1:
        seq //= parallel.tensor_model_parallel_size
    message = seq * config.training.micro_batch_size * model.hidden_size * model.dtype_bytes
    buffers = [n * message for n in receive_buffers(schedule)]
    return [MemoryFigures(r.param_bytes, r.grad_bytes, r.optimizer_bytes, r.activation_bytes,
                          b, r.total_bytes + b) for r, b in zip(ranks, buffers)]


class SavedActivations:
    """Bytes saved for backward alive at once, at their peak, while the context is active (one
    count per storage; parameters excluded)."""

    def __init__(self, parameters: Iterable[torch.Tensor]) -> None:
        self._params = {p.untyped_storage().data_ptr() for p in parameters}
        self._refs: dict[int, int] = {}
        self.current = self.peak = 0
        self._hooks: Any = None

    def _pack(self, tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._params or storage.nbytes() == 0:
            return tensor
        if self._refs.get(key, 0) == 0:
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        self._refs[key] = self._refs.get(key, 0) + 1
        return _Held(tensor, key, storage.nbytes(), self)

    def _release(self, key: int, nbytes: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.current -= nbytes

    def __enter__(self) -> SavedActivations:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(
            self._pack, lambda held: held.tensor if isinstance(held, _Held) else held)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


class _Held:
    """A saved tensor; its storage is counted until the graph lets go of it."""

    __slots__ = ("tensor", "key", "nbytes", "meter")

    def __init__(self, tensor: torch.Tensor, key: int, nbytes: int,
                 meter: SavedActivations) -> None:
        self.tensor, self.key, self.nbytes, self.meter = tensor, key, nbytes, meter

    def __del__(self) -> None:
        self.meter._release(self.key, self.nbytes)  # noqa: SLF001 (its own meter)


def _unique_bytes(tensors: Iterable[torch.Tensor], exclude: set[int] | None = None) -> int:
    seen = set(exclude or ())
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def measured_memory(stages: list[Any], optimizer: Any, executor: Any,
                    activations: SavedActivations | None) -> MemoryFigures:
    """This rank's figures from the tensors it holds (see the module docstring)."""
    params = [p for s in stages for p in s.module.parameters()]
    weights = _unique_bytes(params)
    param_keys = {p.untyped_storage().data_ptr() for p in params}
    buffers = getattr(optimizer, "grad_buffers", None)
    grad_tensors = ([b.grad_data for b in buffers.all_buffers()] if buffers is not None
                    else [p.grad for p in params if p.grad is not None])
    grads = _unique_bytes(grad_tensors)
    grad_keys = {t.untyped_storage().data_ptr() for t in grad_tensors}
    inner = getattr(optimizer, "optimizer", None)
    state = list(_tensors(getattr(inner, "state", {}))) + list(getattr(optimizer, "main_params",
                                                                       []))
    opt = _unique_bytes(state, param_keys | grad_keys)
    spec_bytes = [math.prod(s.shape) * torch.empty((), dtype=s.dtype).element_size()
                  for s in executor.comm.specs.values()]
    pipeline = executor.comm.pool.allocated * max(spec_bytes, default=0)
    peak = activations.peak if activations is not None else 0
    total = weights + grads + opt + peak + pipeline
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        total = torch.cuda.max_memory_allocated()
    return MemoryFigures(weights, grads, opt, peak, pipeline, total)


def allocator_line() -> str:
    """Megatron's ``memory (MB) | allocated | max allocated | reserved | max reserved`` figures
    (empty off CUDA)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return ""
    return (f" | memory (MB) | allocated: {torch.cuda.memory_allocated() / MB:.1f} | max "
            f"allocated: {torch.cuda.max_memory_allocated() / MB:.1f} | reserved: "
            f"{torch.cuda.memory_reserved() / MB:.1f} | max reserved: "
            f"{torch.cuda.max_memory_reserved() / MB:.1f}")


class MemoryReport:
    """Measures the run's first iteration and reports it beside the prediction."""

    def __init__(self, iteration: int, predicted: list[MemoryFigures]) -> None:
        self.iteration, self.predicted = iteration, predicted
        self.activations: SavedActivations | None = None

    def meter(self, stages: list[Any], iteration: int) -> Any:
        """The context that counts saved activations during the measured iteration."""
        if iteration != self.iteration:
            return _NULL
        self.activations = SavedActivations(p for s in stages for p in s.module.parameters())
        return self.activations

    def report(self, run: Any, iteration: int) -> None:
        """After the measured iteration: gather every rank's figures on the logging rank, one
        line per rank there and TensorBoard scalars. Collective."""
        if iteration != self.iteration:
            return
        pipeline_rank = parallel_state.get_pipeline_model_parallel_rank()
        mine = (dist.get_rank(), pipeline_rank, self.predicted[pipeline_rank],
                measured_memory(run.stages, run.optimizer, run.pipeline.executor, self.activations),
                allocator_line())
        self.activations = None
        world, logging_rank = dist.get_world_size(), dist.get_world_size() - 1
        gathered: list[Any] | None = [None] * world if dist.get_rank() == logging_rank else None
        dist.gather_object(mine, gathered, dst=logging_rank)
        if gathered is not None:
            run.monitor.log_memory_report(iteration, *report_lines(gathered))


def report_lines(per_rank: list[tuple[int, int, MemoryFigures, MemoryFigures, str]]
                 ) -> tuple[list[str], dict[str, float]]:
    """The log lines (one per rank) and TensorBoard scalars of the gathered figures."""
    lines, scalars = [], {}
    for rank, pipeline_rank, predicted, measured, allocator in sorted(per_rank):
        lines.append(f" [rank {rank}, pipeline rank {pipeline_rank}] memory (MB) predicted: "
                     f"{predicted.line()} || measured: {measured.line()}{allocator}")
        for kind, value in dataclasses.asdict(predicted).items():
            scalars[f"memory/rank-{rank}/predicted-{kind}-MB"] = value / MB
        for kind, value in dataclasses.asdict(measured).items():
            scalars[f"memory/rank-{rank}/measured-{kind}-MB"] = value / MB
    return lines, scalars


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_NULL = _Null()
