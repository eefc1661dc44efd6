"""Process groups and rank arithmetic for W-way data x D-way pipeline parallelism.

This is the only module of the library that holds module-level state (like Megatron's
``parallel_state``). ``initialize_model_parallel`` creates every group, in the same order on every
rank; ``destroy_model_parallel`` frees them.

Rank layout (Megatron's): ``global rank = pipeline_rank * W + data_parallel_rank``, so consecutive
ranks are data-parallel replicas of one pipeline rank. Example: W=2, D=4, Chimera with 2 pipes
(down pipe 0: stage s on pipeline rank s; up pipe 1: stage s on pipeline rank D-1-s)::

    global rank      0  1 | 2  3 | 4  5 | 6  7
    pipeline rank    0  0 | 1  1 | 2  2 | 3  3
    data-par. rank   0  1 | 0  1 | 0  1 | 0  1
    down-pipe stage  0  0 | 1  1 | 2  2 | 3  3
    up-pipe stage    3  3 | 2  2 | 1  1 | 0  0

    pipeline groups (one per data-parallel rank):  [0 2 4 6] [1 3 5 7]
    data-parallel groups (one per pipeline rank):  [0 1] [2 3] [4 5] [6 7]
    stage-replica groups: stage 0 [0 1 6 7]  stage 1 [2 3 4 5]  stage 2 [2 3 4 5]  stage 3 [0 1 6 7]
    embedding group (holders of stage 0 or 3):     [0 1 6 7]

Gradient all-reduce runs over the stage-replica groups (all 2f x W holders of a stage). The
*model-replica group* over which found-inf and the gradient norm are reduced is the pipeline group
of this rank: after gradient synchronisation every data-parallel replica holds identical
gradients, so one pipeline group sees the whole model. Inside it each stage is counted once, by
its *owner*: the rank holding that stage in pipe 0 (``is_stage_owner``). The tied word embedding
is counted with stage 0 (its copy at the last stage is not counted).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from megatron_chimera.config import ConfigError
from megatron_chimera.layout import global_rank, pipeline_and_data_parallel_rank

NCCL_SEMANTICS_ENV = "MEGATRON_CHIMERA_NCCL_SEMANTICS"


def nccl_semantics_requested() -> bool:
    """Whether the test harness runs gloo under NCCL's rules (``MEGATRON_CHIMERA_NCCL_SEMANTICS=1``,
    see :mod:`megatron_chimera.pipeline.nccl_semantics`): groups are then laid out as for NCCL."""
    return os.environ.get(NCCL_SEMANTICS_ENV, "0") == "1"


@dataclass
class _ModelParallelState:
    """Everything ``initialize_model_parallel`` computes for this rank."""

    pipeline_size: int
    data_parallel_size: int
    num_stages: int
    placement: list[list[int]]
    rank: int
    pipeline_rank: int
    data_parallel_rank: int
    pipeline_group: dist.ProcessGroup
    pipeline_ranks: list[int]
    data_parallel_group: dist.ProcessGroup
    data_parallel_ranks: list[int]
    stage_replica_groups: dict[int, dist.ProcessGroup] = field(default_factory=dict)
    stage_replica_ranks: dict[int, list[int]] = field(default_factory=dict)
    embedding_group: dist.ProcessGroup | None = None
    embedding_ranks: list[int] = field(default_factory=list)
    p2p_groups: dict[tuple[int, int], dist.ProcessGroup] = field(default_factory=dict)
    all_groups: list[dist.ProcessGroup] = field(default_factory=list)


_STATE: _ModelParallelState | None = None


def _state() -> _ModelParallelState:
    if _STATE is None:
        raise RuntimeError(
            "model parallel groups are not initialized; call initialize_model_parallel"
        )
    return _STATE


def _validate_placement(placement: list[list[int]], num_stages: int, pipeline_size: int) -> None:
    if not placement:
        raise ConfigError("--pipeline-schedule: the schedule's placement has no pipes")
    for pipe, stages in enumerate(placement):
        if len(stages) != num_stages:
            raise ConfigError(
                f"--pipeline-schedule: pipe {pipe} places {len(stages)} stages, "
                f"expected {num_stages}"
            )
        bad = [r for r in stages if not 0 <= r < pipeline_size]
        if bad:
            raise ConfigError(
                f"--pipeline-model-parallel-size={pipeline_size}: pipe {pipe} places stages on "
                f"pipeline ranks {bad} outside 0..{pipeline_size - 1}"
            )


def initialize_model_parallel(
    pipeline_model_parallel_size: int,
    placement: list[list[int]],
    num_stages: int,
    tensor_model_parallel_size: int = 1,
    timeout: timedelta | None = None,
    p2p_direction_groups: bool | None = None,
) -> None:
    """Create pipeline, data-parallel, stage-replica and embedding groups (same order everywhere).

    A rank set that appears twice (Chimera's stages s and D-1-s, 1F1B's stage-replica and
    data-parallel groups) gets one group; the two directions between pipe neighbours are the one
    deliberate exception (separate NCCL communicators, hence streams).

    ``placement[pipe][stage]`` is the pipeline rank holding that stage replica
    (``Schedule.placement``). ``p2p_direction_groups`` (default: on with NCCL and in the
    NCCL-semantics test mode) adds one 2-rank
    group per direction between pipe neighbours, so that the two directions between a pair of
    ranks run on separate NCCL communicators and streams and never wait behind each other.
    """
    global _STATE
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized; call initialize.initialize_distributed"
        )
    if _STATE is not None:
        raise RuntimeError("model parallel groups are already initialized; destroy them first")
    if tensor_model_parallel_size != 1:
        raise ConfigError(
            f"--tensor-model-parallel-size={tensor_model_parallel_size}: only 1 is supported"
        )
    world = dist.get_world_size()
    d = pipeline_model_parallel_size
    if d < 1 or world % d:
        raise ConfigError(
            f"--pipeline-model-parallel-size={d} must divide the world size {world} "
            f"(world = data-parallel size x pipeline size x tensor size 1)"
        )
    w = world // d
    _validate_placement(placement, num_stages, d)
    rank = dist.get_rank()
    pipeline_rank, data_parallel_rank = pipeline_and_data_parallel_rank(rank, w)
    kwargs = {"timeout": timeout} if timeout is not None else {}
    created: list[dist.ProcessGroup] = []
    known: dict[tuple, dist.ProcessGroup | None] = {}

    def new_group(ranks: list[int], purpose: str = "collective") -> dist.ProcessGroup | None:
        """One group per distinct rank set and purpose (every rank asks in the same order)."""
        key = (purpose, tuple(sorted(ranks)))
        if key not in known:
            group = dist.new_group(ranks, **kwargs)
            known[key] = group if rank in ranks else None
            if rank in ranks:
                created.append(group)
        return known[key]

    pipeline_group = pipeline_ranks = None
    for dp in range(w):
        ranks = [global_rank(p, dp, w) for p in range(d)]
        group = new_group(ranks)
        if group is not None:
            pipeline_group, pipeline_ranks = group, ranks
    data_parallel_group = data_parallel_ranks = None
    for p in range(d):
        ranks = [global_rank(p, dp, w) for dp in range(w)]
        group = new_group(ranks)
        if group is not None:
            data_parallel_group, data_parallel_ranks = group, ranks
    state = _ModelParallelState(
        pipeline_size=d, data_parallel_size=w, num_stages=num_stages,
        placement=[list(p) for p in placement], rank=rank, pipeline_rank=pipeline_rank,
        data_parallel_rank=data_parallel_rank, pipeline_group=pipeline_group,
        pipeline_ranks=pipeline_ranks, data_parallel_group=data_parallel_group,
        data_parallel_ranks=data_parallel_ranks,
    )
    for stage in range(num_stages):
        holders = sorted({pipe[stage] for pipe in placement})
        ranks = [global_rank(p, dp, w) for p in holders for dp in range(w)]
        state.stage_replica_ranks[stage] = ranks
        group = new_group(ranks)
        if group is not None:
            state.stage_replica_groups[stage] = group
    holders = sorted({pipe[s] for pipe in placement for s in (0, num_stages - 1)})
    state.embedding_ranks = [global_rank(p, dp, w) for p in holders for dp in range(w)]
    state.embedding_group = new_group(state.embedding_ranks)
    if p2p_direction_groups is None:
        p2p_direction_groups = dist.get_backend() == "nccl" or nccl_semantics_requested()
    if p2p_direction_groups:
        for src, dst in _neighbour_directions(placement):
            for dp in range(w):
                ranks = [global_rank(src, dp, w), global_rank(dst, dp, w)]
                group = new_group(ranks, purpose=f"p2p {src}->{dst}")
                if group is not None:
                    state.p2p_groups[(ranks[0], ranks[1])] = group
    state.all_groups = created
    _STATE = state


def _neighbour_directions(placement: list[list[int]]) -> list[tuple[int, int]]:
    """Ordered (sender, receiver) pipeline-rank pairs of every activation or gradient flow."""
    pairs = set()
    for stages in placement:
        for a, b in zip(stages, stages[1:]):
            if a != b:
                pairs.update({(a, b), (b, a)})
    return sorted(pairs)


def destroy_model_parallel() -> None:
    """Destroy every group created by ``initialize_model_parallel`` and forget the layout."""
    global _STATE
    if _STATE is None:
        return
    for group in _STATE.all_groups:
        dist.destroy_process_group(group)
    _STATE = None


def model_parallel_is_initialized() -> bool:
    """True between ``initialize_model_parallel`` and ``destroy_model_parallel``."""
    return _STATE is not None


# ---------------------------------------------------------------- Megatron getters
# Megatron-core's public parallel_state API (same names and meanings), for user code and tools
# written against Megatron; the framework itself reads the Chimera getters below.
def get_pipeline_model_parallel_world_size() -> int:
    """D: number of pipeline ranks."""
    return _state().pipeline_size


def get_pipeline_model_parallel_rank() -> int:
    """This rank's pipeline rank (0 .. D-1)."""
    return _state().pipeline_rank


def get_pipeline_model_parallel_group() -> dist.ProcessGroup:
    """The D ranks of this rank's data-parallel replica."""
    return _state().pipeline_group




def get_data_parallel_world_size() -> int:
    """W: number of data-parallel replicas of the whole pipeline."""
    return _state().data_parallel_size


def get_data_parallel_rank() -> int:
    """This rank's data-parallel index (0 .. W-1)."""
    return _state().data_parallel_rank


def get_data_parallel_group() -> dist.ProcessGroup:
    """Ranks with this pipeline rank in every data-parallel replica (Megatron's DP group)."""
    return _state().data_parallel_group


def get_tensor_model_parallel_world_size() -> int:
    """Tensor parallelism is not supported: always 1."""
    return 1


def get_tensor_model_parallel_rank() -> int:
    """Tensor parallelism is not supported: always 0."""
    return 0


def is_pipeline_first_stage(stage: int) -> bool:
    """True for stage 0 (with several stages per rank, the stage must be named)."""
    return stage == 0


def is_pipeline_last_stage(stage: int) -> bool:
    """True for the last model stage."""
    return stage == _state().num_stages - 1


def get_pipeline_model_parallel_last_rank() -> int:
    """Global rank of the last pipeline rank in this data-parallel replica (logging rank)."""
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
    """Group of every rank holding stage ``stage`` (all pipes, all data-parallel replicas)."""
    s = _state()
    if stage not in s.stage_replica_groups:
        raise ValueError(f"rank {s.rank} holds no replica of stage {stage}")
    return s.stage_replica_groups[stage]


def get_stage_replica_ranks(stage: int) -> list[int]:
    """Global ranks holding stage ``stage``, over all pipes and data-parallel replicas."""
    return list(_state().stage_replica_ranks[stage])


def get_num_stages() -> int:
    """Model stages of the schedule (D, or D x v for the interleaved schedule)."""
    return _state().num_stages


def get_embedding_group() -> dist.ProcessGroup | None:
    """Holders of the tied word embedding (stage 0 or last stage); None off the group."""
    return _state().embedding_group


def get_embedding_ranks() -> list[int]:
    """Global ranks of the embedding group."""
    return list(_state().embedding_ranks)


def get_model_replica_group() -> dist.ProcessGroup:
    """Group over which found-inf and the gradient norm are reduced (this pipeline group)."""
    return _state().pipeline_group


def is_stage_owner(stage: int) -> bool:
    """Whether this rank counts ``stage`` in grad-norm reductions (it holds it in pipe 0)."""
    s = _state()
    return s.placement[0][stage] == s.pipeline_rank


def get_pipeline_prev_rank(pipe: int, stage: int) -> int | None:
    """Global rank holding stage ``stage - 1`` of ``pipe`` in this data-parallel replica."""
    s = _state()
    if stage == 0:
        return None
    return global_rank(s.placement[pipe][stage - 1], s.data_parallel_rank, s.data_parallel_size)


def get_pipeline_next_rank(pipe: int, stage: int) -> int | None:
    """Global rank holding stage ``stage + 1`` of ``pipe`` in this data-parallel replica."""
    s = _state()
    if stage == s.num_stages - 1:
        return None
    return global_rank(s.placement[pipe][stage + 1], s.data_parallel_rank, s.data_parallel_size)


def get_p2p_group(src: int, dst: int) -> dist.ProcessGroup | None:
    """Group for messages from global rank ``src`` to ``dst`` (None: the default group)."""
    return _state().p2p_groups.get((src, dst))


def pipeline_rank_to_global_rank(pipeline_rank: int) -> int:
    """Global rank of ``pipeline_rank`` in this rank's data-parallel replica."""
    s = _state()
    return global_rank(pipeline_rank, s.data_parallel_rank, s.data_parallel_size)
