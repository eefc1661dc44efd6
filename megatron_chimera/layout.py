"""The parallel layout: one owner of world = T x CP x W x D, of every size T (and CP) must divide,
of Megatron's rank order and of which ranks each group joins (torchtitan's ``ParallelDims``,
torch-free).

:class:`ParallelLayout` is built once from the flags (``ParallelConfig.layout``) or from the
world (:meth:`ParallelLayout.from_world`); ``parallel_state`` creates its groups from it, the
config checks, the cost model and the model ask it. Rank order (Megatron's)::

    global rank = ((pipeline_rank x W + data_parallel_rank) x CP + context_rank) x T + tensor_rank

tensor-parallel ranks innermost (consecutive ranks, so a node holds a whole tensor-parallel
group), then context-parallel ranks (``--context-parallel-size``: each holds ``s / CP`` tokens of
every sequence), then data-parallel replicas, then pipeline ranks (Megatron's ``tp-cp-dp-pp``).
The CP ranks of one data-parallel replica read the same samples and hold the same weights: a
stage's gradients are reduced over its data x context ranks (the stage-replica group).
A *placement* (``Schedule.placement``:
``placement[pipe][stage]`` = pipeline rank) says which pipeline ranks hold which stage; the
stage-replica and embedding groups follow from it.

Expert parallelism (Megatron's "parallel folding"): the ``T x CP x W`` ranks of one pipeline
rank (local index ``i`` = the global rank minus ``pipeline_rank x T x CP x W``) regroup into
``EP`` expert-parallel x ``T x CP x W / EP`` expert-data-parallel ranks, expert-parallel
innermost: ``expert rank = i mod EP``, ``expert-data rank =
i div EP``. An expert-parallel group therefore holds ranks of one pipeline rank only -- ranks
that run the same action list -- so with Chimera workers ``w`` and ``D-1-w`` never share one.
The experts of a stage are reduced over the ranks holding that stage with the same expert rank
(every pipe, every expert-data rank).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_chimera.errors import ConfigError


def global_rank(pipeline_rank: int, data_parallel_rank: int, data_parallel_size: int,
                tensor_rank: int = 0, tensor_size: int = 1) -> int:
    """Global rank of ``(pipeline_rank, data_parallel_rank, tensor_rank)``."""
    return (pipeline_rank * data_parallel_size + data_parallel_rank) * tensor_size + tensor_rank


def rank_coordinates(rank: int, data_parallel_size: int,
                     tensor_size: int = 1) -> tuple[int, int, int]:
    """Inverse of :func:`global_rank`: ``(pipeline_rank, data_parallel_rank, tensor_rank)``."""
    replica, tensor_rank = divmod(rank, tensor_size)
    pipeline_rank, data_parallel_rank = divmod(replica, data_parallel_size)
    return pipeline_rank, data_parallel_rank, tensor_rank


def pad_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int,
                   tensor_parallel: int = 1) -> int:
    """Megatron's padded vocabulary: round up to a multiple of divisible_by x tensor-parallel."""
    multiple = make_vocab_size_divisible_by * tensor_parallel
    return int(math.ceil(vocab_size / multiple) * multiple)


@dataclass(frozen=True)
class ParallelLayout:
    """T tensor-parallel ranks per stage, W data-parallel replicas, D pipeline ranks, CP
    context-parallel ranks per replica."""

    tensor: int = 1
    data: int = 1
    pipeline: int = 1
    context: int = 1
    # EP: expert-parallel ranks, folded out of the T x CP x W ranks of a pipeline rank
    expert: int = 1

    def __post_init__(self) -> None:
        if self.expert < 1 or self.ranks_per_pipeline_rank % self.expert:
            raise ConfigError(
                f"--expert-model-parallel-size {self.expert} does not divide "
                f"--tensor-model-parallel-size {self.tensor} x --context-parallel-size "
                f"{self.context} x data-parallel size {self.data} (expert-parallel ranks are "
                f"folded out of one pipeline rank's ranks)")

    @classmethod
    def from_world(cls, world_size: int, tensor: int = 1, pipeline: int = 1,
                   context: int = 1, expert: int = 1) -> ParallelLayout:
        """W = world / (T x CP x D); ConfigError naming the flags when they do not divide the
        world."""
        if tensor < 1 or pipeline < 1 or context < 1 or world_size % (pipeline * tensor * context):
            raise ConfigError(
                f"--tensor-model-parallel-size {tensor} x --context-parallel-size {context} x "
                f"--pipeline-model-parallel-size {pipeline} does not divide the world size "
                f"{world_size} (world = tensor x context x data-parallel x pipeline size)")
        return cls(tensor, world_size // (pipeline * tensor * context), pipeline, context,
                   expert)

    @property
    def ranks_per_pipeline_rank(self) -> int:
        """T x CP x W: the ranks of one pipeline rank (what the expert groups fold)."""
        return self.tensor * self.context * self.data

    @property
    def world_size(self) -> int:
        """T x CP x W x D."""
        return self.tensor * self.context * self.data * self.pipeline

    def check_world(self, world_size: int) -> None:
        """ConfigError when the layout does not fill a world of ``world_size`` ranks."""
        if self.world_size != world_size:
            raise ConfigError(
                f"--tensor-model-parallel-size {self.tensor} x --context-parallel-size "
                f"{self.context} x --pipeline-model-parallel-size {self.pipeline} x "
                f"data-parallel {self.data} != world size {world_size}")

    # ------------------------------------------------------------------ what T must divide
    def split(self, size: int, flag: str) -> int:
        """``size / T`` (one tensor rank's share); ConfigError naming ``flag`` when T does not
        divide it."""
        if size % self.tensor:
            raise ConfigError(f"{flag} {size} is not divisible by --tensor-model-parallel-size "
                              f"{self.tensor}")
        return size // self.tensor

    def check_model(self, model: Any, sequence_parallel: bool | None = None) -> None:
        """Every size of ``model`` (a ``ModelConfig``) that T must divide: attention heads,
        query groups, hidden and MLP sizes, and the sequence under ``--sequence-parallel``
        (which needs T > 1). ``sequence_parallel`` defaults to the model's flag."""
        if sequence_parallel is None:
            sequence_parallel = model.sequence_parallel
        if sequence_parallel and self.tensor == 1:
            raise ConfigError("--sequence-parallel requires --tensor-model-parallel-size > 1 (it "
                              "splits the sequence over the tensor-parallel ranks)")
        sizes = [("--num-attention-heads", model.num_attention_heads)]
        query_groups = getattr(model, "num_query_groups", None)
        if query_groups is not None:
            sizes.append(("--num-query-groups", query_groups))
        sizes += [("--hidden-size", model.hidden_size), ("--ffn-hidden-size", model.ffn_size)]
        for flag, size in sizes:
            self.split(size, flag)
        if self.context > 1 and model.seq_length % (2 * self.context):
            raise ConfigError(f"--seq-length {model.seq_length} is not divisible by 2 x "
                              f"--context-parallel-size ({2 * self.context}): each context-"
                              f"parallel rank holds two equal chunks of the sequence")
        if sequence_parallel and (model.seq_length // self.context) % self.tensor:
            per_rank = (f" / --context-parallel-size {self.context}" if self.context > 1
                        else "")
            raise ConfigError(f"--seq-length {model.seq_length}{per_rank} is not divisible by "
                              f"--tensor-model-parallel-size {self.tensor} (--sequence-parallel "
                              f"splits the sequence)")

    def padded_vocab_size(self, vocab_size: int, make_vocab_size_divisible_by: int) -> int:
        """The vocabulary padded for T ranks (a multiple of divisible_by x T)."""
        return pad_vocab_size(vocab_size, make_vocab_size_divisible_by, self.tensor)

    # ------------------------------------------------------------------ ranks
    def global_rank(self, pipeline_rank: int, data_parallel_rank: int = 0,
                    tensor_rank: int = 0, context_rank: int = 0) -> int:
        """Global rank of ``(pipeline_rank, data_parallel_rank, tensor_rank, context_rank)``."""
        return global_rank(pipeline_rank, data_parallel_rank * self.context + context_rank,
                           self.data * self.context, tensor_rank, self.tensor)

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """``(pipeline_rank, data_parallel_rank, tensor_rank)`` of a global rank (its context
        rank: :meth:`context_rank`)."""
        pipeline_rank, replica, tensor_rank = rank_coordinates(
            rank, self.data * self.context, self.tensor)
        return pipeline_rank, replica // self.context, tensor_rank

    def context_rank(self, rank: int) -> int:
        """The context-parallel rank (0 .. CP-1) of a global rank."""
        return (rank // self.tensor) % self.context

    # ------------------------------------------------------------------ groups
    def pipeline_ranks(self, data_parallel_rank: int, tensor_rank: int,
                       context_rank: int = 0) -> list[int]:
        """The D ranks of one data-parallel replica, tensor and context rank, by pipeline rank."""
        return [self.global_rank(p, data_parallel_rank, tensor_rank, context_rank)
                for p in range(self.pipeline)]

    def data_parallel_ranks(self, pipeline_rank: int, tensor_rank: int,
                            context_rank: int = 0) -> list[int]:
        """The W ranks of one pipeline, tensor and context rank (Megatron's data-parallel
        group: the ranks that read different samples)."""
        return [self.global_rank(pipeline_rank, w, tensor_rank, context_rank)
                for w in range(self.data)]

    def context_ranks(self, pipeline_rank: int, data_parallel_rank: int,
                      tensor_rank: int) -> list[int]:
        """The CP ranks that share one sequence (Megatron's context-parallel group)."""
        return [self.global_rank(pipeline_rank, data_parallel_rank, tensor_rank, c)
                for c in range(self.context)]

    def tensor_ranks(self, pipeline_rank: int, data_parallel_rank: int,
                     context_rank: int = 0) -> list[int]:
        """The T ranks of one pipeline rank, data-parallel replica and context rank."""
        return [self.global_rank(pipeline_rank, data_parallel_rank, t, context_rank)
                for t in range(self.tensor)]

    def model_parallel_ranks(self, data_parallel_rank: int, context_rank: int = 0) -> list[int]:
        """Tensor x pipeline ranks of one data-parallel replica and context rank: one whole
        model."""
        return [self.global_rank(p, data_parallel_rank, t, context_rank)
                for p in range(self.pipeline) for t in range(self.tensor)]

    def replica_ranks(self, pipeline_ranks: Iterable[int], tensor_rank: int) -> list[int]:
        """Every rank of ``tensor_rank`` on the given pipeline ranks, in every data-parallel
        replica and context rank (ordered by pipeline rank, then replica, then context rank)."""
        return [self.global_rank(p, w, tensor_rank, c)
                for p in sorted(set(pipeline_ranks)) for w in range(self.data)
                for c in range(self.context)]

    def stage_replica_ranks(self, placement: Sequence[Sequence[int]], stage: int,
                            tensor_rank: int) -> list[int]:
        """Holders of ``stage``'s shard ``tensor_rank``: every pipe, every data-parallel replica
        and context rank (where its gradients are reduced and the distributed optimizer shards
        it)."""
        return self.replica_ranks((pipe[stage] for pipe in placement), tensor_rank)

    def embedding_ranks(self, placement: Sequence[Sequence[int]], tensor_rank: int) -> list[int]:
        """Holders of the first or last stage of any pipe (the tied word embedding's copies)."""
        last = len(placement[0]) - 1
        return self.replica_ranks((pipe[s] for pipe in placement for s in (0, last)),
                                  tensor_rank)

    # ------------------------------------------------------------------ experts
    @property
    def expert_data(self) -> int:
        """Expert-data-parallel ranks per pipeline rank: ``T x CP x W / EP``."""
        return self.ranks_per_pipeline_rank // self.expert

    def check_experts(self, num_experts: int) -> None:
        """ConfigError when EP does not divide ``--num-experts``."""
        if num_experts % self.expert:
            raise ConfigError(f"--num-experts {num_experts} is not divisible by "
                              f"--expert-model-parallel-size {self.expert}")

    def expert_coordinates(self, rank: int) -> tuple[int, int]:
        """``(expert_rank, expert_data_rank)`` of a global rank."""
        local = rank % self.ranks_per_pipeline_rank
        return local % self.expert, local // self.expert

    def _expert_global(self, pipeline_rank: int, expert_rank: int, expert_data_rank: int) -> int:
        return (pipeline_rank * self.ranks_per_pipeline_rank + expert_data_rank * self.expert
                + expert_rank)

    def expert_parallel_ranks(self, pipeline_rank: int, expert_data_rank: int) -> list[int]:
        """The EP ranks of one pipeline rank and expert-data rank, by expert rank."""
        return [self._expert_global(pipeline_rank, e, expert_data_rank)
                for e in range(self.expert)]

    def expert_replica_ranks(self, pipeline_ranks: Iterable[int], expert_rank: int) -> list[int]:
        """Every rank of ``expert_rank`` on the given pipeline ranks, every expert-data rank."""
        return [self._expert_global(p, expert_rank, d)
                for p in sorted(set(pipeline_ranks)) for d in range(self.expert_data)]

    def expert_stage_replica_ranks(self, placement: Sequence[Sequence[int]], stage: int,
                                   expert_rank: int) -> list[int]:
        """Holders of the experts of ``expert_rank`` in ``stage``: every pipe, every expert-data
        rank (where the expert gradients are reduced and the distributed optimizer shards
        them)."""
        return self.expert_replica_ranks((pipe[stage] for pipe in placement), expert_rank)


def hierarchical_groups(context_ranks: list[int], sizes: tuple[int, int]
                        ) -> tuple[list[list[int]], list[list[int]]]:
    """The inner groups (``A`` adjacent ranks each) and the outer groups (the ranks with the same
    index in their inner group) of one context group, given its global ranks by context rank
    (Megatron's order: ``--hierarchical-context-parallel-sizes 2 4`` pairs adjacent ranks)."""
    inner, outer = sizes
    if inner * outer != len(context_ranks):
        raise ValueError(f"--hierarchical-context-parallel-sizes {inner} {outer}: the product "
                         f"must be --context-parallel-size {len(context_ranks)}")
    return ([context_ranks[g * inner:(g + 1) * inner] for g in range(outer)],
            [context_ranks[i::inner] for i in range(inner)])


def validate_placement(placement: list[list[int]], num_stages: int, pipeline_size: int) -> None:
    """ConfigError unless every pipe places ``num_stages`` stages, on pipeline ranks
    ``0 .. pipeline_size - 1``."""
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


def neighbour_directions(placement: list[list[int]]) -> list[tuple[int, int]]:
    """Ordered (sender, receiver) pipeline-rank pairs of every activation or gradient flow."""
    pairs = set()
    for stages in placement:
        for a, b in zip(stages, stages[1:]):
            if a != b:
                pairs.update({(a, b), (b, a)})
    return sorted(pairs)
