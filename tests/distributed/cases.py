"""Per-rank bodies of the distributed runtime tests (run inside :func:`harness.spawn_world`).

One spawned world runs many configurations in sequence: for each case the rank creates the
model-parallel groups, trains the toy model for three steps with the executor, checks losses and
weights against a single-process run, checks replica identity, runs one forward-only iteration
and destroys the groups.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_chimera import parallel_state
from megatron_chimera.config import ConfigError, DDPConfig, OptimizerConfig
from megatron_chimera.distributed.data_parallel import build_data_parallel
from megatron_chimera.distributed.grad_sync import assert_replicas_identical, broadcast_stage_params
from megatron_chimera.optimizer import get_data_parallel_optimizer
from megatron_chimera.pipeline.executor import Gradients, PipelineExecutor, StageWork
from megatron_chimera.pipeline.topology import PipelineTopology
from megatron_chimera.schedules import SCHEDULES, build_schedule
from megatron_chimera.schedules.actions import FORWARD, Schedule
from megatron_chimera.schedules.chimera import chimera_backward_halving
from megatron_chimera.schedules.validate import validate
from tests.helpers.schedules import with_weight_actions

from .toy_model import (
    HIDDEN,
    MICRO_BATCH,
    SEQ,
    build_stage,
    forward_step,
    make_batch,
    make_varlen_batch,
    reference_training,
)

STEPS = 3
RTOL = 1e-5  # fp32: the runs differ only in summation order (~1e-7 relative per operation)


@dataclass(frozen=True)
class Case:
    """One configuration: schedule name and options, D, N, and how to run it."""

    schedule: str
    pipeline_size: int
    num_microbatches: int
    options: tuple[tuple[str, Any], ...] = ()
    recompute: bool = False
    optimizer: str = "sgd"
    split_delay: int | None = None  # add W actions to a non-split schedule, `delay` actions later
    direction_groups: bool = False  # one p2p group per direction (the NCCL layout)
    loss_scale: float | None = None  # fp16-style static loss scale through the scale_loss hook
    all_ddp_variants: bool = True  # every data-parallel flag combination, else the defaults
    # Chimera's backward halving: each of the N micro-batches runs as two half-size ones (2N,
    # forward doubling's order); compared with the single-process run of the N whole ones
    backward_halving: bool = False
    # packed variable-length micro-batches (one row of 3, 7 or 5 tokens): every message sized
    # by its micro-batch (executor.run's microbatch_tokens)
    varlen: bool = False
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def name(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options)
        split = f" +W(delay {self.split_delay})" if self.split_delay is not None else ""
        rec = " recompute" if self.recompute else ""
        groups = " p2p-direction-groups" if self.direction_groups else ""
        scale = f" loss-scale {self.loss_scale:g}" if self.loss_scale else ""
        halving = " backward-halving" if self.backward_halving else ""
        varlen = " varlen" if self.varlen else ""
        return (f"{self.schedule}[{opts}] D={self.pipeline_size} N={self.num_microbatches}"
                f"{split}{rec}{groups}{scale}{halving}{varlen} {self.optimizer}")

    @property
    def pieces(self) -> int:
        """Executed micro-batches per whole one (2 with backward halving)."""
        return 2 if self.backward_halving else 1

    @property
    def ddp_variants(self) -> tuple[DDPConfig, ...]:
        """The data-parallel flag combinations this case runs."""
        return DDP_VARIANTS if self.all_ddp_variants else DDP_VARIANTS[:1]

    def available(self) -> bool:
        """Whether the schedule generator (and its options) exist in this tree."""
        if self.schedule not in SCHEDULES:
            return False
        try:
            self.build()
        except ValueError:
            return False
        return True

    def build(self) -> Schedule:
        """The schedule of this case (with W actions added when ``split_delay`` is set)."""
        if self.backward_halving:
            return chimera_backward_halving(self.pipeline_size, self.num_microbatches)
        schedule = build_schedule(self.schedule, self.pipeline_size, self.num_microbatches,
                                  **dict(self.options))
        if self.split_delay is not None:
            schedule = with_weight_actions(schedule, self.split_delay)
        return schedule


class SGD:
    """SGD with momentum (torch.optim.SGD's update), written out so that worker processes do not
    import torch._dynamo (seconds per process on a loaded machine)."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float = 0.05, momentum: float = 0.9):
        self.params, self.lr, self.momentum = params, lr, momentum
        self.buffers: dict[int, torch.Tensor] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for p in self.params:
            if p.grad is None:
                continue
            buf = self.buffers.get(id(p))
            if buf is None:
                buf = self.buffers[id(p)] = p.grad.clone()
            else:
                buf.mul_(self.momentum).add_(p.grad)
            p.add_(buf, alpha=-self.lr)


class Adam(SGD):
    """Adam (torch.optim.Adam's update without weight decay)."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float = 0.01, betas=(0.9, 0.999),
                 eps: float = 1e-8):
        super().__init__(params, lr)
        self.betas, self.eps, self.t = betas, eps, 0
        self.moments: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        b1, b2 = self.betas
        for p in self.params:
            if p.grad is None:
                continue
            m, v = self.moments.setdefault(id(p), (torch.zeros_like(p), torch.zeros_like(p)))
            m.mul_(b1).add_(p.grad, alpha=1 - b1)
            v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
            denom = (v / (1 - b2**self.t)).sqrt_().add_(self.eps)
            p.addcdiv_(m, denom, value=-self.lr / (1 - b1**self.t))


def make_optimizer(kind: str):
    """Factory of an elementwise optimizer applied identically in both runs."""
    if kind == "sgd":
        return SGD
    if kind == "adam":
        return Adam
    raise ValueError(kind)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _check_close(values: list[float], reference: list[float], what: str) -> None:
    assert len(values) == len(reference), f"{what}: {len(values)} values, expected {len(reference)}"
    for i, (v, r) in enumerate(zip(values, reference)):
        if abs(v - r) > RTOL * max(abs(r), 1e-12):
            raise AssertionError(f"{what}[{i}]: {v!r} != reference {r!r}")


BUCKET_ELEMENTS = 40  # about one toy layer (72 elements) per bucket
# Megatron's data-parallel flags: overlapped bucketed reduction (tiny buckets, so stages have
# several) x the distributed optimizer (with the background parameter all-gather when reduction
# overlaps too). The third flag, --accumulate-allreduce-grads-in-fp32, is on in every variant:
# for these fp32 models it leaves the buffers fp32 either way
# (tests/unit/distributed/test_grad_buffer.py checks that, and what it changes for 16-bit models).
DDP_VARIANTS = tuple(
    DDPConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=overlap,
              bucket_size=BUCKET_ELEMENTS if overlap else None,
              use_distributed_optimizer=sharded, overlap_param_gather=sharded and overlap)
    for overlap in (False, True) for sharded in (False, True)
)


def ddp_name(ddp: DDPConfig) -> str:
    """Short name of a flag combination for failure messages."""
    flags = [name for name, on in (("fp32-grads", ddp.grad_reduce_in_fp32),
                                   ("overlap-grad-reduce", ddp.overlap_grad_reduce),
                                   ("distributed-optimizer", ddp.use_distributed_optimizer),
                                   ("overlap-param-gather", ddp.overlap_param_gather)) if on]
    return "+".join(flags) or "defaults"


def build_training(case: Case, schedule: Schedule, prank: int, ddp: DDPConfig):
    """Stage modules, gradient synchronizer and Megatron optimizer (the case's elementwise
    optimizer inside) for one flag combination."""
    stages = {s: build_stage(s, schedule.num_stages) for s in schedule.stages_of_rank(prank)}
    config = OptimizerConfig(optimizer=case.optimizer, clip_grad=0.0, weight_decay=0.0)
    make = make_optimizer(case.optimizer)
    data_parallel = build_data_parallel(ddp, stages)
    optimizer = get_data_parallel_optimizer(
        config, data_parallel,
        make_inner=lambda groups: make([p for g in groups for p in g["params"]]))
    return stages, data_parallel.grad_sync, optimizer


def _check_sharding(stages, grad_sync, optimizer, ddp: DDPConfig, case: Case) -> None:
    """The flags took effect: buckets were cut, the distributed optimizer holds a shard only."""
    for buffer in grad_sync.buffers.all_buffers():
        largest = max(p.numel() for p in buffer.params)
        for bucket in buffer.buckets:
            held = sum(buffer.params[i].numel() for i in bucket.param_indices)
            if ddp.bucket_size is not None and held >= ddp.bucket_size + largest:
                raise AssertionError(f"a bucket of {held} elements: buckets were not cut")
    held = sum(p.numel() for s in stages.values() for p in s.parameters())
    mains = sum(m.numel() for m in optimizer.main_params)
    replicas = min(len(parallel_state.get_stage_replica_ranks(s)) for s in stages)
    if ddp.use_distributed_optimizer and replicas > 1 and mains >= held:
        raise AssertionError(f"distributed optimizer holds {mains} of {held} elements")


def reference_key(case: Case, world_size: int) -> tuple:
    """What the single-process run of ``case`` depends on: N, W, the optimizer, the batches."""
    return (case.num_microbatches, world_size // case.pipeline_size, case.optimizer, case.varlen)


def compute_reference(key: tuple):
    """The single-process run (:func:`toy_model.reference_training`) of a :func:`reference_key`."""
    n, w, optimizer, varlen = key
    return reference_training(STEPS, n, w, make_optimizer(optimizer),
                              make=make_varlen_batch if varlen else make_batch)


def shared_references(rank: int, world_size: int, cases: list[Case]) -> dict[tuple, Any]:
    """The single-process run of every distinct :func:`reference_key` of ``cases``, each computed
    once in the world (key i on rank i % world, in parallel) and broadcast from there: every
    rank would otherwise repeat the same sequential run for every case (on 2 cores, about a
    third of the runtime tests' time)."""
    keys = list(dict.fromkeys(reference_key(case, world_size) for case in cases))
    out = {}
    for i, key in enumerate(keys):
        box = [compute_reference(key) if i % world_size == rank else None]
        torch.distributed.broadcast_object_list(box, src=i % world_size)
        out[key] = box[0]
    return out


def run_case(rank: int, world_size: int, case: Case, reference=None) -> None:
    """Train 3 steps with the executor and compare everything with the single-process run
    (``reference``, or computed here), for every data-parallel flag combination."""
    schedule = case.build()
    validate(schedule)
    d = case.pipeline_size
    parallel_state.initialize_model_parallel(
        d, schedule.placement, schedule.num_stages, timeout=datetime.timedelta(seconds=60),
        p2p_direction_groups=case.direction_groups,
    )
    try:
        prank = parallel_state.get_pipeline_model_parallel_rank()
        if case.direction_groups:
            pipe, stage = parallel_state.replicas_of_this_rank()[0]
            peer = parallel_state.get_pipeline_next_rank(pipe, stage)
            if peer is None:
                peer = parallel_state.get_pipeline_prev_rank(pipe, stage)
            if parallel_state.get_p2p_group(rank, peer) is None:
                raise AssertionError(f"no p2p group for {rank} -> {peer}")
        if reference is None:
            reference = compute_reference(reference_key(case, world_size))
        for ddp in case.ddp_variants:
            try:
                _train_and_check(rank, world_size, case, schedule, prank, ddp, reference)
            except Exception as exc:
                raise AssertionError(f"[{ddp_name(ddp)}] {exc}") from exc
    finally:
        parallel_state.destroy_model_parallel()


def _batches(case: Case, step: int, dp: int) -> list[dict[str, torch.Tensor]]:
    """The executed micro-batches: the whole ones, or each cut into ``case.pieces`` in turn."""
    make = make_varlen_batch if case.varlen else make_batch
    whole = [make(step, dp, m) for m in range(case.num_microbatches)]
    k = case.pieces
    return [{key: t.chunk(k)[i] for key, t in b.items()} for b in whole for i in range(k)]


def _tokens(case: Case, batches: list[dict[str, torch.Tensor]]) -> list[int] | None:
    """The micro-batches' message lengths of a variable-length case (known to every rank)."""
    return [b["tokens"].shape[1] for b in batches] if case.varlen else None


def _whole_losses(case: Case, losses: list[float]) -> list[float]:
    """Per whole micro-batch: the mean of its pieces' losses (equal token counts)."""
    k = case.pieces
    return [sum(losses[i:i + k]) / k for i in range(0, len(losses), k)]


def _train_and_check(rank: int, world_size: int, case: Case, schedule: Schedule, prank: int,
                     ddp: DDPConfig, reference) -> None:
    ref_losses, ref_model, ref_eval = reference
    n = case.num_microbatches * case.pieces  # executed micro-batches
    w = world_size // case.pipeline_size
    dp = parallel_state.get_data_parallel_rank()
    stages, grad_sync, optimizer = build_training(case, schedule, prank, ddp)
    _check_sharding(stages, grad_sync, optimizer, ddp, case)
    # start together: on a loaded machine a rank still computing the reference could otherwise
    # look, to the NCCL-semantics mode's 10 s deadlines, like a peer that never arrives
    torch.distributed.barrier()
    executor = PipelineExecutor(
        schedule, PipelineTopology.from_parallel_state(),
        StageWork(stages, forward_step,
                  (SEQ, 1 if case.varlen else MICRO_BATCH // case.pieces, HIDDEN),
                  torch.float32, recompute=case.recompute),
        Gradients(loss_scale_divisor=n * w, grad_sync=grad_sync,
                  scale_loss=(lambda loss: loss * case.loss_scale) if case.loss_scale else None))
    results = []
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        batches = _batches(case, step, dp)
        result = executor.run(batches, microbatch_tokens=_tokens(case, batches))
        if result.executed != schedule.actions[prank]:
            raise AssertionError(f"pipeline rank {prank}: executed order differs from schedule")
        if case.loss_scale:  # unscale (a power of two: exact)
            for buffer in grad_sync.buffers.all_buffers():
                buffer.grad_data.div_(case.loss_scale)
        optimizer.step()
        results.append(result)
    gathered = executor.gather(results)  # every step at once, as at a log interval
    for step, figures in enumerate(gathered or []):
        _check_close(_whole_losses(case, [x["lm loss"] for x in figures.losses]),
                     ref_losses[step], f"step {step} losses")
        busy = figures.busy_seconds_per_rank
        if len(busy) != world_size or min(busy) <= 0:
            raise AssertionError(f"busy seconds per rank: {busy}")
    if (gathered is None) != (rank != world_size - 1):
        raise AssertionError(f"rank {rank}: gathered {gathered is not None}")
    optimizer.finish_param_sync()
    if ddp == DDP_VARIANTS[0]:  # the other variants: every rank's weights against the reference
        assert_replicas_identical(stages)
    _check_weights(stages, ref_model)
    batches = _batches(case, STEPS, dp)
    result = executor.run(batches, forward_only=True, microbatch_tokens=_tokens(case, batches))
    forwards = [a for a in schedule.actions[prank] if a.kind == FORWARD]
    if result.executed != forwards:
        raise AssertionError(f"pipeline rank {prank}: forward-only order differs")
    for figures in executor.gather([result]) or []:
        _check_close(_whole_losses(case, [x["lm loss"] for x in figures.losses]), ref_eval,
                     "forward-only losses")
    grad_sync.buffers.remove_hooks()


def _check_weights(stages: dict[int, torch.nn.Module], ref_model: torch.nn.Module) -> None:
    for s, module in stages.items():
        for layer_id, layer in zip(module.layer_ids, module.layers):
            ref = ref_model.layers[layer_id]
            for name in ("weight", "bias"):
                err = _rel_err(getattr(layer, name).detach(), getattr(ref, name).detach())
                if err > RTOL:
                    raise AssertionError(f"stage {s} layer {layer_id} {name}: rel. error {err:.2e}")
        if module.word_embeddings is not None:
            err = _rel_err(module.word_embeddings.detach(), ref_model.word_embeddings.detach())
            if err > RTOL:
                raise AssertionError(f"stage {s} tied embedding copy: rel. error {err:.2e}")


def run_each(rank: int, world_size: int, cases: list[Any], run) -> None:
    """``run(rank, world_size, case)`` for every case in sequence; name the failing case."""
    for case in cases:
        try:
            run(rank, world_size, case)
        except Exception as exc:
            raise AssertionError(f"case {case.name}: {exc}") from exc


def run_cases(rank: int, world_size: int, cases: list[Case]) -> None:
    """Run every case in sequence in this world (against one-process runs computed once in the
    world); name the failing case."""
    references = shared_references(rank, world_size, cases)
    run_each(rank, world_size, cases, lambda rank, world_size, case: run_case(
        rank, world_size, case, references[reference_key(case, world_size)]))


def run_failing_rank(rank: int, world_size: int, failing_rank: int) -> None:
    """1F1B iteration in which ``failing_rank`` raises in its third forward."""
    schedule = build_schedule("1f1b", world_size, 8)
    parallel_state.initialize_model_parallel(
        world_size, schedule.placement, schedule.num_stages,
        timeout=datetime.timedelta(seconds=30),
    )
    prank = parallel_state.get_pipeline_model_parallel_rank()
    stages = {s: build_stage(s, schedule.num_stages) for s in schedule.stages_of_rank(prank)}
    calls = {"n": 0}

    def flaky_forward_step(batch, model):
        calls["n"] += 1
        if rank == failing_rank and calls["n"] == 3:
            raise RuntimeError("injected failure")
        return forward_step(batch, model)

    executor = PipelineExecutor(
        schedule, PipelineTopology.from_parallel_state(),
        StageWork(stages, flaky_forward_step, (SEQ, MICRO_BATCH, HIDDEN), torch.float32),
        Gradients(loss_scale_divisor=8,
                  grad_sync=build_data_parallel(DDPConfig(), stages).grad_sync))
    executor.run([make_batch(0, 0, m) for m in range(8)])


def _check_megatron_getters(rank: int) -> None:
    """Megatron's public parallel_state getters at W=2, D=2 (global rank = pipeline x 2 + dp)."""
    import torch.distributed as dist

    ps = parallel_state
    prank, dp = divmod(rank, 2)
    checks = {
        "pipeline world size": (ps.get_pipeline_model_parallel_world_size(), 2),
        "pipeline rank": (ps.get_pipeline_model_parallel_rank(), prank),
        "pipeline group": (dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()),
                           [dp, 2 + dp]),
        "data-parallel world size": (ps.get_data_parallel_world_size(), 2),
        "data-parallel rank": (ps.get_data_parallel_rank(), dp),
        "data-parallel group": (dist.get_process_group_ranks(ps.get_data_parallel_group()),
                                [2 * prank, 2 * prank + 1]),
        "tensor world size and rank": ((ps.get_tensor_model_parallel_world_size(),
                                        ps.get_tensor_model_parallel_rank()), (1, 0)),
        "first/last stage": ((ps.is_pipeline_first_stage(0), ps.is_pipeline_first_stage(1),
                              ps.is_pipeline_last_stage(1), ps.is_pipeline_last_stage(0)),
                             (True, False, True, False)),
        "last rank": (ps.get_pipeline_model_parallel_last_rank(), 2 + dp),
    }
    # one group per distinct rank set: Chimera's stages 0 and 1 are held by the same four ranks
    checks["stage groups shared"] = (ps.get_stage_replica_group(0) is ps.get_stage_replica_group(1),
                                     True)
    wrong = {k: v for k, v in checks.items() if v[0] != v[1]}
    if wrong:
        raise AssertionError(f"rank {rank}: getters (got, expected): {wrong}")


def run_replica_utilities(rank: int, world_size: int) -> None:
    """broadcast_stage_params repairs diverged replicas; assert_replicas_identical detects them;
    bad layouts raise ConfigError; Megatron's getters describe the layout."""
    schedule = build_schedule("chimera", 2, 2)
    timeout = datetime.timedelta(seconds=30)
    for bad in ({"pipeline_model_parallel_size": 3}, {"tensor_model_parallel_size": 3},
                {"tensor_model_parallel_size": 4}):
        kwargs = {"pipeline_model_parallel_size": 2, **bad}
        try:
            parallel_state.initialize_model_parallel(
                placement=schedule.placement, num_stages=schedule.num_stages, timeout=timeout,
                **kwargs,
            )
        except ConfigError:
            continue
        raise AssertionError(f"initialize_model_parallel accepted {kwargs}")
    parallel_state.initialize_model_parallel(2, schedule.placement, schedule.num_stages,
                                             timeout=timeout)
    try:
        _check_megatron_getters(rank)
        prank = parallel_state.get_pipeline_model_parallel_rank()
        stages = {s: build_stage(s, 2) for s in schedule.stages_of_rank(prank)}
        assert_replicas_identical(stages)
        if rank != 0:  # diverge every replica but those on rank 0
            with torch.no_grad():
                for module in stages.values():
                    for p in module.parameters():
                        p.add_(float(rank))
        try:
            assert_replicas_identical(stages)
        except AssertionError:
            pass
        else:
            raise AssertionError("assert_replicas_identical missed diverged replicas")
        broadcast_stage_params(stages)
        assert_replicas_identical(stages)
    finally:
        parallel_state.destroy_model_parallel()


def _train_with_dropout(rank: int, schedule: Schedule, recompute: bool) -> list[torch.Tensor]:
    """Two steps of the toy model with dropout; returns this rank's final parameters."""
    prank = parallel_state.get_pipeline_model_parallel_rank()
    stages = {s: build_stage(s, schedule.num_stages, dropout=0.3)
              for s in schedule.stages_of_rank(prank)}
    data_parallel = build_data_parallel(DDPConfig(), stages)
    grad_sync = data_parallel.grad_sync
    optimizer = get_data_parallel_optimizer(
        OptimizerConfig(optimizer="sgd", clip_grad=0.0, weight_decay=0.0), data_parallel,
        make_inner=lambda groups: SGD([p for g in groups for p in g["params"]]))
    executor = PipelineExecutor(
        schedule, PipelineTopology.from_parallel_state(),
        StageWork(stages, forward_step, (SEQ, MICRO_BATCH, HIDDEN), torch.float32,
                  recompute=recompute),
        Gradients(loss_scale_divisor=schedule.num_microbatches, grad_sync=grad_sync))
    torch.manual_seed(1234 + rank)
    for step in range(2):
        optimizer.zero_grad()
        executor.run([make_batch(step, 0, m) for m in range(schedule.num_microbatches)])
        optimizer.step()
    return [p.detach().clone() for s in sorted(stages) for p in stages[s].parameters()]


def run_recompute_replays_dropout(rank: int, world_size: int) -> None:
    """Recomputation replays the forward's dropout masks: weights equal the stored-activation
    run bitwise (a recompute that drew new masks would back-propagate through other ones)."""
    schedule = build_schedule("chimera", world_size, 2 * world_size)
    parallel_state.initialize_model_parallel(
        world_size, schedule.placement, schedule.num_stages, timeout=datetime.timedelta(seconds=30)
    )
    try:
        stored = _train_with_dropout(rank, schedule, recompute=False)
        recomputed = _train_with_dropout(rank, schedule, recompute=True)
    finally:
        parallel_state.destroy_model_parallel()
    for i, (a, b) in enumerate(zip(stored, recomputed)):
        if not torch.equal(a, b):
            raise AssertionError(f"parameter {i}: recomputation changed the result")
