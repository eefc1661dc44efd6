"""Megatron's interleaved 1F1B: v model chunks per rank (virtual pipeline), one pipe of D*v stages.

Virtual stage ``s`` lives on rank ``s % D`` as model chunk ``s // D``. Micro-batches go through
the chunks in groups of D: the k-th forward of a rank (k = 0 .. N*v-1) runs chunk
``(k mod D*v) // D`` on micro-batch ``(k // (D*v)) * D + k mod D``, its k-th backward the same
with the chunk order reversed. Rank r warms up with ``min(2(D-r-1) + (v-1)D, N*v)`` forwards
(all of them when N = D), then alternates one forward and one backward, then drains its
backwards; exactly Megatron's ``forward_backward_pipelining_with_interleaving`` order.
"""

from __future__ import annotations

from megatron_chimera.schedules.actions import BACKWARD, FORWARD, Action, Schedule


def _chunk_action(
    kind: str, k: int, rank: int, num_ranks: int, num_chunks: int
) -> Action:
    """The k-th forward (or backward) of ``rank`` as an Action on its virtual stage."""
    group_size = num_ranks * num_chunks
    within = k % group_size
    chunk = within // num_ranks
    if kind == BACKWARD:
        chunk = num_chunks - 1 - chunk
    microbatch = (k // group_size) * num_ranks + within % num_ranks
    return Action(kind, 0, chunk * num_ranks + rank, microbatch)


def interleaved(
    num_ranks: int, num_microbatches: int, virtual_pipeline_size: int = 2
) -> Schedule:
    """Interleaved 1F1B with ``virtual_pipeline_size`` chunks per rank; N a multiple of D."""
    v = virtual_pipeline_size
    if num_ranks < 1:
        raise ValueError(f"--pipeline-model-parallel-size must be >= 1, got {num_ranks}")
    if v is None or v < 2:
        raise ValueError(
            f"--num-virtual-stages-per-pipeline-rank (or --num-layers-per-virtual-pipeline-stage) "
            f"must give at least 2 model chunks per rank for the interleaved schedule, got {v}"
        )
    if num_microbatches < num_ranks or num_microbatches % num_ranks:
        raise ValueError(
            f"--num-microbatches must be a positive multiple of --pipeline-model-parallel-size "
            f"= {num_ranks} for the interleaved schedule, got {num_microbatches}"
        )
    total = num_microbatches * v
    actions = []
    for rank in range(num_ranks):
        if num_microbatches == num_ranks:
            warmup = total
        else:
            warmup = min(2 * (num_ranks - rank - 1) + (v - 1) * num_ranks, total)
        order = [_chunk_action(FORWARD, k, rank, num_ranks, v) for k in range(warmup)]
        for k in range(total - warmup):
            order.append(_chunk_action(FORWARD, k + warmup, rank, num_ranks, v))
            order.append(_chunk_action(BACKWARD, k, rank, num_ranks, v))
        order += [
            _chunk_action(BACKWARD, k, rank, num_ranks, v)
            for k in range(total - warmup, total)
        ]
        actions.append(order)
    return Schedule(
        name="interleaved",
        num_ranks=num_ranks,
        num_stages=num_ranks * v,
        num_pipes=1,
        num_microbatches=num_microbatches,
        placement=[[s % num_ranks for s in range(num_ranks * v)]],
        actions=actions,
        meta={"virtual_pipeline_size": v},
    )
