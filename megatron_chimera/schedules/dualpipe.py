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

The DualPipe shapes come from one rule (:func:`~.pairing.slot_order`) (our derivation, Chimera's slot formula run over *all*
micro-batches of a pipe instead of units of D): in a pipe of S stages, micro-batch j (local
index) runs forward at slot ``s + 2j`` and backward at slot ``2S - 1 - s + 2j`` on the rank holding
stage s. On a rank, slots hold a forward of one pipe or chunk and a backward of the other at
once -- different micro-batches, so independent: that collision is the pair. Sorting by slot
gives the order: warm-up forwards, steady-state pairs, cool-down backwards. With a split
backward each W follows its B, except after the rank's last forward, where the Ws move to the
end (they fill the cool-down, as ZB-H1's and DualPipe's last steps do).
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
