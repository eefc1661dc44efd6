"""Distributed runtime: exact equivalence with a single-process run, schedule order, no hang.

Each test spawns one gloo world and runs many configurations in it (groups are created and
destroyed per configuration), each with every combination of the data-parallel flags
(``cases.DDP_VARIANTS``), so the whole set stays within a few minutes on 2 cores. Every
world runs under NCCL's rules (the harness's NCCL-semantics mode); the last test shows that
mode reporting the deadlocks plain gloo forgives.
"""

from __future__ import annotations

import time

import pytest

from megatron_chimera.pipeline.nccl_semantics import TIMEOUT_ENV
from megatron_chimera.schedules import SCHEDULES

from .cases import (
    Case,
    run_cases,
    run_failing_rank,
    run_recompute_replays_dropout,
    run_replica_utilities,
)
from .harness import spawn_world
from .nccl_cases import run_early_collective, run_unprotected

pytestmark = pytest.mark.distributed

# the deadlock tests: a wait this long is a deadlock (the mode's default is 10 s); the two
# ranks reach their first exchange within a second of each other (after the group's set-up)
DEADLOCK_TIMEOUT = {TIMEOUT_ENV: "5"}
DIRECT = (("concat", "direct"),)
DOUBLING = (("concat", "forward-doubling"),)


def chimera_cases(d: int, concat_variants: bool = True) -> list[Case]:
    """Chimera with 2 pipes: basic unit, direct, forward doubling (with recompute), default.
    ``concat_variants``: all but the default in every data-parallel flag combination too (the
    D=8 world runs them in the defaults; the smaller worlds in all)."""
    variants = {"all_ddp_variants": concat_variants}
    return [
        Case("chimera", d, d, **variants),
        Case("chimera", d, 2 * d, DIRECT, **variants),
        Case("chimera", d, 2 * d, DOUBLING, recompute=True, **variants),
        Case("chimera", d, 2 * d),
    ]


def common_cases(d: int, one_way_variants: bool = True, concat_variants: bool = True
                 ) -> list[Case]:
    """GPipe, 1F1B, interleaved (v=2), Chimera, and split-backward schedules at pipeline size d.

    ``one_way_variants``: the one-direction schedules in every data-parallel flag combination
    too. With the whole world in one pipeline (W = 1) they reduce no gradient across ranks, so
    the combinations exercise only rank-local code: one world (D=2) runs them all, the larger
    ones the defaults. Chimera's stage replicas reduce across ranks at W = 1: always all."""
    one_way = {"all_ddp_variants": one_way_variants}
    return [
        Case("gpipe", d, d + 1, **one_way),
        Case("1f1b", d, 2 * d + 1, **one_way),
        Case("1f1b", d, d, recompute=True, **one_way),
        Case("interleaved", d, 2 * d, (("virtual_pipeline_size", 2),), **one_way),
        *chimera_cases(d, concat_variants),
        Case("1f1b", d, 2 * d, split_delay=2, **one_way),
        Case("chimera", d, 2 * d, DIRECT, split_delay=3, all_ddp_variants=concat_variants),
        Case("zb-h1", d, 2 * d, **one_way),
        Case("chimera-zb", d, 2 * d),
    ]


VARLEN_CASES = [Case("1f1b", 4, 8, varlen=True, all_ddp_variants=False),
                Case("chimera", 4, 8, varlen=True, all_ddp_variants=False)]
WORLD_8 = [
    *common_cases(8, one_way_variants=False, concat_variants=False),
    Case("chimera", 8, 8, (("pipes", 4),), all_ddp_variants=False),
    Case("chimera", 8, 16, (("pipes", 4),)),
    Case("chimera-zb", 8, 16, (("pipes", 4),)),
    Case("chimera", 8, 16, DIRECT, optimizer="adam"),
    Case("chimera", 8, 16, (("pipes", 4),), direction_groups=True, all_ddp_variants=False),
    # D=4 x W=2 and D=2 x W=4 in the same world
    Case("1f1b", 4, 8),
    *chimera_cases(4),
    Case("chimera-zb", 4, 8, direction_groups=True),
    Case("interleaved", 4, 8, (("virtual_pipeline_size", 2),), direction_groups=True),
    Case("chimera", 2, 4, DIRECT),
    Case("1f1b", 2, 4, split_delay=1),
    # packed variable-length micro-batches (3 shapes, sized per message, no handshake)
    *VARLEN_CASES,
]
WORLD_4 = [*common_cases(4, one_way_variants=False), Case("chimera", 2, 4, DIRECT),
           Case("gpipe", 2, 3),
           Case("chimera-zb", 2, 4), Case("chimera", 4, 8, loss_scale=2.0**12),
           Case("chimera", 4, 4, backward_halving=True, all_ddp_variants=False)]
WORLD_2 = [*common_cases(2), Case("zb-2p", 2, 5, all_ddp_variants=False)]  # 2D-1 warm-up F


# V-shaped pipelines (the turn a local hand-off): D=4 (W=1) and D=2 x W=2, each in one data-parallel
# flag combination but the first
WORLD_4_V = [
    Case("zbv", 4, 8), Case("v-half", 4, 8, all_ddp_variants=False),
    Case("bitpipe", 4, 8, all_ddp_variants=False), Case("bitpipe-zb", 4, 8, all_ddp_variants=False),
    Case("bitpipe-zb", 2, 4), Case("zbv", 2, 3, all_ddp_variants=False),
    Case("bitpipe", 2, 4, recompute=True, all_ddp_variants=False),
    # N = 3D, the collective plan: BitPipe-ZB reduces stage 6 at the end of the iteration and
    # the others when ready, in every data-parallel flag combination (overlapped reduction on
    # and off); unsplit BitPipe reduces every stage at the end
    Case("bitpipe-zb", 4, 12), Case("bitpipe", 4, 12, all_ddp_variants=False),
]


def _available(cases: list[Case]) -> list[Case]:
    return [c for c in cases if c.available()]


@pytest.mark.timeout(600)
def test_exact_world_of_8():
    """D=8 (W=1), D=4 x W=2, D=2 x W=4: losses, weights, replica identity, order, eval, for
    every data-parallel flag combination."""
    spawn_world(run_cases, 8, _available(WORLD_8), timeout_s=580)


@pytest.mark.timeout(300)
def test_exact_world_of_4():
    """D=4 (W=1) and D=2 x W=2."""
    spawn_world(run_cases, 4, _available(WORLD_4), timeout_s=280)


@pytest.mark.timeout(300)
def test_exact_v_shaped_world_of_4():
    """ZBV, V-Half, BitPipe, BitPipe-ZB at D=4 and D=2 x W=2 give the single-process losses
    and weights."""
    spawn_world(run_cases, 4, _available(WORLD_4_V), timeout_s=280)


@pytest.mark.timeout(150)
def test_exact_world_of_2():
    """D=2 (W=1)."""
    spawn_world(run_cases, 2, _available(WORLD_2), timeout_s=130)


def test_required_schedules_are_registered():
    """The exactness tests above cover every schedule and concatenation the runtime must run."""
    missing = [c.name for c in WORLD_8 + WORLD_4 + WORLD_2 + WORLD_4_V if not c.available()]
    assert not missing, f"schedules not available (their exactness is untested): {missing}"
    assert {"gpipe", "1f1b", "interleaved", "chimera", "chimera-zb", "zb-h1"} <= set(
        SCHEDULES
    )


@pytest.mark.timeout(90)
def test_failing_rank_stops_every_rank():
    """A rank raising mid-iteration makes every other rank exit non-zero, naming that rank."""
    start = time.monotonic()
    outcomes = spawn_world(run_failing_rank, 4, 2, timeout_s=75, pg_timeout_s=30,
                           kill_on_failure=False)
    elapsed = time.monotonic() - start
    hung = [o.rank for o in outcomes if o.exitcode is None]
    assert not hung, f"ranks {hung} hung ({elapsed:.0f} s)"
    for o in outcomes:
        assert o.exitcode != 0, f"rank {o.rank} exited 0 although rank 2 failed"
        assert "rank 2 (pipeline rank 2) failed in F0.2.2" in o.error, (
            f"rank {o.rank} does not name rank 2:\n{o.error}"
        )
    assert "injected failure" in outcomes[2].error


@pytest.mark.timeout(60)
def test_replica_utilities_and_layout_errors():
    """Broadcast makes replicas identical, the checker catches divergence, bad layouts fail."""
    spawn_world(run_replica_utilities, 4, timeout_s=50)


@pytest.mark.timeout(60)
def test_recompute_replays_dropout():
    """Activation recomputation restores the RNG: same masks, bitwise the same weights."""
    spawn_world(run_recompute_replays_dropout, 4, timeout_s=50)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("warm_up,safe_posting,reported", [
    # no connection warm-up: rank 0's first receive from rank 1 blocks the host (NCCL's
    # rendezvous) while rank 1's device sync waits for rank 0's next activation
    (False, True, "first exchange of"),
    # receives posted blind, two actions early: rank 0 prefetches B0's gradient before F0 has
    # sent the activation rank 1 needs to produce it; a device sync on rank 0 then hangs
    (True, False, "syncs the device before F0.0.0 while it receives g0.0.0 from rank 1"),
])
def test_nccl_semantics_report_the_deadlock_gloo_forgives(warm_up, safe_posting, reported):
    """1F1B, D=2 with one protection off: gloo alone runs it; under NCCL's rules every rank
    fails within seconds with a report naming the ranks and their operations."""
    plain = spawn_world(run_unprotected, 2, "1f1b", 4, warm_up, safe_posting, timeout_s=60,
                        nccl_semantics=False)
    assert all(o.exitcode == 0 for o in plain)
    start = time.monotonic()
    outcomes = spawn_world(run_unprotected, 2, "1f1b", 4, warm_up, safe_posting, timeout_s=90,
                           pg_timeout_s=60, kill_on_failure=False, env=DEADLOCK_TIMEOUT)
    elapsed = time.monotonic() - start
    assert all(o.exitcode not in (0, None) for o in outcomes), outcomes
    errors = "\n".join(o.error for o in outcomes)
    assert "NCCL-semantics deadlock: rank" in errors and reported in errors, errors[-2000:]
    assert "rank 1 is at:" in errors or "rank 0 is at:" in errors
    assert elapsed < 45, f"the deadlock took {elapsed:.0f} s to report"


@pytest.mark.timeout(120)
def test_nccl_semantics_report_a_sync_waiting_on_a_collective():
    """A gradient reduction issued before the rank's gradients are final: under NCCL's rules a
    device sync on that rank waits for the other member's reduction, which needs this rank's
    later work; the mode reports it within seconds, naming the group and the peer."""
    outcomes = spawn_world(run_early_collective, 2, timeout_s=90, pg_timeout_s=60,
                           kill_on_failure=False, env=DEADLOCK_TIMEOUT)
    assert all(o.exitcode not in (0, None) for o in outcomes), outcomes
    errors = "\n".join(o.error for o in outcomes)
    assert "NCCL-semantics deadlock: rank 0 syncs the device before" in errors, errors[-2000:]
    assert "to issue collective #" in errors and "of its group [0, 1]" in errors


@pytest.mark.timeout(150)
def test_chimera_with_fewer_microbatches_than_stages_equals_one_process():
    """Chimera at N = 2 < D = 4 (one micro-batch per pipe: the partial basic unit, e.g. two long
    sequences per iteration) trains 3 steps through the executor as one process does."""
    from .tp_cases import TPCase, run_tp_cases

    spawn_world(run_tp_cases, 4, [TPCase("gpt2", "chimera", 1, 4, 2)], timeout_s=140)
