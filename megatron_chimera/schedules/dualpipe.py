"""DualPipe, DualPipeV and Megatron's combined 1F1B in our IR, and the slot orders they share.

DeepSeek-V3 (§3.2.1) overlaps, on every rank, the forward of one micro-batch with the backward
of another (paired actions, :attr:`~.actions.Schedule.pairs`) so that expert parallelism's
all-to-all hides behind compute. Facts used here (from the paper and DeepSeek's DualPipe README;
no code of theirs):

* **DualPipe**: Chimera's two-pipe placement (rank r holds stage r of the down pipe and stage
  D-1-r of the up pipe, two weight copies), half the micro-batches in each direction, the
  backward split into B and W (zero bubble: W fills), F&B pairs in the steady state, at most
  about D+1 live activations per rank.
* **DualPipeV** ("cut in half"): one V-shaped pipe of 2D half-size stages, rank r holding stages
  r and 2D-1-r (one weight copy), all micro-batches in one direction, F&B pairs between its two
  chunks.
* **Combined 1F1B** (Megatron-core, ``--overlap-moe-expert-parallel-comm``): interleaved 1F1B with
  virtual stages and one extra warm-up forward, so that each steady-state forward finds an
  independent backward to pair with (:func:`~.pairing.extra_warmup_pairs`).

DualPipe and DualPipeV are the slot order of their placement (:func:`~.pairing.slot_order`, our
derivation: Chimera's slot formula run over all micro-batches of a pipe; a slot holding a forward
and a backward of different micro-batches is a pair). They are built as published, F&B pairs
only, whatever the costs; Chimera-EP (``--overlap-moe-expert-parallel-comm`` on Chimera) starts
from the same slot order and also pairs its warm-up forwards and cool-down backwards, and its
lone forwards and backwards with deferred Ws, when that helps under the costs
(:func:`~.pairing.with_overlap`).
"""

from __future__ import annotations

from megatron_chimera.schedules.actions import Schedule
from megatron_chimera.schedules.chimera import chimera_placement
from megatron_chimera.schedules.interleaved import interleaved
from megatron_chimera.schedules.pairing import extra_warmup_pairs, slot_order
from megatron_chimera.schedules.vshape import v_placement


def _check(name: str, num_ranks: int, num_microbatches: int, pipes: int) -> None:
    if num_ranks < 2 or num_ranks % 2:
        raise ValueError(f"--pipeline-model-parallel-size must be even and >= 2 for {name}, "
                         f"got {num_ranks}")
    if num_microbatches < pipes or num_microbatches % pipes:
        raise ValueError(f"--num-microbatches must be a positive multiple of {pipes} for "
                         f"{name}, got {num_microbatches}")


def dualpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    """DualPipe (module docstring): two pipes on Chimera's placement, split backward, F&B
    pairs."""
    _check("dualpipe", num_ranks, num_microbatches, 2)
    return slot_order("dualpipe", num_ranks, num_ranks, chimera_placement(num_ranks, 2),
                      num_microbatches, split_backward=True)


def dualpipev(num_ranks: int, num_microbatches: int) -> Schedule:
    """DualPipeV (module docstring): one V pipe of 2D half stages, split backward, F&B pairs."""
    _check("dualpipev", num_ranks, num_microbatches, 1)
    return slot_order("dualpipev", num_ranks, 2 * num_ranks, [v_placement(num_ranks)],
                      num_microbatches, split_backward=True)


def combined_1f1b(num_ranks: int, num_microbatches: int,
                  virtual_pipeline_size: int = 2) -> Schedule:
    """Megatron's combined 1F1B: interleaved 1F1B with ``virtual_pipeline_size`` chunks, one
    extra warm-up forward, steady-state F&B pairs."""
    base = interleaved(num_ranks, num_microbatches, virtual_pipeline_size)
    paired = extra_warmup_pairs(base)
    paired.name = "combined-1f1b"
    return paired
