"""Contiguous gradient (and parameter) storage for one stage replica, cut into buckets.

Megatron's ``ParamAndGradBuffer`` for this runtime. Each parameter's gradient accumulates in
``param.main_grad``, a view into one flat tensor: fp32 with ``--accumulate-allreduce-grads-in-fp32``
(always with ``--bf16``), else the parameter dtype. A post-accumulate-grad hook adds every
backward's ``param.grad`` into ``main_grad`` and frees it -- or, where the buffer has the
parameter's dtype, points ``.grad`` at ``main_grad``, so that autograd accumulates the next
micro-batches into the buffer in place -- so there is no second full copy of the gradients and
each micro-batch's gradient is summed in the buffer's precision.

Parameters are laid out in reverse registration order (the order backward finalises them) and cut
into buckets of about ``bucket_size`` elements; each bucket is reduced by one collective. With the
distributed optimizer every bucket is padded to a multiple of the shard count so that rank ``r``
of the reducing group owns the ``r``-th contiguous slice of every bucket, and the parameters move
into a parameter buffer of the same layout (the target of the all-gather after the step).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

# elements each shard of a padded bucket is rounded up to (aligned collectives on GPUs)
SHARD_ALIGNMENT = 64

GradReadyCallback = Callable[[nn.Parameter], None]


@dataclass(frozen=True)
class ShardGroup:
    """The ranks a stage (or the tied embedding) is sharded over: the process group (None: no
    communication, for accounting), its size, this rank's index in it, and the global ranks
    that write its checkpoint entries."""

    group: dist.ProcessGroup | None
    size: int
    rank: int
    writers: tuple[int, ...] = (0,)


@dataclass(frozen=True)
class Bucket:
    """Elements ``[start, end)`` of a buffer (padding included), reduced by one collective."""

    index: int
    start: int
    end: int
    param_indices: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Elements of the bucket, padding included."""
        return self.end - self.start

    def shard(self, shard_count: int, shard_rank: int) -> tuple[int, int]:
        """Buffer range ``[lo, hi)`` owned by ``shard_rank`` of ``shard_count`` ranks."""
        size = self.numel // shard_count
        lo = self.start + shard_rank * size
        return lo, lo + size


@dataclass(frozen=True)
class BufferLayout:
    """Where every parameter and bucket lies in a flat buffer: ``ranges[i]`` of parameter ``i``."""

    ranges: tuple[tuple[int, int], ...]
    buckets: tuple[Bucket, ...]
    numel: int
    shard_count: int

    def bucket_of(self, param_index: int) -> Bucket:
        """The bucket holding parameter ``param_index``."""
        for bucket in self.buckets:
            if param_index in bucket.param_indices:
                return bucket
        raise KeyError(param_index)

    def shard_numel(self) -> int:
        """Elements one shard rank owns over all buckets."""
        return sum(b.numel // self.shard_count for b in self.buckets)


def _padded(numel: int, shard_count: int) -> int:
    if shard_count == 1:
        return numel
    multiple = shard_count * SHARD_ALIGNMENT
    return -(-numel // multiple) * multiple


def plan_layout(numels: Iterable[int], bucket_size: int | None,
                shard_count: int = 1) -> BufferLayout:
    """Lay out parameters of ``numels`` (registration order) in reverse, in buckets of at least
    ``bucket_size`` elements (None: one bucket), each padded for ``shard_count`` shards."""
    numels = list(numels)
    if shard_count < 1:
        raise ValueError(f"shard count must be >= 1, got {shard_count}")
    ranges: dict[int, tuple[int, int]] = {}
    buckets: list[Bucket] = []
    offset, bucket_start, members = 0, 0, []

    def close_bucket() -> None:
        nonlocal offset, bucket_start, members
        end = bucket_start + _padded(offset - bucket_start, shard_count)
        buckets.append(Bucket(len(buckets), bucket_start, end, tuple(members)))
        offset = bucket_start = end
        members = []

    for index in reversed(range(len(numels))):
        ranges[index] = (offset, offset + numels[index])
        offset += numels[index]
        members.append(index)
        if bucket_size is not None and offset - bucket_start >= bucket_size:
            close_bucket()
    if members:
        close_bucket()
    return BufferLayout(tuple(ranges[i] for i in range(len(numels))), tuple(buckets), offset,
                        shard_count)


class GradBuffer:
    """Flat gradient storage of ``params`` (all of one dtype) with ``main_grad`` views.

    ``grad_dtype``: the accumulation and reduction dtype. ``shard_count`` > 1 pads buckets for
    the distributed optimizer and, with ``param_buffer``, moves the parameters into a flat
    buffer of the same layout (``param_data``).
    """

    def __init__(self, params: list[nn.Parameter], grad_dtype: torch.dtype,
                 bucket_size: int | None = None, shard_count: int = 1,
                 param_buffer: bool = False) -> None:
        if not params:
            raise ValueError("a gradient buffer needs at least one parameter")
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"one buffer holds parameters of one dtype, got {dtypes}")
        self.params = params
        self.param_dtype = params[0].dtype
        self.grad_dtype = grad_dtype
        self.layout = plan_layout([p.numel() for p in params], bucket_size, shard_count)
        device = params[0].device
        self.grad_data = torch.zeros(self.layout.numel, dtype=grad_dtype, device=device)
        self.param_data: torch.Tensor | None = None
        if param_buffer:
            self.param_data = torch.zeros(self.layout.numel, dtype=self.param_dtype,
                                          device=device)
        self._index = {id(p): i for i, p in enumerate(params)}
        for i, param in enumerate(params):
            lo, hi = self.layout.ranges[i]
            param.main_grad = self.grad_data[lo:hi].view_as(param)
            if self.param_data is not None:
                with torch.no_grad():
                    self.param_data[lo:hi].copy_(param.detach().reshape(-1))
                param.data = self.param_data[lo:hi].view_as(param)

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        """The buffer's buckets, in reduction order."""
        return self.layout.buckets

    def index_of(self, param: nn.Parameter) -> int:
        """Position of ``param`` in :attr:`params`."""
        return self._index[id(param)]

    def range_of(self, param: nn.Parameter) -> tuple[int, int]:
        """Buffer range ``[lo, hi)`` of ``param``."""
        return self.layout.ranges[self.index_of(param)]

    def bucket_grads(self, bucket: Bucket) -> torch.Tensor:
        """The gradient view of ``bucket`` (padding included)."""
        return self.grad_data[bucket.start:bucket.end]

    def zero_(self) -> None:
        """Zero every gradient (the start of an iteration)."""
        self.grad_data.zero_()


@dataclass
class ModelGradBuffers:
    """This rank's gradient buffers: one per stage and parameter dtype, and the tied embedding's.

    Every local copy of the tied word embedding (the first stage's input embedding and the last
    stage's output layer, when this rank holds both) shares one storage and one ``main_grad``, so
    their gradients are summed as they accumulate; that sum is reduced over the embedding group
    (and sharded over it with the distributed optimizer).
    """

    stages: dict[int, list[GradBuffer]]
    tied: GradBuffer | None
    tied_copies: list[nn.Parameter]
    tied_stages: set[int]
    _hooks: list = None  # type: ignore[assignment]
    _on_ready: GradReadyCallback | None = None
    # with expert parallelism: each stage's expert parameters (``param.is_expert``), reduced
    # over their own replica group (unit :func:`expert_unit`); empty otherwise
    experts: dict[int, list[GradBuffer]] = field(default_factory=dict)

    def all_buffers(self) -> list[GradBuffer]:
        """Stage buffers in descending stage order (each stage's expert buffers after its
        others), then the tied embedding's."""
        found = [b for s in sorted(self.stages, reverse=True)
                 for b in self.stages[s] + self.experts.get(s, [])]
        return found + ([self.tied] if self.tied is not None else [])

    def zero_(self) -> None:
        """Zero every gradient buffer."""
        for buffer in self.all_buffers():
            buffer.zero_()

    def set_ready_callback(self, callback: GradReadyCallback | None) -> None:
        """Called with each parameter right after its gradient was added to ``main_grad``."""
        self._on_ready = callback

    def _accumulate(self, param: nn.Parameter) -> None:
        """The post-accumulate-grad hook: ``param.grad`` into ``main_grad``. A parameter whose
        buffer has its dtype keeps ``.grad`` pointing at ``main_grad`` after the first add, so
        that autograd adds the next micro-batches' gradients into the buffer itself, in place
        (in C++, as for a plain eager model: no Python add per parameter per micro-batch);
        16-bit parameters with fp32 buffers drop ``.grad`` each time, and so does a weight whose
        gradient was fused into ``main_grad`` (its ``.grad`` is the placeholder)."""
        # (cheap in the common case: this runs for every parameter of every micro-batch)
        grad = param.grad
        if grad is None:
            return
        main_grad = param.main_grad
        if param.grad_added_to_main_grad:  # gradient-accumulation fusion
            param.grad_added_to_main_grad = False
            param.grad = None
        elif grad is not main_grad and grad.data_ptr() != main_grad.data_ptr():
            # (else autograd added into the buffer in place)
            main_grad.add_(grad)
            # (a fused weight never gets here: its gradient arrives as the placeholder)
            param.grad = main_grad if main_grad.dtype == grad.dtype else None
        on_ready = self._on_ready
        if on_ready is not None:
            on_ready(param)

    def register_hooks(self) -> None:
        """Route every backward's gradient into ``main_grad`` (once per parameter)."""
        if self._hooks is not None:
            return
        self._hooks = []
        seen: set[int] = set()
        for buffer in self.all_buffers():
            params = self.tied_copies if buffer is self.tied else buffer.params
            for param in params:
                if id(param) not in seen:
                    seen.add(id(param))
                    # (the hook reads these as plain attributes: no getattr default per call)
                    param.grad_added_to_main_grad = getattr(param, "grad_added_to_main_grad",
                                                            False)
                    self._hooks.append(param.register_post_accumulate_grad_hook(self._accumulate))

    def remove_hooks(self) -> None:
        """Undo :meth:`register_hooks`."""
        for handle in self._hooks or []:
            handle.remove()
        self._hooks = None


def shared_embedding_weight(module: nn.Module) -> nn.Parameter | None:
    """``module.shared_embedding_or_output_weight()`` when the module has it, else None."""
    getter = getattr(module, "shared_embedding_or_output_weight", None)
    return getter() if callable(getter) else None


def local_shared_copies(stage_modules: dict[int, nn.Module]) -> list[nn.Parameter]:
    """Distinct tied-embedding parameters held on this rank, by stage."""
    copies: list[nn.Parameter] = []
    for stage in sorted(stage_modules):
        weight = shared_embedding_weight(stage_modules[stage])
        if weight is not None and all(weight is not c for c in copies):
            copies.append(weight)
    return copies


def grad_dtype_for(param_dtype: torch.dtype, grad_reduce_in_fp32: bool) -> torch.dtype:
    """fp32 when asked (or for fp32 parameters), else the parameter dtype."""
    return torch.float32 if grad_reduce_in_fp32 else param_dtype


TIED = "tied"  # key of the tied embedding in ``shard_counts`` (its embedding-group size)


def expert_unit(stage: int) -> str:
    """Key of ``stage``'s expert parameters in ``shard_counts`` and the distributed optimizer's
    units (with expert parallelism, where they have their own replica group)."""
    return f"experts {stage}"


def is_expert(param: nn.Parameter) -> bool:
    """Whether ``param`` belongs to an MoE layer's experts (``param.is_expert``)."""
    return getattr(param, "is_expert", False)


def build_grad_buffers(stage_modules: dict[int, nn.Module], grad_reduce_in_fp32: bool,
                       bucket_sizes: dict[int, int | None] | None = None,
                       shard_counts: dict[int | str, int] | None = None,
                       param_buffers: bool = False,
                       fuse_wgrad_accumulation: bool = False,
                       split_experts: bool = False) -> ModelGradBuffers:
    """Buffers for every stage module of this rank, one for the tied embedding, and hooks.

    ``bucket_sizes[stage]``: elements per bucket (default None: one bucket per buffer).
    ``shard_counts[stage]``: ranks the stage is sharded over (distributed optimizer; default 1),
    ``shard_counts[TIED]`` those the tied embedding is sharded over.
    ``param_buffers``: move sharded parameters into flat buffers (the all-gather target).
    ``fuse_wgrad_accumulation``: mark the stage buffers' parameters so that the deferrable
    linears compute their weight gradients straight into ``main_grad`` (gradient-accumulation
    fusion, see ``tensor_parallel.weight_grad``); never the tied embedding, whose copies take
    gradients from two uses in one backward.
    ``split_experts`` (expert parallelism): each stage's expert parameters get buffers of their
    own (``ModelGradBuffers.experts``), sharded over ``shard_counts[expert_unit(stage)]``.
    """
    shard_counts = shard_counts or {}
    bucket_sizes = bucket_sizes or {}
    copies = local_shared_copies(stage_modules)
    tied_ids = {id(c) for c in copies}
    stages: dict[int, list[GradBuffer]] = {}
    experts: dict[int, list[GradBuffer]] = {}
    for stage, module in stage_modules.items():
        size = bucket_sizes.get(stage)
        by_kind: dict[tuple[bool, torch.dtype], list[nn.Parameter]] = {}
        for param in module.parameters():
            if param.requires_grad and id(param) not in tied_ids:
                kind = (split_experts and is_expert(param), param.dtype)
                by_kind.setdefault(kind, []).append(param)
        for (expert, dtype), params in by_kind.items():
            shards = shard_counts.get(expert_unit(stage) if expert else stage, 1)
            buffer = GradBuffer(params, grad_dtype_for(dtype, grad_reduce_in_fp32), size,
                                shards, param_buffers and shards > 1)
            (experts if expert else stages).setdefault(stage, []).append(buffer)
        stages.setdefault(stage, [])
    tied = None
    if copies:
        shards = shard_counts.get(TIED, 1)
        tied = GradBuffer([copies[0]], grad_dtype_for(copies[0].dtype, grad_reduce_in_fp32),
                          None, shards, param_buffers and shards > 1)
        for copy in copies[1:]:  # identical values: one gradient and one storage for all
            copy.main_grad = copies[0].main_grad
            copy.data = copies[0].data
    for buffer in (b for per_stage in stages.values() for b in per_stage):
        for param in buffer.params:
            param.fuse_wgrad_accumulation = fuse_wgrad_accumulation
    tied_stages = {s for s, m in stage_modules.items() if shared_embedding_weight(m) is not None}
    buffers = ModelGradBuffers(stages, tied, copies, tied_stages, experts=experts)
    buffers.register_hooks()
    return buffers
