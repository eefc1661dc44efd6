"""Gradient synchronisation between the replicas of every stage, and replica-identity utilities.

Every rank holding stage ``s`` (all pipes, all data-parallel replicas) belongs to the
stage-replica group of ``s``. After this rank's last backward (or last W with split backward) of
a stage, :class:`GradientSynchronizer` starts an asynchronous SUM all-reduce of the stage's
gradients, flattened into one bucket per dtype. The all-reduces are issued in one global order,
descending stage id (a stage is issued only after every higher stage this rank holds), so two
groups over the same ranks can never be entered in different orders.

The tied word embedding (``shared_embedding_or_output_weight()``) is left out of the stage
buckets: each rank sums the gradients of the copies it holds, all-reduces the sum over the
embedding group (issued after all stage all-reduces) and writes the total into every copy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from megatron_chimera import parallel_state

SharedWeightGetter = Callable[[nn.Module], "nn.Parameter | None"]


def shared_embedding_weight(module: nn.Module) -> nn.Parameter | None:
    """``module.shared_embedding_or_output_weight()`` when the module has it, else None."""
    getter = getattr(module, "shared_embedding_or_output_weight", None)
    return getter() if callable(getter) else None


def _group_size(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_world_size(group)


def _stage_params(module: nn.Module, shared: nn.Parameter | None) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad and p is not shared]


def _grads_or_zeros(params: Iterable[nn.Parameter]) -> list[torch.Tensor]:
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]


def _buckets(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    return list(by_dtype.values())


def _write_grads(params: list[nn.Parameter], flat: torch.Tensor) -> None:
    offset = 0
    for p in params:
        view = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
        if p.grad is None:
            p.grad = view.clone()
        else:
            p.grad.copy_(view)


class GradientSynchronizer:
    """Eager, globally ordered stage-replica all-reduce plus the tied-embedding reduction."""

    def __init__(
        self,
        stage_modules: dict[int, nn.Module],
        stage_groups: dict[int, dist.ProcessGroup | None],
        embedding_group: dist.ProcessGroup | None,
        shared_weight: SharedWeightGetter = shared_embedding_weight,
    ) -> None:
        self.stage_modules = stage_modules
        self.stage_groups = stage_groups
        self.embedding_group = embedding_group
        self.shared_weight = shared_weight
        self._order = sorted(stage_modules, reverse=True)
        self._done: set[int] = set()
        self._issued: list[tuple[list[nn.Parameter], torch.Tensor, dist.Work | None]] = []
        self._next = 0

    @classmethod
    def from_parallel_state(cls, stage_modules: dict[int, nn.Module]) -> GradientSynchronizer:
        """Synchronizer over the groups of :mod:`megatron_chimera.parallel_state`."""
        groups = {s: parallel_state.get_stage_replica_group(s) for s in stage_modules}
        return cls(stage_modules, groups, parallel_state.get_embedding_group())

    def start_iteration(self) -> None:
        """Forget the previous iteration's progress (gradients are zeroed by the optimizer)."""
        self._done.clear()
        self._issued.clear()
        self._next = 0

    def stage_done(self, stage: int) -> None:
        """This rank finished every backward of ``stage``: issue what the global order allows."""
        self._done.add(stage)
        while self._next < len(self._order) and self._order[self._next] in self._done:
            self._issue(self._order[self._next])
            self._next += 1

    def _issue(self, stage: int) -> None:
        module = self.stage_modules[stage]
        group = self.stage_groups.get(stage)
        params = _stage_params(module, self.shared_weight(module))
        for bucket in _buckets(params):
            flat = torch.cat([g.reshape(-1) for g in _grads_or_zeros(bucket)])
            work = None
            if _group_size(group) > 1:
                work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True)
            self._issued.append((bucket, flat, work))

    def finish(self) -> None:
        """Issue what is left, reduce the tied embedding, wait for everything, write grads back."""
        for stage in self._order[self._next:]:
            self._issue(stage)
        self._next = len(self._order)
        self._reduce_embedding()
        for bucket, flat, work in self._issued:
            if work is not None:
                work.wait()
            _write_grads(bucket, flat)
        self._issued.clear()

    def _reduce_embedding(self) -> None:
        copies = _local_shared_copies(self.stage_modules, self.shared_weight)
        if not copies:
            return
        grads = _grads_or_zeros(copies)
        total = grads[0].clone()
        for grad in grads[1:]:
            total.add_(grad)
        if _group_size(self.embedding_group) > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.embedding_group)
        for copy in copies:
            copy.grad = total.clone()


def _local_shared_copies(
    stage_modules: dict[int, nn.Module], shared_weight: SharedWeightGetter
) -> list[nn.Parameter]:
    """Distinct tied-embedding parameters held on this rank, by stage."""
    copies: list[nn.Parameter] = []
    for stage in sorted(stage_modules):
        weight = shared_weight(stage_modules[stage])
        if weight is not None and all(weight is not c for c in copies):
            copies.append(weight)
    return copies


def _flat_params(params: list[nn.Parameter]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params]) if params else torch.zeros(0)


@torch.no_grad()
def broadcast_stage_params(
    stage_modules: dict[int, nn.Module], shared_weight: SharedWeightGetter = shared_embedding_weight
) -> None:
    """Make all replicas identical: broadcast every stage from the lowest rank of its replica
    group (descending stage order), then the tied embedding over the embedding group."""
    for stage in sorted(stage_modules, reverse=True):
        group = parallel_state.get_stage_replica_group(stage)
        src = min(parallel_state.get_stage_replica_ranks(stage))
        params = [p for p in stage_modules[stage].parameters()]
        flat = _flat_params(params)
        if _group_size(group) > 1:
            dist.broadcast(flat, src=src, group=group)
        _copy_into(params, flat)
    copies = _local_shared_copies(stage_modules, shared_weight)
    group = parallel_state.get_embedding_group()
    if copies:
        value = copies[0].detach().clone()
        if _group_size(group) > 1:
            dist.broadcast(value, src=min(parallel_state.get_embedding_ranks()), group=group)
        for copy in copies:
            copy.copy_(value)


def _copy_into(params: list[nn.Parameter], flat: torch.Tensor) -> None:
    offset = 0
    for p in params:
        p.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


@torch.no_grad()
def assert_replicas_identical(
    stage_modules: dict[int, nn.Module], shared_weight: SharedWeightGetter = shared_embedding_weight
) -> None:
    """Raise AssertionError unless every replica of every stage, and every tied-embedding copy,
    is bitwise identical across ranks (a collective over the stage-replica and embedding groups)."""
    for stage in sorted(stage_modules, reverse=True):
        group = parallel_state.get_stage_replica_group(stage)
        flat = _flat_params(list(stage_modules[stage].parameters()))
        _assert_same_everywhere(flat, group, f"stage {stage}",
                                parallel_state.get_stage_replica_ranks(stage))
    copies = _local_shared_copies(stage_modules, shared_weight)
    if copies:
        for copy in copies[1:]:
            if not torch.equal(copy, copies[0]):
                raise AssertionError(
                    f"rank {dist.get_rank()}: local tied-embedding copies differ"
                )
        _assert_same_everywhere(copies[0].detach().reshape(-1),
                                parallel_state.get_embedding_group(), "tied embedding",
                                parallel_state.get_embedding_ranks())


def _assert_same_everywhere(
    flat: torch.Tensor, group: dist.ProcessGroup | None, what: str, ranks: list[int]
) -> None:
    if _group_size(group) <= 1:
        return
    gathered = [torch.empty_like(flat) for _ in ranks]
    dist.all_gather(gathered, flat.contiguous(), group=group)
    differing = [r for r, t in zip(ranks, gathered) if not torch.equal(t, gathered[0])]
    if differing:
        raise AssertionError(
            f"{what}: replicas on ranks {differing} differ bitwise from rank {ranks[0]}"
        )
