"""Process groups and rank arithmetic for T-way tensor x W-way data x D-way pipeline parallelism.

The library's module-level state (as Megatron's; the only other is the RNG tracker in
``tensor_parallel.random``): ``initialize_model_parallel`` creates every group, in the same order
on every rank; ``destroy_model_parallel`` frees them.

Rank layout (Megatron's): ``global rank = (pipeline_rank * W + data_parallel_rank) * T +
tensor_rank`` -- tensor-parallel ranks innermost (one node holds a tensor-parallel group), then
data-parallel replicas, then pipeline ranks. With context parallelism (CP > 1) the context ranks
sit between tensor and data-parallel ranks (``layout.ParallelLayout``); each context rank has
its own pipeline, tensor and model-parallel groups, the context group joins the CP ranks of one
sequence, and stage-replica and embedding groups span every context rank.

Example: T=2, W=1, D=4, Chimera with 2 pipes (down pipe 0: stage s on pipeline rank s; up pipe
1: stage s on pipeline rank D-1-s)::

    global rank      0  1 | 2  3 | 4  5 | 6  7
    pipeline rank    0  0 | 1  1 | 2  2 | 3  3
    tensor rank      0  1 | 0  1 | 0  1 | 0  1
    down-pipe stage  0  0 | 1  1 | 2  2 | 3  3
    up-pipe stage    3  3 | 2  2 | 1  1 | 0  0

    tensor groups (one per pipeline rank and data-parallel rank):  [0 1] [2 3] [4 5] [6 7]
    pipeline groups (one per data-parallel rank and tensor rank):  [0 2 4 6] [1 3 5 7]
    stage-replica groups (one per stage and tensor rank):
        stages 0 and 3: [0 6] [1 7]    stages 1 and 2: [2 4] [3 5]
    embedding groups (holders of stage 0 or 3, one per tensor rank): [0 6] [1 7]
    model-parallel group (tensor x pipeline, one per data-parallel rank): [0 1 2 3 4 5 6 7]
    p2p: only between equal tensor ranks (0 <-> 2, 1 <-> 3, ...)

With T=1 and W=2 the same Chimera D=4 is::

    global rank      0  1 | 2  3 | 4  5 | 6  7
    pipeline rank    0  0 | 1  1 | 2  2 | 3  3
    data-par. rank   0  1 | 0  1 | 0  1 | 0  1

    pipeline groups (one per data-parallel rank):  [0 2 4 6] [1 3 5 7]
    data-parallel groups (one per pipeline rank):  [0 1] [2 3] [4 5] [6 7]
    stage-replica groups: stage 0 [0 1 6 7]  stage 1 [2 3 4 5]  stage 2 [2 3 4 5]  stage 3 [0 1 6 7]
    embedding group (holders of stage 0 or 3):     [0 1 6 7]

and with expert parallelism EP=2 (``expert_model_parallel_size``, folded out of each pipeline
rank's T x W ranks, see ``layout``)::

    expert-parallel groups (one per pipeline rank): [0 1] [2 3] [4 5] [6 7]
    expert stage-replica groups: stage 0 [0 6] (expert rank 0) [1 7] (expert rank 1), ...

A rank holds the tensor-parallel shard ``tensor_rank`` of its stages; every group but the tensor
and model-parallel groups joins equal tensor ranks only. Gradients are all-reduced over the
stage-replica groups (all 2f x W holders of a stage's shard); found-inf and the gradient norm over
the *model-parallel group* (tensor x pipeline ranks of one data-parallel replica), counting each
stage once, on its owner (``is_stage_owner``: pipe 0), each tensor-parallel duplicate once (tensor
rank 0) and the tied word embedding with stage 0. Pure rank arithmetic lives in ``layout``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from megatron_chimera.layout import (
    ParallelLayout,
    hierarchical_groups,
    neighbour_directions,
    validate_placement,
)

NCCL_SEMANTICS_ENV = "MEGATRON_CHIMERA_NCCL_SEMANTICS"


def nccl_semantics_requested() -> bool:
    """Whether the test harness runs gloo under NCCL's rules (``MEGATRON_CHIMERA_NCCL_SEMANTICS=1``,
    see :mod:`megatron_chimera.pipeline.nccl_semantics`): groups are then laid out as for NCCL."""
    return os.environ.get(NCCL_SEMANTICS_ENV, "0") == "1"


@dataclass
class _ModelParallelState:
    """Everything ``initialize_model_parallel`` computes for this rank."""

    layout: ParallelLayout
    num_stages: int
    placement: list[list[int]]
    rank: int
    pipeline_rank: int
    data_parallel_rank: int
    tensor_rank: int
    context_rank: int = 0
    pipeline_group: dist.ProcessGroup | None = None
    pipeline_ranks: list[int] = field(default_factory=list)
    data_parallel_group: dist.ProcessGroup | None = None
    data_parallel_ranks: list[int] = field(default_factory=list)
    tensor_group: dist.ProcessGroup | None = None
    tensor_ranks: list[int] = field(default_factory=list)
    context_group: dist.ProcessGroup | None = None
    context_ranks: list[int] = field(default_factory=list)
    # --hierarchical-context-parallel-sizes (a2a+p2p): this rank's inner and outer groups
    hierarchical_context: HierarchicalGroups | None = None
    model_parallel_group: dist.ProcessGroup | None = None
    model_parallel_ranks: list[int] = field(default_factory=list)
    stage_replica_groups: dict[int, dist.ProcessGroup] = field(default_factory=dict)
    stage_replica_ranks: dict[int, list[int]] = field(default_factory=dict)
    embedding_group: dist.ProcessGroup | None = None
    embedding_ranks: list[int] = field(default_factory=list)
    p2p_groups: dict[tuple[int, int], dist.ProcessGroup] = field(default_factory=dict)
    expert_rank: int = 0
    expert_data_rank: int = 0
    expert_group: dist.ProcessGroup | None = None
    expert_ranks: list[int] = field(default_factory=list)
    expert_stage_replica_groups: dict[int, dist.ProcessGroup] = field(default_factory=dict)
    expert_stage_replica_ranks: dict[int, list[int]] = field(default_factory=dict)
    # the experts have their own groups (expert stage-replica groups differ from the dense ones)
    has_expert_groups: bool = False
    all_groups: list[dist.ProcessGroup] = field(default_factory=list)
    collective_groups: list[dist.ProcessGroup] = field(default_factory=list)

    def to_global(self, pipeline_rank: int, data_parallel_rank: int | None = None,
                  tensor_rank: int | None = None) -> int:
        """Global rank of a pipeline rank (default: this rank's data-parallel and tensor rank)."""
        dp = self.data_parallel_rank if data_parallel_rank is None else data_parallel_rank
        t = self.tensor_rank if tensor_rank is None else tensor_rank
        return self.layout.global_rank(pipeline_rank, dp, t, self.context_rank)


_STATE: _ModelParallelState | None = None


class HierarchicalGroups(NamedTuple):
    """This rank's inner (all-to-all, ``A`` adjacent context ranks) and outer (ring, ``B``
    ranks) groups of ``--hierarchical-context-parallel-sizes A B``; None for a group of one."""

    inner: dist.ProcessGroup | None
    outer: dist.ProcessGroup | None
    inner_size: int
    outer_size: int


def _state() -> _ModelParallelState:
    if _STATE is None:
        raise RuntimeError("model parallel groups are not initialized; call "
                           "initialize_model_parallel")
    return _STATE


def initialize_model_parallel(
    pipeline_model_parallel_size: int,
    placement: list[list[int]],
    num_stages: int,
    tensor_model_parallel_size: int = 1,
    timeout: timedelta | None = None,
    p2p_direction_groups: bool | None = None,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_groups: bool | None = None,
    hierarchical_context_parallel_sizes: tuple[int, int] | None = None,
) -> None:
    """Create tensor, pipeline, data-parallel, model-parallel, stage-replica and embedding groups
    (same order everywhere). A rank set that appears twice (Chimera's stages s and D-1-s,
    1F1B's stage-replica and data-parallel groups, the model-parallel and pipeline groups at
    T=1) gets one group; the two directions between pipe neighbours are the one exception.

    ``context_parallel_size`` (CP) ranks share each sequence (Megatron's rank order: tensor,
    context, data, pipeline); each has its own pipeline, and the stage-replica and embedding
    groups span every context rank (gradients are reduced over data x context ranks).
    ``hierarchical_context_parallel_sizes`` ``(A, B)`` (``--cp-comm-type a2a+p2p``) splits each
    context group into inner groups of A adjacent context ranks and outer groups of B ranks
    (``model/context_parallel/hierarchical.py``).

    ``placement[pipe][stage]`` is the pipeline rank holding that stage replica
    (``Schedule.placement``). ``p2p_direction_groups`` (default: on with NCCL and in the
    NCCL-semantics test mode) adds a 2-rank group per direction between pipe neighbours: the two
    directions run on separate NCCL communicators and streams, never behind each other.
    ``expert_model_parallel_size`` (EP) folds each pipeline rank's ranks into expert-parallel
    groups and adds one expert stage-replica group per stage and expert rank (see ``layout``).
    ``expert_groups`` (default: EP > 1) creates those groups also with EP = 1 -- an MoE model
    with T > 1, whose experts see different tokens on each tensor rank (sequence parallelism)
    and are reduced over all T x W ranks of each stage.
    """
    global _STATE
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized; call "
                           "initialize.initialize_distributed")
    if _STATE is not None:
        raise RuntimeError("model parallel groups are already initialized; destroy them first")
    layout = ParallelLayout.from_world(dist.get_world_size(), tensor_model_parallel_size,
                                       pipeline_model_parallel_size, context_parallel_size,
                                       expert_model_parallel_size)
    d, w, t_size, cp = layout.pipeline, layout.data, layout.tensor, layout.context
    validate_placement(placement, num_stages, d)
    rank = dist.get_rank()
    pipeline_rank, data_parallel_rank, tensor_rank = layout.coordinates(rank)
    kwargs = {"timeout": timeout} if timeout is not None else {}
    created: list[dist.ProcessGroup] = []
    collective: list[dist.ProcessGroup] = []  # in the one global creation order
    known: dict[tuple, dist.ProcessGroup | None] = {}

    def new_group(ranks: list[int], purpose: str = "collective") -> dist.ProcessGroup | None:
        """One group per distinct rank set and purpose (every rank asks in the same order)."""
        key = (purpose, tuple(sorted(ranks)))
        if key not in known:
            group = dist.new_group(ranks, **kwargs)
            known[key] = group if rank in ranks else None
            if rank in ranks:
                created.append(group)
                if purpose == "collective":
                    collective.append(group)
        return known[key]

    state = _ModelParallelState(
        layout=layout, num_stages=num_stages,
        placement=[list(p) for p in placement], rank=rank, pipeline_rank=pipeline_rank,
        data_parallel_rank=data_parallel_rank, tensor_rank=tensor_rank,
        context_rank=layout.context_rank(rank),
    )

    def keep(ranks: list[int], attribute: str) -> None:
        group = new_group(ranks)
        if group is not None:
            setattr(state, f"{attribute}_group", group)
            setattr(state, f"{attribute}_ranks", ranks)

    for dp in range(w):
        for c in range(cp):
            for t in range(t_size):
                keep(layout.pipeline_ranks(dp, t, c), "pipeline")
    for p in range(d):
        for c in range(cp):
            for t in range(t_size):
                keep(layout.data_parallel_ranks(p, t, c), "data_parallel")
    for p in range(d):
        for dp in range(w):
            for c in range(cp):
                keep(layout.tensor_ranks(p, dp, c), "tensor")
    for dp in range(w):
        for c in range(cp):
            keep(layout.model_parallel_ranks(dp, c), "model_parallel")
    if cp > 1:  # (at CP = 1 a context group would be one rank: none is created)
        for p in range(d):
            for dp in range(w):
                for t in range(t_size):
                    keep(layout.context_ranks(p, dp, t), "context")
        if hierarchical_context_parallel_sizes is not None:
            _hierarchical_context_groups(state, layout, hierarchical_context_parallel_sizes,
                                         new_group)
    for stage in range(num_stages):
        for t in range(t_size):
            ranks = layout.stage_replica_ranks(placement, stage, t)
            group = new_group(ranks)
            if t == tensor_rank:
                state.stage_replica_ranks[stage] = ranks
            if group is not None:
                state.stage_replica_groups[stage] = group
    for t in range(t_size):
        ranks = layout.embedding_ranks(placement, t)
        group = new_group(ranks)
        if t == tensor_rank:
            state.embedding_ranks, state.embedding_group = ranks, group
    state.expert_rank, state.expert_data_rank = layout.expert_coordinates(rank)
    if expert_groups is None:
        expert_groups = layout.expert > 1
    if expert_groups and (layout.expert > 1 or layout.tensor > 1 or layout.context > 1):
        _expert_groups(state, new_group)
    if p2p_direction_groups is None:
        p2p_direction_groups = dist.get_backend() == "nccl" or nccl_semantics_requested()
    if p2p_direction_groups:
        for src, dst in neighbour_directions(placement):
            for dp in range(w):
                for c in range(cp):
                    for t in range(t_size):
                        ranks = [layout.global_rank(src, dp, t, c),
                                 layout.global_rank(dst, dp, t, c)]
                        group = new_group(ranks, purpose=f"p2p {src}->{dst}")
                        if group is not None:
                            state.p2p_groups[(ranks[0], ranks[1])] = group
    state.all_groups = created
    state.collective_groups = collective
    _STATE = state


def _hierarchical_context_groups(state: _ModelParallelState, layout: ParallelLayout,
                                 sizes: tuple[int, int], new_group) -> None:
    """Inner and outer groups of every context group (one global order); this rank's kept as
    :class:`HierarchicalGroups`."""
    inner_size, outer_size = sizes
    for p in range(layout.pipeline):
        for dp in range(layout.data):
            for t in range(layout.tensor):
                inner, outer = hierarchical_groups(layout.context_ranks(p, dp, t), sizes)
                made = [[(new_group(r) if len(r) > 1 else None, r) for r in level]
                        for level in (inner, outer)]
                mine = [next(((g, r) for g, r in level if state.rank in r), None)
                        for level in made]
                if mine[0] is not None:
                    state.hierarchical_context = HierarchicalGroups(
                        mine[0][0], mine[1][0], inner_size, outer_size)


def _expert_groups(state: _ModelParallelState, new_group) -> None:
    """Expert-parallel groups (one per pipeline rank and expert-data rank) and expert
    stage-replica groups (one per stage and expert rank), in one global order."""
    layout, placement = state.layout, state.placement
    state.has_expert_groups = True
    for p in range(layout.pipeline):
        for d in range(layout.expert_data):
            ranks = layout.expert_parallel_ranks(p, d)
            group = new_group(ranks)
            if group is not None:
                state.expert_group, state.expert_ranks = group, ranks
    for stage in range(state.num_stages):
        for e in range(layout.expert):
            ranks = layout.expert_stage_replica_ranks(placement, stage, e)
            group = new_group(ranks)
            if e == state.expert_rank and stage in state.stage_replica_groups:
                state.expert_stage_replica_ranks[stage] = ranks
            if group is not None:
                state.expert_stage_replica_groups[stage] = group


def destroy_model_parallel() -> None:
    """Destroy every group created by ``initialize_model_parallel`` and forget the layout."""
    global _STATE
    if _STATE is None:
        return
    for group in _STATE.all_groups:
        dist.destroy_process_group(group)
    _STATE = None


def connect_communicators(device: torch.device) -> int:
    """One tiny all-reduce on every collective group of this rank (tensor, pipeline,
    data-parallel, model-parallel, stage-replica, embedding), in the global order the groups
    were created in, so every communicator exists before the first iteration instead of being
    set up lazily mid-backward (NCCL creates a communicator collectively on first use; in one
    global order no two ranks can wait on each other's). Point-to-point directions are warmed
    by the pipeline transport. Returns the number of groups connected."""
    groups = _state().collective_groups
    probe = torch.zeros(1, device=device)
    for group in groups:
        dist.all_reduce(probe, group=group)
    return len(groups)


def model_parallel_is_initialized() -> bool:
    """True between ``initialize_model_parallel`` and ``destroy_model_parallel``."""
    return _STATE is not None


def get_parallel_layout() -> ParallelLayout:
    """The T x W x D layout of the initialised groups (T = W = D = 1 before
    ``initialize_model_parallel``: a model built without groups is the whole model)."""
    return _STATE.layout if _STATE is not None else ParallelLayout()


# ---------------------------------------------------------------- Megatron getters
# Megatron-core's public parallel_state API (same names and meanings), for user code and tools
# written against Megatron; the framework itself reads the Chimera getters below.
def get_pipeline_model_parallel_world_size() -> int:
    """D: number of pipeline ranks."""
    return _state().layout.pipeline


def get_pipeline_model_parallel_rank() -> int:
    """This rank's pipeline rank (0 .. D-1)."""
    return _state().pipeline_rank


def get_pipeline_model_parallel_group() -> dist.ProcessGroup:
    """The D ranks of this rank's data-parallel replica and tensor rank."""
    return _state().pipeline_group


def get_data_parallel_world_size() -> int:
    """W: number of data-parallel replicas of the whole pipeline."""
    return _state().layout.data


def get_data_parallel_rank() -> int:
    """This rank's data-parallel index (0 .. W-1)."""
    return _state().data_parallel_rank


def get_data_parallel_group() -> dist.ProcessGroup:
    """Ranks with this pipeline and tensor rank in every data-parallel replica (Megatron's DP
    group)."""
    return _state().data_parallel_group


def get_context_parallel_world_size() -> int:
    """CP: ranks sharing one sequence (1 before ``initialize_model_parallel``)."""
    return _STATE.layout.context if _STATE is not None else 1


def get_context_parallel_rank() -> int:
    """This rank's context-parallel rank (0 .. CP-1; 0 before ``initialize_model_parallel``):
    it holds the sequence's chunks ``rank`` and ``2 CP - 1 - rank``."""
    return _STATE.context_rank if _STATE is not None else 0


def get_context_parallel_group() -> dist.ProcessGroup | None:
    """The CP ranks sharing this rank's sequences (same pipeline, data-parallel and tensor
    rank); None at CP = 1."""
    return _state().context_group


def get_hierarchical_context_parallel_groups() -> HierarchicalGroups:
    """This rank's :class:`HierarchicalGroups` (``--hierarchical-context-parallel-sizes``);
    RuntimeError when none were created."""
    groups = _state().hierarchical_context
    if groups is None:
        raise RuntimeError("--cp-comm-type a2a+p2p needs the groups of "
                           "--hierarchical-context-parallel-sizes (initialize_model_parallel)")
    return groups


def get_context_parallel_global_ranks() -> list[int]:
    """Global ranks of this rank's context-parallel group, by context rank."""
    s = _state()
    return list(s.context_ranks) or [s.rank]


def get_tensor_model_parallel_world_size() -> int:
    """T: tensor-parallel ranks per stage (1 before ``initialize_model_parallel``: a model built
    without groups is the whole model on one process)."""
    return _STATE.layout.tensor if _STATE is not None else 1


def get_tensor_model_parallel_rank() -> int:
    """This rank's tensor-parallel rank (0 .. T-1; 0 before ``initialize_model_parallel``)."""
    return _STATE.tensor_rank if _STATE is not None else 0


def get_tensor_model_parallel_group() -> dist.ProcessGroup:
    """The T ranks sharing this rank's pipeline and data-parallel rank."""
    return _state().tensor_group


def get_tensor_model_parallel_ranks() -> list[int]:
    """Global ranks of this rank's tensor-parallel group, by tensor rank."""
    return list(_state().tensor_ranks)


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of tensor rank 0 in this rank's tensor-parallel group."""
    return _state().tensor_ranks[0]


def get_model_parallel_group() -> dist.ProcessGroup:
    """Tensor x pipeline ranks of this data-parallel replica: one whole model."""
    return _state().model_parallel_group


def is_pipeline_first_stage(stage: int) -> bool:
    """True for stage 0 (with several stages per rank, the stage must be named)."""
    return stage == 0


def is_pipeline_last_stage(stage: int) -> bool:
    """True for the last model stage."""
    return stage == _state().num_stages - 1


def get_pipeline_model_parallel_last_rank() -> int:
    """Global rank of the last pipeline rank in this data-parallel replica and tensor rank."""
    return _state().pipeline_ranks[-1]


# ---------------------------------------------------------------- Chimera getters
def replicas_of_this_rank() -> list[tuple[int, int]]:
    """The (pipe, stage) replicas held by this rank."""
    s = _state()
    return [
        (pipe, stage)
        for pipe, stages in enumerate(s.placement)
        for stage, r in enumerate(stages)
        if r == s.pipeline_rank
    ]


def get_stage_replica_group(stage: int) -> dist.ProcessGroup:
    """Group of every rank holding this rank's shard of stage ``stage`` (all pipes, all
    data-parallel replicas, this tensor rank)."""
    s = _state()
    if stage not in s.stage_replica_groups:
        raise ValueError(f"rank {s.rank} holds no replica of stage {stage}")
    return s.stage_replica_groups[stage]


def get_stage_replica_ranks(stage: int) -> list[int]:
    """Global ranks holding this rank's shard of stage ``stage``, over all pipes and data-parallel
    replicas."""
    return list(_state().stage_replica_ranks[stage])


def get_num_stages() -> int:
    """Model stages of the schedule (D, or D x v for the interleaved schedule)."""
    return _state().num_stages


def get_embedding_group() -> dist.ProcessGroup | None:
    """Holders of this rank's shard of the tied word embedding (stage 0 or last stage, this
    tensor rank); None off the group."""
    return _state().embedding_group


def get_embedding_ranks() -> list[int]:
    """Global ranks of this rank's embedding group."""
    return list(_state().embedding_ranks)


def get_model_replica_group() -> dist.ProcessGroup:
    """Group over which found-inf and the gradient norm are reduced (the model-parallel group)."""
    return _state().model_parallel_group


def is_stage_owner(stage: int) -> bool:
    """Whether this rank counts ``stage`` in grad-norm reductions (it holds it in pipe 0)."""
    s = _state()
    return s.placement[0][stage] == s.pipeline_rank


def get_pipeline_prev_rank(pipe: int, stage: int) -> int | None:
    """Global rank holding stage ``stage - 1`` of ``pipe`` (this data-parallel and tensor rank)."""
    s = _state()
    if stage == 0:
        return None
    return s.to_global(s.placement[pipe][stage - 1])


def get_pipeline_next_rank(pipe: int, stage: int) -> int | None:
    """Global rank holding stage ``stage + 1`` of ``pipe`` (this data-parallel and tensor rank)."""
    s = _state()
    if stage == s.num_stages - 1:
        return None
    return s.to_global(s.placement[pipe][stage + 1])


def get_p2p_group(src: int, dst: int) -> dist.ProcessGroup | None:
    """Group for messages from global rank ``src`` to ``dst`` (None: the default group)."""
    return _state().p2p_groups.get((src, dst))


def pipeline_rank_to_global_rank(pipeline_rank: int) -> int:
    """Global rank of ``pipeline_rank`` in this rank's data-parallel replica and tensor rank."""
    return _state().to_global(pipeline_rank)


# ---------------------------------------------------------------- experts
def get_expert_model_parallel_world_size() -> int:
    """EP: expert-parallel ranks (1 before ``initialize_model_parallel``)."""
    return _STATE.layout.expert if _STATE is not None else 1


def get_expert_model_parallel_rank() -> int:
    """This rank's index in its expert-parallel group (0 before ``initialize_model_parallel``)."""
    return _STATE.expert_rank if _STATE is not None else 0


def get_expert_data_parallel_rank() -> int:
    """This rank's expert-data-parallel index (0 before ``initialize_model_parallel``)."""
    return _STATE.expert_data_rank if _STATE is not None else 0


def get_expert_model_parallel_group() -> dist.ProcessGroup | None:
    """This rank's expert-parallel group (ranks of its pipeline rank; None with EP = 1)."""
    return _state().expert_group


def get_expert_model_parallel_ranks() -> list[int]:
    """Global ranks of this rank's expert-parallel group, by expert rank."""
    return list(_state().expert_ranks)


def has_expert_groups() -> bool:
    """Whether the experts are reduced over groups of their own (EP > 1, or an MoE model with
    T > 1); otherwise over the stage-replica groups like every other parameter."""
    return _STATE is not None and _STATE.has_expert_groups


def get_expert_stage_replica_group(stage: int) -> dist.ProcessGroup:
    """Holders of this rank's experts of stage ``stage`` (every pipe, every expert-data rank);
    the stage-replica group when the experts have no groups of their own."""
    s = _state()
    if not s.has_expert_groups:
        return get_stage_replica_group(stage)
    if stage not in s.expert_stage_replica_groups:
        raise ValueError(f"rank {s.rank} holds no replica of stage {stage}")
    return s.expert_stage_replica_groups[stage]


def get_expert_stage_replica_ranks(stage: int) -> list[int]:
    """Global ranks of :func:`get_expert_stage_replica_group`."""
    s = _state()
    if not s.has_expert_groups:
        return get_stage_replica_ranks(stage)
    return list(s.expert_stage_replica_ranks[stage])
