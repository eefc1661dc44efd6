"""Schedules with paired F&B actions (MoE all-to-all overlap) run on the executor and give the
single-process losses and weights. On toy stages (no all-to-all) a pair's halves still run
through the paired runtime (pipeline/overlap.py) but one after the other: this checks that the
lowered paired lists -- both receives before the pair, both sends after it -- execute under
NCCL's rules. On emulated MoE stages the halves' all-to-alls overlap (moe_overlap_cases)."""

from __future__ import annotations

import pytest

from .cases import Case, run_cases
from .harness import spawn_world

pytestmark = pytest.mark.distributed
OVERLAP = (("overlap_moe_expert_parallel_comm", True),)

WORLD_4_PAIRED = [
    Case("dualpipe", 4, 8, all_ddp_variants=False),
    Case("combined-1f1b", 4, 8, all_ddp_variants=False),
    Case("chimera-zb", 4, 8, OVERLAP, all_ddp_variants=False),
    Case("dualpipev", 2, 4, all_ddp_variants=False),
]


@pytest.mark.timeout(240)
def test_paired_schedules_are_exact_on_a_world_of_4():
    """DualPipe, combined 1F1B, Chimera-ZB with --overlap-moe-expert-parallel-comm (D=4) and
    DualPipeV (D=2 x W=2) give the single-process losses and weights."""
    spawn_world(run_cases, 4, WORLD_4_PAIRED, timeout_s=220)


@pytest.mark.timeout(150)
def test_overlapped_pairs_on_emulated_moe_stages():
    """Chimera D=2 x W=2, EP=2, emulated MoE stages: overlap on = overlap off = one process, and
    every EP rank issues the pairs' all-to-alls in one order (moe_overlap_cases)."""
    from .moe_overlap_cases import run_overlap_equivalence

    spawn_world(run_overlap_equivalence, 4, timeout_s=130)


@pytest.mark.timeout(60)
def test_mismatched_all_to_all_order_is_caught():
    """A rank that interleaves a pair's halves in another order than its EP peer fails on both
    ranks, naming the all-to-all (moe_overlap_cases)."""
    from .moe_overlap_cases import run_order_mismatch

    spawn_world(run_order_mismatch, 2, timeout_s=50)


@pytest.mark.timeout(150)
def test_overlapped_pairs_on_real_moe_stages():
    """Chimera D=2 x W=2, EP=2, a tiny GPT with real MoE layers (alltoall dispatcher): overlap
    on = overlap off (bitwise) = one process, the real all-to-alls interleave in one order on
    every EP rank; with dropout and full recomputation overlap on = off (moe_paired_cases)."""
    from .moe_paired_cases import run_real_moe_overlap

    spawn_world(run_real_moe_overlap, 4, timeout_s=130)
