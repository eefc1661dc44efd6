"""Gradient synchronisation between the replicas of every stage, and replica-identity utilities.

Every rank holding stage ``s`` (all pipes, all data-parallel replicas) belongs to the
stage-replica group of ``s``. Gradients accumulate in contiguous buffers
(:mod:`megatron_chimera.distributed.grad_buffer`) cut into buckets; :class:`GradientSynchronizer`
reduces each bucket with one asynchronous collective: a SUM all-reduce, or with the distributed
optimizer a SUM reduce-scatter that leaves each rank its own shard.

A bucket is ready once its gradients are final: with ``overlap_grad_reduce``, as soon as every
parameter of the bucket received its gradient in the stage's last backward on this rank (the
executor announces that action); otherwise when that action is over and its sends are posted
(the executor reports it before the next action). Where collectives are issued is part of the
schedule validator's device-sync check (``schedules.device_sync_check``): a stage whose collective
could, issued that early, make a device-wide sync wait on another rank's later work is deferred
to the end of the iteration (the schedule's collective plan, passed to
:meth:`~GradientSynchronizer.start_iteration`). Buckets are issued in one global order --
descending stage id, then bucket order, the tied embedding last, the deferred collectives after
all the others -- and a bucket is issued only when every bucket before it in that order has
been, so two groups over the same ranks can never be entered in different orders (Chimera's
eager, descending-stage reduction). A deferred stage holds back only itself: the collectives
after it in the order go on as they are ready.

The tied word embedding (``shared_embedding_or_output_weight()``) is left out of the stage
buckets: every local copy shares one gradient buffer, which is reduced (all-reduce, or
reduce-scatter with the distributed optimizer) over the embedding group once every stage holding
a copy is done.

With tensor parallelism every group above joins ranks of one tensor rank (each reduces that
tensor rank's shards), and the gradients of sequence-parallel parameters -- partial on each
tensor rank -- are first summed over the tensor-parallel group, bucket by bucket, right before
the bucket's collective is started
(:func:`~megatron_chimera.tensor_parallel.allreduce_sequence_parallel_grads`, the only place the
runtime calls it). The T ranks of a tensor-parallel group run the same list with the same buffer
layout, so they reach every bucket at the same point, in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from megatron_chimera import parallel_state
from megatron_chimera.distributed.grad_buffer import (
    Bucket,
    GradBuffer,
    ModelGradBuffers,
    is_expert,
    local_shared_copies,
    shared_embedding_weight,
)
from megatron_chimera.tensor_parallel.collectives import reduce_scatter_single
from megatron_chimera.tensor_parallel.grads import (
    allreduce_sequence_parallel_grads,
    is_sequence_parallel,
)

__all__ = ["Collectives", "GradientSynchronizer", "broadcast_stage_params",
           "assert_replicas_identical",
           "shared_embedding_weight"]


def _group_size(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_world_size(group)


class Collectives:
    """How a bucket's collective is started: torch.distributed's asynchronous calls (a
    benchmark substitutes emulated link costs, :class:`~.emulated.EmulatedCollectives`)."""

    def all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> dist.Work:
        """SUM all-reduce of ``tensor`` in place."""
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor,
                       group: dist.ProcessGroup) -> dist.Work:
        """SUM reduce-scatter of ``tensor`` into this rank's ``output`` slice."""
        return reduce_scatter_single(output, tensor, group=group, async_op=True)


# told of every collective the synchronizer issues: (group, label); the NCCL-semantics test
# transport uses it to make a device-wide sync wait for the group (pipeline/nccl_semantics.py)
CollectiveWatcher = Callable[[dist.ProcessGroup, str], None]


@dataclass
class _Item:
    """One collective of the global order: a bucket of a stage buffer, or the tied embedding."""

    stage: int | None  # None: the tied embedding
    buffer: GradBuffer
    bucket: Bucket
    group: dist.ProcessGroup | None
    scatter: bool
    # sequence-parallel parameters of the bucket and the tensor-parallel group they are summed
    # over before the bucket's reduction
    sequence_parallel: list[nn.Parameter] = field(default_factory=list)
    tensor_group: dist.ProcessGroup | None = None
    waiting: set[int] = field(default_factory=set)  # parameter indices not final yet
    ready: bool = False
    work: dist.Work | None = None

    @property
    def name(self) -> str:
        """The collective's name in the schedule's plan: ``stage s`` or ``embedding``."""
        return "embedding" if self.stage is None else f"stage {self.stage}"

    def issue(self, collectives: Collectives, watcher: CollectiveWatcher | None = None) -> None:
        """Sum the bucket's sequence-parallel gradients over the tensor-parallel group, then
        start its collective (nothing to do on a group of one) and tell ``watcher``."""
        allreduce_sequence_parallel_grads(self.sequence_parallel, self.tensor_group)
        if _group_size(self.group) <= 1:
            return
        grads = self.buffer.bucket_grads(self.bucket)
        if self.scatter:
            rank = dist.get_rank(self.group)
            lo, hi = self.bucket.shard(dist.get_world_size(self.group), rank)
            self.work = collectives.reduce_scatter(self.buffer.grad_data[lo:hi], grads,
                                                   self.group)
        else:
            self.work = collectives.all_reduce(grads, self.group)
        if watcher is not None:
            watcher(self.group, f"reduction of {self.name} bucket {self.bucket.start}")


class GradientSynchronizer:
    """Eager, globally ordered bucket reduction over the stage-replica and embedding groups.

    ``stage_groups[s]``: the stage-replica group of stage ``s``; ``scatter``: reduce-scatter the
    buckets (distributed optimizer) instead of all-reducing them; ``collectives`` starts them;
    ``tensor_group``: the tensor-parallel group the sequence-parallel gradients are summed over;
    ``expert_groups[s]``: the group of stage ``s``'s expert buffers (expert parallelism: the
    holders of the same experts), reduced right after the stage's other buckets.
    """

    def __init__(self, buffers: ModelGradBuffers, stage_groups: dict[int, dist.ProcessGroup | None],
                 embedding_group: dist.ProcessGroup | None, overlap_grad_reduce: bool = False,
                 scatter: bool = False, collectives: Collectives | None = None,
                 tensor_group: dist.ProcessGroup | None = None,
                 expert_groups: dict[int, dist.ProcessGroup | None] | None = None) -> None:
        self.buffers = buffers
        self.overlap_grad_reduce = overlap_grad_reduce
        self.collectives = collectives or Collectives()
        self._items: list[_Item] = []
        self._item_of: dict[int, tuple[_Item, int]] = {}  # id(param) -> (item, param index)
        expert_groups = expert_groups or {}
        for stage in sorted(buffers.stages, reverse=True):
            in_order = [(b, stage_groups.get(stage)) for b in buffers.stages[stage]]
            in_order += [(b, expert_groups.get(stage)) for b in buffers.experts.get(stage, [])]
            for buffer, group in in_order:
                for bucket in buffer.buckets:
                    item = _Item(stage, buffer, bucket, group, scatter,
                                 _sequence_parallel(buffer, bucket), tensor_group)
                    self._items.append(item)
                    for index in bucket.param_indices:
                        self._item_of[id(buffer.params[index])] = (item, index)
        self._tied: _Item | None = None
        if buffers.tied is not None:
            bucket = buffers.tied.buckets[0]
            self._tied = _Item(None, buffers.tied, bucket, embedding_group, scatter,
                               _sequence_parallel(buffers.tied, bucket), tensor_group)
            self._items.append(self._tied)
        # the embedding's reduction follows every final backward of the rank (the plan's
        # model, schedules.device_sync_check.gradient_collectives), not only those of the
        # stages with a copy
        self._stages = set(buffers.stages)  # (every stage of the rank, with a copy or not)
        self._final: set[int] = set()
        self._done: set[int] = set()
        self._next = 0
        self._deferred: frozenset[str] = frozenset()
        self._watcher: CollectiveWatcher | None = None
        buffers.set_ready_callback(self._grad_ready if overlap_grad_reduce else None)

    @classmethod
    def from_parallel_state(cls, buffers: ModelGradBuffers, overlap_grad_reduce: bool = False,
                            scatter: bool = False,
                            collectives: Collectives | None = None) -> GradientSynchronizer:
        """Synchronizer over the groups of :mod:`megatron_chimera.parallel_state`."""
        groups = {s: parallel_state.get_stage_replica_group(s) for s in buffers.stages}
        experts = {s: parallel_state.get_expert_stage_replica_group(s) for s in buffers.experts}
        return cls(buffers, groups, parallel_state.get_embedding_group(), overlap_grad_reduce,
                   scatter, collectives, parallel_state.get_tensor_model_parallel_group(),
                   experts)

    @property
    def num_collectives(self) -> int:
        """Collectives per iteration (buckets plus the tied embedding)."""
        return len(self._items)

    def start_iteration(self, watcher: CollectiveWatcher | None = None,
                        deferred: frozenset[str] = frozenset()) -> None:
        """Forget the previous iteration's progress (the buffers are zeroed by the optimizer);
        ``watcher`` hears of every collective this iteration issues. ``deferred`` (``stage s``,
        ``embedding``: the schedule's :class:`~megatron_chimera.schedules.device_sync_check.
        CollectivePlan`) are issued only by :meth:`finish` -- issued as soon as ready, a
        device-wide sync could wait for them while their group needs this rank's later work --
        after every other collective of the iteration, in the global order (every rank of a
        group places them alike, so the order stays one for all)."""
        self._watcher = watcher
        self._final.clear()
        self._done.clear()
        self._next = 0
        self._deferred = deferred
        for item in self._items:
            item.ready, item.work = False, None
            item.waiting = set(item.bucket.param_indices) if item is not self._tied else set()

    def final_action_begins(self, stage: int) -> None:
        """This rank starts the last backward (or W) of ``stage``: its gradients become final
        as they arrive."""
        self._final.add(stage)

    def _grad_ready(self, param: nn.Parameter) -> None:
        entry = self._item_of.get(id(param))
        if entry is None:
            return
        item, index = entry
        if item.stage not in self._final or item.ready:
            return
        item.waiting.discard(index)
        if not item.waiting:
            item.ready = True
            self._issue_ready(between_actions=False)

    def stage_done(self, stage: int) -> None:
        """This rank finished every backward of ``stage``: its buckets are ready."""
        self._final.discard(stage)
        self._done.add(stage)
        for item in self._items:
            if item.stage == stage:
                item.ready = True
        if self._tied is not None and self._stages <= self._done:
            self._tied.ready = True
        self._issue_ready()

    def _issue_ready(self, between_actions: bool = True) -> None:
        """Issue the ready items in the global order. The tied embedding's only between two
        actions: issued from inside a stage's last backward (after that stage's last bucket),
        a device-wide sync later in the same action would wait for the embedding group's other
        end, which may need this action's output (the schedule validator's collective check
        finds this on the interleaved schedule)."""
        while self._next < len(self._items):
            item = self._items[self._next]
            if item.name in self._deferred:  # finish issues it, after every other one
                self._next += 1
                continue
            if not item.ready or (item is self._tied and not between_actions):
                return
            item.issue(self.collectives, self._watcher)
            self._next += 1

    def finish(self) -> None:
        """Issue what is left in the global order (the deferred collectives last) and wait for
        every collective."""
        left = [item for item in self._items[self._next:] if item.name not in self._deferred]
        for item in left + [item for item in self._items if item.name in self._deferred]:
            item.issue(self.collectives, self._watcher)
        self._next = len(self._items)
        for item in self._items:
            if item.work is not None:
                item.work.wait()
                item.work = None


def _sequence_parallel(buffer: GradBuffer, bucket: Bucket) -> list[nn.Parameter]:
    """The sequence-parallel parameters of ``bucket``, in buffer order."""
    return [buffer.params[i] for i in sorted(bucket.param_indices,
                                             key=lambda i: buffer.layout.ranges[i][0])
            if is_sequence_parallel(buffer.params[i])]


def _flat_params(params: list[nn.Parameter]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params]) if params else torch.zeros(0)


@torch.no_grad()
def broadcast_stage_params(stage_modules: dict[int, nn.Module]) -> None:
    """Make all replicas identical: broadcast every stage from the lowest rank of its replica
    group (descending stage order), then the tied embedding over the embedding group."""
    for stage in sorted(stage_modules, reverse=True):
        for params, group, ranks in _replica_sets(stage, stage_modules[stage]):
            flat = _flat_params(params)
            if _group_size(group) > 1:
                dist.broadcast(flat, src=min(ranks), group=group)
            _copy_into(params, flat)
    copies = local_shared_copies(stage_modules)
    group = parallel_state.get_embedding_group()
    if copies:
        value = copies[0].detach().clone()
        if _group_size(group) > 1:
            dist.broadcast(value, src=min(parallel_state.get_embedding_ranks()), group=group)
        for copy in copies:
            copy.copy_(value)


def _replica_sets(stage: int, module: nn.Module
                  ) -> list[tuple[list[nn.Parameter], dist.ProcessGroup | None, list[int]]]:
    """A stage's parameters by the group whose ranks hold identical copies: the stage-replica
    group, and with expert parallelism the experts' own group."""
    params = list(module.parameters())
    if not parallel_state.has_expert_groups():
        return [(params, parallel_state.get_stage_replica_group(stage),
                 parallel_state.get_stage_replica_ranks(stage))]
    return [([p for p in params if not is_expert(p)],
             parallel_state.get_stage_replica_group(stage),
             parallel_state.get_stage_replica_ranks(stage)),
            ([p for p in params if is_expert(p)],
             parallel_state.get_expert_stage_replica_group(stage),
             parallel_state.get_expert_stage_replica_ranks(stage))]


def _copy_into(params: list[nn.Parameter], flat: torch.Tensor) -> None:
    offset = 0
    for p in params:
        p.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


@torch.no_grad()
def assert_replicas_identical(stage_modules: dict[int, nn.Module]) -> None:
    """Raise AssertionError unless every replica of every stage, and every tied-embedding copy,
    is bitwise identical across ranks (a collective over the stage-replica and embedding groups)."""
    for stage in sorted(stage_modules, reverse=True):
        for params, group, ranks in _replica_sets(stage, stage_modules[stage]):
            _assert_same_everywhere(_flat_params(params), group, f"stage {stage}", ranks)
    copies = local_shared_copies(stage_modules)
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
