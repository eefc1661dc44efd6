"""Megatron's distributed optimizer (ZeRO-1) over Chimera's stage-replica groups.

Every stage's gradient buffer is cut into buckets whose ``R`` equal shards belong to the ``R``
ranks of the stage-replica group (``2f x W`` ranks for Chimera with ``2f`` pipes, ``W`` for
single-pipe schedules). After the runtime's reduce-scatter each rank holds the summed gradient of
its shard only; it steps fp32 main parameters and optimizer state for that shard alone (a
*fragment* per parameter it overlaps), copies them into its shard of the parameter buffer and
all-gathers the buffer's buckets over the group, synchronously or -- with
``overlap_param_gather`` -- in the background, each stage waiting for its parameters before its
first forward of the next iteration.

The tied word embedding is sharded the same way over the embedding group (every holder of a
copy): its gradient is reduce-scattered there, its shards stepped and all-gathered; the local
copies on one rank share one storage.

The grad norm and the found-inf flag are reduced over the whole world: with tensor parallelism
each tensor rank's stages are sharded over that tensor rank's stage-replica groups, so each element
of every tensor rank's shard lies in exactly one rank's shard; a parameter replicated over the
tensor-parallel ranks (LayerNorm, row-parallel bias) counts on tensor rank 0 only
(``param_is_not_tensor_parallel_duplicate``), so summing every rank's shard squares counts every
element of the model once.

Checkpoints stay layout-independent: the writer of each stage file gathers the full
per-parameter state from the shards (:mod:`megatron_chimera.optimizer.param_state`), and a load
slices this rank's fragments out of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron_chimera.distributed.grad_buffer import (
    TIED,
    GradBuffer,
    ModelGradBuffers,
    ShardGroup,
    expert_unit,
    is_expert,
)
from megatron_chimera.model.fused import FusedBackend
from megatron_chimera.optimizer.grad_scaler import MegatronGradScaler
from megatron_chimera.optimizer.kernels import multi_tensor_scale_
from megatron_chimera.optimizer.optimizer import MegatronOptimizer
from megatron_chimera.optimizer.param_state import (
    MAIN_PARAM,
    ParamEntry,
    ParamFragments,
    ParamStateError,
    is_elementwise,
    own_copy,
    to_host,
)
from megatron_chimera.tensor_parallel.collectives import all_gather_single
from megatron_chimera.tensor_parallel.utils import param_is_not_tensor_parallel_duplicate

InnerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


Unit = int | str  # a stage id, TIED, or a stage's experts (expert_unit)


@dataclass
class Fragment:
    """The part ``[lo, hi)`` of ``buffer`` owned here that belongs to ``param`` (elements
    ``offset .. offset + hi - lo`` of the flattened parameter), and its fp32 main copy."""

    param: nn.Parameter
    buffer: GradBuffer
    lo: int
    hi: int
    offset: int
    main: nn.Parameter

    def model_view(self) -> torch.Tensor:
        """This fragment of the model parameter (a view)."""
        return self.param.detach().view(-1)[self.offset:self.offset + self.hi - self.lo]


def _fragments_of(buffer: GradBuffer,
                  shard: ShardGroup) -> list[tuple[nn.Parameter, int, int, int]]:
    """(param, lo, hi, offset) of every parameter overlapping this rank's shards of ``buffer``."""
    found = []
    for bucket in buffer.buckets:
        shard_lo, shard_hi = bucket.shard(shard.size, shard.rank)
        for index in bucket.param_indices:
            start, end = buffer.layout.ranges[index]
            lo, hi = max(start, shard_lo), min(end, shard_hi)
            if lo < hi:
                found.append((buffer.params[index], lo, hi, lo - start))
    return found


def _main_copy(view: torch.Tensor) -> nn.Parameter:
    """fp32 main parameter of a model-parameter view: the view itself for fp32 (updates land in
    the model directly), an fp32 copy otherwise."""
    if view.dtype == torch.float32:
        return nn.Parameter(view)
    return nn.Parameter(view.detach().clone().float())


class DistributedOptimizer(MegatronOptimizer):
    """Sharded fp32 main parameters and optimizer state (``--use-distributed-optimizer``).

    ``param_groups``: the model parameters by weight-decay group (:func:`get_param_groups`);
    ``make_inner(groups)`` builds the inner optimizer over the main fragments;
    ``shards[stage]`` / ``shards[TIED]``: how each stage and the tied embedding are sharded.
    """

    def __init__(self, make_inner: InnerFactory, param_groups: list[dict[str, Any]],
                 grad_buffers: ModelGradBuffers, shards: dict[Unit, ShardGroup],
                 clip_grad: float, grad_scaler: MegatronGradScaler | None,
                 backend: FusedBackend, world_group=None, overlap_param_gather: bool = False,
                 log_num_zeros_in_grad: bool = False) -> None:
        self.shards = shards
        self.overlap_param_gather = overlap_param_gather
        self.tied_copies = list(grad_buffers.tied_copies)
        self.units: dict[Unit, list[GradBuffer]] = {
            s: grad_buffers.stages[s] for s in sorted(grad_buffers.stages, reverse=True)}
        if grad_buffers.tied is not None:
            self.units[TIED] = [grad_buffers.tied]
        for s in sorted(grad_buffers.experts, reverse=True):  # expert parallelism
            self.units[expert_unit(s)] = grad_buffers.experts[s]
        self.fragments: dict[Unit, list[Fragment]] = {}
        by_param: dict[int, list[Fragment]] = {}
        for unit, buffers in self.units.items():
            frags = []
            for buffer in buffers:
                for param, lo, hi, offset in _fragments_of(buffer, self._shard(unit)):
                    view = param.detach().view(-1)[offset:offset + hi - lo]
                    frag = Fragment(param, buffer, lo, hi, offset, _main_copy(view))
                    frags.append(frag)
                    by_param.setdefault(id(param), []).append(frag)
            self.fragments[unit] = frags
        for copy in self.tied_copies[1:]:  # the copies share the first one's fragments
            by_param[id(copy)] = by_param.get(id(self.tied_copies[0]), [])
        inner_groups, mains, counts, seen = [], [], [], set()
        for group in param_groups:
            group_mains = []
            for param in group["params"]:
                for frag in by_param.get(id(param), []):
                    if id(frag.main) not in seen:
                        seen.add(id(frag.main))
                        group_mains.append(frag.main)
                        counts.append(is_expert(frag.param)  # (an expert group's ranks
                                      or param_is_not_tensor_parallel_duplicate(frag.param))
            mains += group_mains
            inner_groups.append({**group, "params": group_mains})
        super().__init__(make_inner(inner_groups), mains, counts, clip_grad,
                         grad_scaler, backend, world_group, world_group, log_num_zeros_in_grad,
                         grad_buffers)
        self._by_param = by_param
        self._pending: dict[Unit, list[dist.Work]] = {}
        self._hooks: list = []

    def _shard(self, unit: Unit) -> ShardGroup:
        return self.shards.get(unit, ShardGroup(None, 1, 0))

    # ------------------------------------------------------------------ step
    def _model_params(self) -> list[nn.Parameter]:
        return [f.param for frags in self.fragments.values() for f in frags] + self.tied_copies

    def _all_fragments(self) -> list[Fragment]:
        return [f for frags in self.fragments.values() for f in frags]

    def _prepare_main_grads(self) -> None:
        copies = []
        for frag in self._all_fragments():
            grad = frag.buffer.grad_data[frag.lo:frag.hi]
            if grad.dtype == torch.float32:
                frag.main.grad = grad
            else:
                if frag.main.grad is None:
                    frag.main.grad = torch.empty_like(frag.main)
                copies.append((grad, frag.main.grad))
        multi_tensor_scale_([g for g, _ in copies], [m for _, m in copies], 1.0, self.backend)

    def _copy_main_params_to_model(self) -> None:
        pairs = [(f.main.data, f.model_view()) for f in self._all_fragments()
                 if f.main.dtype != f.param.dtype]
        multi_tensor_scale_([s for s, _ in pairs], [t for _, t in pairs], 1.0, self.backend)
        self._gather_params()

    def _gather_params(self) -> None:
        """All-gather every unit's parameter buckets over its shard group (descending stages,
        the tied embedding last, bucket order: one global order)."""
        self.finish_param_sync()
        for unit, buffers in self.units.items():
            shard = self._shard(unit)
            if shard.size <= 1 or shard.group is None:  # None: accounting runs, no peers
                continue
            works = []
            for buffer in buffers:
                for bucket in buffer.buckets:
                    lo, hi = bucket.shard(shard.size, shard.rank)
                    works.append(all_gather_single(
                        buffer.param_data[bucket.start:bucket.end], buffer.param_data[lo:hi],
                        group=shard.group, async_op=True))
            self._pending[unit] = works
        if not self.overlap_param_gather:
            self.finish_param_sync()

    def wait_for_stage(self, stage: int) -> None:
        """Block until the parameters of ``stage`` (and the tied embedding, which the first and
        last stages read) are gathered."""
        for unit in (stage, TIED, expert_unit(stage)):
            for work in self._pending.pop(unit, []):
                work.wait()

    def finish_param_sync(self) -> None:
        for unit in list(self._pending):
            for work in self._pending.pop(unit):
                work.wait()

    def register_param_gather_hooks(self, stage_modules: dict[int, nn.Module]) -> None:
        """With ``overlap_param_gather``: each stage waits for its parameters before a forward."""
        if not self.overlap_param_gather:
            return
        for stage, module in stage_modules.items():
            self._hooks.append(module.register_forward_pre_hook(
                lambda _module, _args, stage=stage: self.wait_for_stage(stage)))

    # ------------------------------------------------------------------ checkpoints
    def param_state_to_save(self, stages: list[tuple[int, dict[str, nn.Parameter], bool]]
                            ) -> dict[int, dict[str, ParamEntry]]:
        full = {unit: self._gather_unit_state(unit) for unit in self.units}
        result: dict[int, dict[str, ParamEntry]] = {}
        for stage, params, writer in stages:
            if not writer:
                continue
            entries: dict[str, ParamEntry] = {}
            for name, param in params.items():
                unit = TIED if any(param is c for c in self.tied_copies) else \
                    expert_unit(stage) if is_expert(param) and expert_unit(stage) in full \
                    else stage
                found = full.get(unit)
                if found is None:
                    continue
                source = self.tied_copies[0] if unit == TIED else param
                if id(source) in found:
                    entries[name] = found[id(source)]
            result[stage] = entries
        return result

    def _state_names(self, unit: Unit) -> tuple[list[str], dict[str, Any]]:
        """Per-element state keys and per-parameter scalars of the unit, agreed over its group
        (a rank may own no fragment of it)."""
        keys: set[str] = set()
        scalars: dict[str, Any] = {}
        for frag in self.fragments[unit]:
            for key, value in self.optimizer.state.get(frag.main, {}).items():
                if is_elementwise(value, frag.main.numel()):
                    keys.add(key)
                else:
                    scalars.setdefault(key, to_host(value))
        shard = self._shard(unit)
        if shard.size > 1 and shard.group is not None:
            everyone: list[Any] = [None] * shard.size
            dist.all_gather_object(everyone, (sorted(keys), scalars), group=shard.group)
            for found_keys, found_scalars in everyone:
                keys.update(found_keys)
                for key, value in found_scalars.items():
                    scalars.setdefault(key, value)
        names = sorted(keys)
        if any(b.param_dtype != torch.float32 for b in self.units[unit]):
            names.append(MAIN_PARAM)
        return names, scalars

    def _gather_unit_state(self, unit: Unit) -> dict[int, ParamEntry] | None:
        """Full per-parameter entries of a unit's parameters (by id) on its writers; None on
        the other ranks. Collective over the unit's shard group."""
        names, scalars = self._state_names(unit)
        shard = self._shard(unit)
        result: dict[int, ParamEntry] | None = None
        for buffer in self.units[unit]:
            arrays = self._gather_buffer_state(unit, buffer, names)
            if arrays is None:
                continue
            result = result if result is not None else {}
            for index, param in enumerate(buffer.params):
                lo, hi = buffer.layout.ranges[index]
                entry: ParamEntry = dict(scalars)
                for name, values in arrays.items():
                    entry[name] = values[lo:hi].view_as(param).clone()
                result[id(param)] = entry
        is_writer = shard.group is None or dist.get_rank() in shard.writers
        return result if is_writer else None

    def _gather_buffer_state(self, unit: Unit, buffer: GradBuffer,
                             names: list[str]) -> dict[str, torch.Tensor] | None:
        """Full-buffer fp32 arrays of every state ``name`` on the unit's writers (None
        elsewhere), gathered from the shards: one gather per writer."""
        shard = self._shard(unit)
        bases, base = {}, 0
        for bucket in buffer.buckets:
            bases[bucket.index] = base
            base += bucket.numel // shard.size
        local = torch.zeros(len(names), base, dtype=torch.float32, device=buffer.grad_data.device)
        for frag in self.fragments[unit]:
            if frag.buffer is not buffer:
                continue
            bucket = buffer.layout.bucket_of(buffer.index_of(frag.param))
            at = bases[bucket.index] + frag.lo - bucket.shard(shard.size, shard.rank)[0]
            state = self.optimizer.state.get(frag.main, {})
            for row, name in enumerate(names):
                value = frag.main.detach() if name == MAIN_PARAM else state.get(name)
                if value is not None:
                    local[row, at:at + frag.hi - frag.lo] = value.reshape(-1)
        gathered: list[torch.Tensor] | None = [local]
        if shard.size > 1 and shard.group is not None:
            me, gathered = dist.get_rank(), None
            for writer in shard.writers:
                parts = [torch.empty_like(local) for _ in range(shard.size)] if me == writer \
                    else None
                dist.gather(local, parts, dst=writer, group=shard.group)
                if parts is not None:
                    gathered = parts
            if gathered is None:
                return None
        full = torch.zeros(len(names), buffer.layout.numel, dtype=torch.float32)
        for rank, part in enumerate(gathered):
            part = part.cpu()
            for bucket in buffer.buckets:
                size = bucket.numel // shard.size
                lo = bucket.start + rank * size
                full[:, lo:lo + size] = part[:, bases[bucket.index]:bases[bucket.index] + size]
        return {name: full[row] for row, name in enumerate(names)}

    def collect_param_state(self, params: dict[str, nn.Parameter],
                            saved: dict[str, ParamEntry]) -> None:
        for name, param in params.items():
            frags = self._by_param.get(id(param), [])
            if not frags:
                continue
            if name not in saved:
                raise ParamStateError(f"no optimizer state for parameter {name}")
            entry = dict(saved[name])
            main_value = entry.pop(MAIN_PARAM, None)
            for frag in frags:
                n = frag.hi - frag.lo
                piece = {k: v.reshape(-1)[frag.offset:frag.offset + n].clone()
                         if is_elementwise(v, param.numel()) else v for k, v in entry.items()}
                if frag.main.dtype != frag.param.dtype:
                    source = main_value if main_value is not None else param.detach().float()
                    with torch.no_grad():
                        frag.main.copy_(source.reshape(-1)[frag.offset:frag.offset + n])
                self._collected[id(frag.main)] = own_copy(piece)

    # ------------------------------------------------------------------ sharded checkpoints
    def state_ranges(self, params: dict[str, nn.Parameter]) -> dict[str, list[tuple[int, int]]]:
        return {name: [(f.offset, f.hi - f.lo) for f in self._by_param[id(param)]]
                for name, param in params.items() if self._by_param.get(id(param))}

    def state_fragments(self, params: dict[str, nn.Parameter]) -> dict[str, ParamFragments]:
        found = {}
        for name, param in params.items():
            frags = self._by_param.get(id(param))
            if not frags:
                continue
            entry = ParamFragments()
            for frag in frags:
                values = {}
                for key, value in self.optimizer.state.get(frag.main, {}).items():
                    if is_elementwise(value, frag.main.numel()):
                        values[key] = value.detach().reshape(-1)
                    else:
                        entry.scalars.setdefault(key, value)
                if frag.main.dtype != frag.param.dtype:
                    values[MAIN_PARAM] = frag.main.detach().reshape(-1)
                entry.ranges[frag.offset] = values
            found[name] = entry
        return found

    def gather_loaded_params(self) -> None:
        """After a load that read only this rank's fragments of the weights: 16-bit model
        shards from their main parameters, then every parameter all-gathered from its owners."""
        self._copy_main_params_to_model()
        self.finish_param_sync()

    def collect_state_fragments(self, params: dict[str, nn.Parameter],
                                saved: dict[str, ParamFragments]) -> None:
        for name, param in params.items():
            frags = self._by_param.get(id(param), [])
            if not frags:
                continue
            entry = saved.get(name)
            if entry is None:
                raise ParamStateError(f"no optimizer state for parameter {name}")
            for frag in frags:
                values = dict(entry.ranges.get(frag.offset, {}))
                main_value = values.pop(MAIN_PARAM, None)
                if frag.main.dtype != frag.param.dtype:
                    with torch.no_grad():
                        frag.main.copy_(main_value if main_value is not None
                                        else frag.model_view().float())
                self._collected[id(frag.main)] = own_copy({**entry.scalars, **values})
