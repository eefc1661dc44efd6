"""Performance model: predicted iteration time of a training layout, by running the simulator.

The paper's Eq. (1) writes the iteration time of Chimera's basic unit as
``T = (F_t + Comm_p2p) C_f + (B_t + Comm_p2p) C_b + max_i Comm_unoverlapped(i)``. Rather than a
closed form per schedule, this model builds the schedule (data), derives a
:class:`~megatron_chimera.schedules.simulate.CostModel` for it -- per-stage forward / backward /
weight-gradient times, one point-to-point alpha-beta message time, the stage-replica all-reduce
over ``2f W`` replicas with Rabenseifner's alpha-beta cost -- and lets the one simulator cost it,
eager gradient synchronisation included. With zero communication and uniform stages this is
exactly Eq. (1) (:func:`chimera_eq1_time`; checked by the tests).

Stage times come from :class:`AnalyticCompute` (each kernel priced by its shape or bytes,
:mod:`.operators`) or measured timings (:mod:`.profile`), through :class:`ComputeCosts`.

With tensor parallelism (``layout.T``) every GEMM is priced at its ``1/T`` shape and the
stage's tensor-parallel collectives (on the link the T consecutive ranks share; none in W) are
added to its forward and backward; buckets, optimizer state, activations and messages are per
tensor-parallel rank. Recomputation is ``full`` or ``selective``; messages and collectives go
device-direct (NCCL) or host-staged (gloo) as the profile says, exchanged as the plan's runtime
does (``TrainingPlan.runtime``); :mod:`.moe_costs` prices MoE layers and their all-to-alls.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Protocol

from megatron_chimera.config import ConfigError
from megatron_chimera.layout import ParallelLayout
from megatron_chimera.model.memory import bytes_per_parameter
from megatron_chimera.schedules.actions import BACKWARD, FORWARD, Schedule
from megatron_chimera.schedules.costs import StageCosts
from megatron_chimera.schedules.simulate import CostModel, SimResult, simulate
from megatron_chimera.tuning.analytic_costs import (
    ModelSpec,
    StagePiece,
    activation_message_bytes,
    check_tensor_parallel,
    partition_stages,
    pipeline_gather_seconds,
    stage_parameters,
    tensor_parallel_comm_seconds,
)
from megatron_chimera.tuning.hardware import HardwareProfile, LinkProfile
from megatron_chimera.tuning.moe_costs import (
    check_expert_parallel,
    expert_gradient_bytes_saved,
    moe_extra_activation_bytes,
    moe_layer_count,
    moe_mlp_ops,
    plan_expert_parallel_seconds,
    without_dense_mlp,
)
from megatron_chimera.tuning.operators import (
    Ops,
    attention_core_forward,
    check_recompute,
    embedding_ops,
    head_ops,
    layer_backward_ops,
    layer_forward_ops,
    layer_shapes,
    ops_seconds,
    optimizer_bytes_per_parameter,
)
from megatron_chimera.tuning.precision import check_fp8, fp8_ops, fp8_weight_cast_bytes
from megatron_chimera.tuning.rank_memory import (
    RankMemory,
    rank_memory,
    slice_cache_bytes,
    sliced_rank_memory,
)
from megatron_chimera.tuning.training_plan import TrainingPlan


@dataclass(frozen=True)
class StageTimes:
    """Seconds of one micro-batch through one stage: forward, whole backward, its weight part."""

    forward: float
    backward: float
    weight: float


class ComputeCosts(Protocol):
    """Source of per-stage compute times (analytic or measured)."""

    def stage_times(self, piece: StagePiece, micro_batch: int, recompute: bool) -> StageTimes:
        """Times of one micro-batch through the stage ``piece``."""
        ...


@dataclass(frozen=True)
class AnalyticCompute:
    """Stage times from the stage's kernels (:mod:`megatron_chimera.tuning.operators`): every
    GEMM by its shape on the profile's roofline, every memory-bound kernel by its bytes."""

    spec: ModelSpec
    hardware: HardwareProfile

    def stage_times(self, piece: StagePiece, micro_batch: int, recompute: bool) -> StageTimes:
        """One micro-batch through the whole stage (T = 1), full recomputation or none."""
        return self.rank_stage_times(piece, micro_batch, "full" if recompute else None)

    def rank_stage_times(self, piece: StagePiece, micro_batch: int, recompute: str | None,
                         tensor_parallel: int = 1, sequence_parallel: bool = False,
                         expert_parallel: int = 1) -> StageTimes:
        """One micro-batch through the stage on one of ``tensor_parallel`` ranks (compute only;
        the collectives are the caller's), with ``recompute`` None, ``full`` or ``selective``;
        MoE layers with ``experts / expert_parallel`` experts per rank (cached: the tuner asks
        for the same stage many times)."""
        return _rank_stage_times(self, piece, micro_batch, recompute, tensor_parallel,
                                 sequence_parallel, expert_parallel)

    def _price(self, piece: StagePiece, micro_batch: int, recompute: str | None,
               tensor_parallel: int, sequence_parallel: bool,
               expert_parallel: int = 1) -> StageTimes:
        check_recompute(recompute)
        cfg = self.spec.config
        shapes = layer_shapes(cfg, micro_batch, tensor_parallel,
                              sequence_parallel and tensor_parallel > 1)
        forward_layer = layer_forward_ops(cfg, shapes)
        backward_layer = layer_backward_ops(cfg, shapes)
        if recompute == "full":
            backward_layer = backward_layer + forward_layer
        elif recompute == "selective":
            backward_layer = backward_layer + attention_core_forward(cfg, shapes)
        dtype, width, fp8 = cfg.params_dtype, cfg.dtype_bytes, self.spec.fp8

        def price(ops: Ops) -> tuple[float, float]:  # the FP8 linears under --fp8-format
            return ops_seconds(self.hardware, fp8_ops(fp8, ops, self.hardware, width), dtype)
        forward_s, _ = price(forward_layer)
        backward_s, weight_s = price(backward_layer)
        n, n_moe = piece.num_layers, moe_layer_count(cfg, piece)
        forward, backward, weight = ((n - n_moe) * forward_s, (n - n_moe) * backward_s,
                                     (n - n_moe) * weight_s)
        if n_moe:
            moe_f, moe_b = moe_mlp_ops(cfg, shapes, expert_parallel, tensor_parallel)
            moe_forward = without_dense_mlp(forward_layer.times(1)) + moe_f
            moe_backward = without_dense_mlp(layer_backward_ops(cfg, shapes)) + moe_b
            if recompute == "full":
                moe_backward = moe_backward + moe_forward
            elif recompute == "selective":
                moe_backward = moe_backward + attention_core_forward(cfg, shapes)
            forward += n_moe * price(moe_forward)[0]
            b, w = price(moe_backward)
            backward, weight = backward + n_moe * b, weight + n_moe * w
        ends = []
        if piece.pre_process:
            ends.append(embedding_ops(cfg, shapes))
        if piece.post_process:
            ends.append(head_ops(cfg, self.spec.family, shapes, tensor_parallel))
        for f_ops, b_ops in ends:
            forward += price(f_ops)[0]
            b, w = price(b_ops)
            backward, weight = backward + b, weight + w
        return StageTimes(forward, backward, weight)

    def optimizer_step_s(self, parameters: float) -> float:
        """Adam's memory-bound step over ``parameters`` (this rank's share)."""
        per = (optimizer_bytes_per_parameter(self.spec.config.params_dtype)
               + fp8_weight_cast_bytes(self.spec.fp8))  # FP8: the weights' casts after it
        return parameters * per / self.hardware.memory_bytes_per_s()


@functools.lru_cache(maxsize=4096)
def _rank_stage_times(compute: AnalyticCompute, piece: StagePiece, micro_batch: int,
                      recompute: str | None, tensor_parallel: int,
                      sequence_parallel: bool, expert_parallel: int = 1) -> StageTimes:
    return compute._price(piece, micro_batch, recompute, tensor_parallel, sequence_parallel,
                          expert_parallel)


def chimera_eq1_time(forward: float, backward: float, N: int, D: int, p2p: float = 0.0,
                     unoverlapped_allreduce: float = 0.0) -> float:
    """The paper's Eq. (1) for Chimera's basic unit with ``backward >= forward``:
    ``(F_t + p2p) C_f + (B_t + p2p) C_b + allreduce`` with ``C_f = N``, ``C_b = N + D - 2``."""
    if backward < forward:
        raise ValueError("Eq. (1)'s critical path C_b = N + D - 2 assumes backward >= forward")
    return (forward + p2p) * N + (backward + p2p) * (N + D - 2) + unoverlapped_allreduce


@dataclass
class Prediction:
    """Predicted iteration of one layout."""

    layout: TrainingPlan
    iteration_s: float
    bubble_ratio: float
    memory: list[RankMemory]
    sim: SimResult | None = field(default=None, repr=False)

    @property
    def samples_per_s(self) -> float:
        """Throughput: global batch / iteration time."""
        return self.layout.global_batch_size / self.iteration_s

    @property
    def peak_memory_bytes(self) -> int:
        """The largest per-rank peak."""
        return max(m.total_bytes for m in self.memory)


class PerformanceModel:
    """Predicts iteration time and memory of layouts for one model on one hardware profile.

    Schedules, partitions and simulations are cached: a schedule by its generator arguments, a
    partition by (stages, method), a simulation by (schedule, cost model) -- the makespan scales
    with the costs only when every cost scales by one factor, which differing stage costs and
    alpha terms break, so the cost model is the key.
    """

    def __init__(self, spec: ModelSpec, hardware: HardwareProfile,
                 compute: ComputeCosts | None = None, p2p_link: LinkProfile | None = None,
                 device_type: str = "cuda") -> None:
        self.spec = spec
        self.hardware = hardware
        self.compute = compute or AnalyticCompute(spec, hardware)
        self.device_type = device_type  # "cpu" for the emulated / CPU validation runs
        self.p2p_link = p2p_link  # overrides the profile's links (e.g. a measured ping-pong)
        check_fp8(spec.fp8, hardware, spec.config)
        self._schedules: dict[tuple, Schedule] = {}
        self._sims: dict[tuple, SimResult] = {}
        self._partitions: dict[tuple[int, str], list[StagePiece]] = {}

    # ------------------------------------------------------------------ building blocks
    def schedule(self, layout: TrainingPlan) -> Schedule:
        """The layout's schedule (cached by its generator arguments)."""
        key = (layout.schedule, layout.D, layout.N, layout.options, layout.slices)
        if key not in self._schedules:
            self._schedules[key] = layout.build_schedule(self.attention_fraction())
        return self._schedules[key]

    def partition(self, layout: TrainingPlan) -> list[StagePiece]:
        """Layers of every model stage, by ``layout.partition`` (as the runtime partitions).

        Cached by (stages, method): the balanced split is a dynamic programme over the layers.
        """
        key = (layout.num_stages, layout.partition)
        if key not in self._partitions:
            self._partitions[key] = partition_stages(self.spec, *key)
        return list(self._partitions[key])

    def attention_fraction(self) -> float:
        """The share of a causal sequence's forward work in attention, ``s / (s + 12 h)`` (the
        sliced orders are built for it, as in training)."""
        cfg = self.spec.config
        return cfg.seq_length / (cfg.seq_length + 12 * cfg.hidden_size)

    def check_sequence(self, layout: TrainingPlan) -> None:
        """ConfigError when CP or k cannot split the sequence (or are combined)."""
        seq = self.spec.config.seq_length
        if layout.CP > 1 and seq % (2 * layout.CP):
            raise ConfigError(f"--context-parallel-size {layout.CP}: --seq-length {seq} is not "
                              f"divisible by 2 x CP")
        if layout.slices > 1 and seq % layout.slices:
            raise ConfigError(f"--pipeline-sequence-slices {layout.slices} does not divide "
                              f"--seq-length {seq}")
        if layout.slices > 1 and layout.CP > 1:
            raise ConfigError("--pipeline-sequence-slices with --context-parallel-size > 1 is "
                              "not supported")

    def local_spec(self, layout: TrainingPlan) -> ModelSpec:
        """The model as one rank's unit sees it: ``s / (CP k)`` tokens."""
        parts = layout.CP * layout.slices
        if parts == 1:
            return self.spec
        cfg = self.spec.config
        return dataclasses.replace(self.spec, config=dataclasses.replace(
            cfg, seq_length=cfg.seq_length // parts, max_position_embeddings=cfg.max_positions))

    def memory(self, layout: TrainingPlan) -> list[RankMemory]:
        """Peak memory of every pipeline rank (of one tensor-parallel and context rank: its
        ``s / CP`` tokens, the distributed optimizer sharded over data x context ranks; with k
        slices each live unit holds ``s / k`` tokens and the keys/values of its sequence's
        earlier slices)."""
        check_tensor_parallel(self.spec, layout.T, layout.sequence_parallel)
        self.check_sequence(layout)
        self.check_experts(layout)
        schedule, partition = self.schedule(layout), self.partition(layout)
        local = self.local_spec(layout)
        dispatched = [moe_extra_activation_bytes(local.config, p, layout.B, layout.T,
                                                 layout.sequence_parallel, layout.recompute_mode)
                      for p in partition]
        memory = rank_memory(local, schedule, partition, layout.B,
                             layout.recompute_mode, self.device_type, layout.T,
                             layout.sequence_parallel, data_parallel_size=layout.W * layout.CP,
                             distributed_optimizer=layout.distributed_optimizer,
                             expert_parallel=layout.EP, extra_activation_bytes=dispatched)
        return sliced_rank_memory(memory, schedule, slice_cache_bytes(
            self.spec, partition, layout.B, layout.slices, layout.T))

    def check_experts(self, layout: TrainingPlan) -> None:
        """ConfigError when EP does not fit the experts or the T x CP x W ranks, or when MoE
        meets a compute source that cannot price it (measured stage times)."""
        check_expert_parallel(self.spec.config, layout.EP, layout.T * layout.CP * layout.W)
        if self.spec.config.moe.enabled and layout.T > 1 and not layout.sequence_parallel:
            raise ConfigError("--num-experts with --tensor-model-parallel-size > 1 needs "
                              "--sequence-parallel")
        if self.spec.config.moe.enabled and not isinstance(self.compute, AnalyticCompute):
            raise ConfigError("--num-experts: the performance model prices MoE layers with the "
                              "analytic compute model only")

    def expert_parallel_seconds(self, layout: TrainingPlan,
                                piece: StagePiece) -> tuple[float, float]:
        """(all-to-all, synchronous dispatcher collectives) seconds of one micro-batch through
        ``piece`` in one direction on one rank (:func:`~.moe_costs.plan_expert_parallel_seconds`:
        its ``s / CP`` tokens on the EP group's link)."""
        return plan_expert_parallel_seconds(self.spec.config, self.hardware, layout.B, layout.T,
                                            layout.CP, layout.EP, layout.sequence_parallel,
                                            piece, self.p2p_link)

    def all_to_all_costs(self, layout: TrainingPlan) -> tuple[float, ...]:
        """Per stage, the all-to-all seconds of one micro-batch in one direction (A_s)."""
        return tuple(self.expert_parallel_seconds(layout, p)[0] for p in self.partition(layout))

    def _global_rank(self, layout: TrainingPlan, pipeline_rank: int, replica: int = 0,
                     context_rank: int = 0) -> int:
        """Global rank of a pipeline rank in data-parallel replica ``replica``, tensor rank 0."""
        return ParallelLayout(layout.T, layout.W, layout.D, layout.CP).global_rank(
            pipeline_rank, replica, context_rank=context_rank)

    def context_parallel_link(self, layout: TrainingPlan) -> LinkProfile:
        """The link of the ring of one sequence's CP ranks (intra-node when T x CP ranks fit
        in a node: Megatron's rank order puts them next to each other)."""
        return self.p2p_link or self.hardware.message_link(self.hardware.link_for(
            [self._global_rank(layout, 0, 0, c) for c in range(layout.CP)]))

    def ring_seconds(self, layout: TrainingPlan, piece: StagePiece) -> tuple[float, float]:
        """(forward, backward) seconds of ring attention's traffic for one micro-batch through
        ``piece`` on one rank: per layer ``CP - 1`` key/value blocks of ``s / CP`` tokens
        forward; backward the blocks again and their dK/dV (twice the bytes), each step one
        message on the ring's link."""
        if layout.CP == 1 or not piece.num_layers:
            return 0.0, 0.0
        cfg = self.spec.config
        kv = cfg.query_groups * cfg.head_dim // layout.T
        block = 2 * (cfg.seq_length // layout.CP) * layout.B * kv * self.spec.dtype_bytes
        link = self.context_parallel_link(layout)
        steps = piece.num_layers * (layout.CP - 1)
        return (steps * (link.alpha_s + link.beta_s_per_byte * block),
                steps * (link.alpha_s + 2 * link.beta_s_per_byte * block))

    def tensor_parallel_link(self, layout: TrainingPlan) -> LinkProfile:
        """The link of a tensor-parallel group (T consecutive global ranks), as the backend's
        collectives over T ranks see it (host-staged with gloo)."""
        return self.hardware.collective_link(self.hardware.link_for(range(layout.T)), layout.T)

    def stage_times(self, layout: TrainingPlan, piece: StagePiece) -> StageTimes:
        """One micro-batch (a whole sequence; the simulator gives each slice its share) through
        one stage on one of T ranks: the compute of one rank (the analytic model prices the
        narrower GEMMs; a measured source is divided by T) plus the tensor-parallel collectives
        and, with Megatron's scatter/gather of pipeline messages, the all-gather of a received
        message (forward and backward; none in W). With CP ranks each computes ``1 / CP`` of it
        (the zigzag split balances the causal work) while ring attention's key/value blocks
        travel (:meth:`ring_seconds`); a transfer hides behind the attention compute of the
        block before it, so only what exceeds the attention share of the time is added."""
        times = self._moe_stage_times(layout, piece, self._tensor_stage_times(layout, piece))
        if layout.CP == 1:
            return times
        cp, share = layout.CP, self.attention_fraction()
        ring_f, ring_b = self.ring_seconds(layout, piece)
        forward, backward = times.forward / cp, times.backward / cp
        return StageTimes(forward + max(0.0, ring_f - share * forward),
                          backward + max(0.0, ring_b - share * (backward - times.weight / cp)),
                          times.weight / cp)

    def _moe_stage_times(self, layout: TrainingPlan, piece: StagePiece,
                         times: StageTimes) -> StageTimes:
        """``times`` plus the expert-parallel work on the critical path: the ``allgather``
        dispatcher's collectives (forward and backward) and, with full recomputation, the
        recomputed forward's all-to-alls in the backward (the all-to-alls themselves are the
        simulator's ``all_to_all_cost``). Whole-sequence seconds: CP divides them after."""
        a2a, sync = self.expert_parallel_seconds(layout, piece)
        if not (a2a or sync):
            return times
        extra = (a2a + sync) if layout.recompute_mode == "full" else sync
        return StageTimes(times.forward + sync * layout.CP,
                          times.backward + extra * layout.CP, times.weight)

    def _tensor_stage_times(self, layout: TrainingPlan, piece: StagePiece) -> StageTimes:
        mode = layout.recompute_mode
        per_rank = getattr(self.compute, "rank_stage_times", None)
        if isinstance(self.compute, AnalyticCompute):
            times = self.compute.rank_stage_times(piece, layout.B, mode, layout.T,
                                                  layout.sequence_parallel, layout.EP)
        elif per_rank is not None:
            times = per_rank(piece, layout.B, mode, layout.T, layout.sequence_parallel)
        else:
            if mode == "selective":
                raise ConfigError("--recompute-granularity selective needs the analytic compute "
                                  "model (measured stage times cover full recomputation only)")
            whole = self.compute.stage_times(piece, layout.B, layout.recompute)
            times = StageTimes(whole.forward / layout.T, whole.backward / layout.T,
                               whole.weight / layout.T)
        if layout.T == 1:
            return times
        link = self.tensor_parallel_link(layout)
        forward, backward = tensor_parallel_comm_seconds(
            self.spec, piece, layout.B, layout.T, layout.sequence_parallel, link,
            mode == "full")
        gather = pipeline_gather_seconds(self.spec, layout.B, layout.T,
                                         layout.sequence_parallel, link)
        forward += 0.0 if piece.pre_process else gather
        backward += 0.0 if piece.post_process else gather
        return StageTimes(times.forward + forward, times.backward + backward, times.weight)

    def _p2p_edges(self, layout: TrainingPlan,
                   schedule: Schedule) -> tuple[tuple[int, int, float, float], ...]:
        """(sender, receiver, alpha, beta) of every edge the schedule's messages cross: the
        hardware's intra- or inter-node link of the two global ranks (replica 0's layout)."""
        edges = set()
        for pipe in range(schedule.num_pipes):
            for stage in range(schedule.num_stages - 1):
                a, b = schedule.rank_of(pipe, stage), schedule.rank_of(pipe, stage + 1)
                if a != b:
                    edges.update({(a, b), (b, a)})
        result = []
        for a, b in sorted(edges):
            link = self.p2p_link or self.hardware.message_link(self.hardware.link_for(
                (self._global_rank(layout, a), self._global_rank(layout, b))))
            result.append((a, b, link.alpha_s, link.beta_s_per_byte))
        return tuple(result)

    def _allreduce_link(self, layout: TrainingPlan, schedule: Schedule) -> LinkProfile:
        """The link of the stage-replica all-reduces (over ``2f W CP`` replicas) as the backend
        sees it (host-staged with gloo: ``HardwareProfile.collective_link``)."""
        if self.p2p_link is not None:
            return self.p2p_link
        return self.hardware.collective_link(*self._allreduce_wire(layout, schedule))

    def _allreduce_wire(self, layout: TrainingPlan,
                        schedule: Schedule) -> tuple[LinkProfile, int]:
        """(the hardware link the stage all-reduces cross, replicas per stage)."""
        groups = [
            [self._global_rank(layout, schedule.rank_of(pipe, stage), w, c)
             for w in range(layout.W) for c in range(layout.CP)
             for pipe in range(schedule.num_pipes)]
            for stage in range(schedule.num_stages)
        ]
        spans = any(self.hardware.link_for(g) is self.hardware.inter_node for g in groups)
        link = self.hardware.inter_node if spans else self.hardware.intra_node
        return link, len(groups[0]) if groups else 1

    def cost_model(self, layout: TrainingPlan) -> CostModel:
        """The simulator's cost model for ``layout`` (seconds and bytes)."""
        schedule = self.schedule(layout)
        pieces = self.partition(layout)
        times = [self.stage_times(layout, p) for p in pieces]
        split = schedule.split_backward
        link = self._allreduce_link(layout, schedule)
        # a reduce-scatter is half of Rabenseifner's all-reduce (its all-gather half comes after
        # the step: :meth:`exposed_param_gather_s`)
        half = 0.5 if layout.distributed_optimizer else 1.0
        return CostModel(
            forward_cost=tuple(t.forward for t in times),
            backward_cost=tuple(t.backward for t in times),
            weight_cost=tuple(t.weight for t in times) if split else 0.0,
            p2p_edges=self._p2p_edges(layout, schedule),
            activation_bytes=float(self.message_bytes(layout)),
            allreduce_alpha=link.alpha_s * half,
            allreduce_beta=link.beta_s_per_byte,
            grad_bytes=tuple(b * half for b in self._grad_bytes(pieces, layout.T, layout.EP)),
            data_parallel_size=layout.W * layout.CP,
            allreduce_channels=1 if self.p2p_link else self.hardware.concurrent_collectives(
                self._allreduce_wire(layout, schedule)[0]),
            action_overhead=self.hardware.action_overhead_s,
            all_to_all_cost=self.all_to_all_costs(layout) if layout.EP > 1 else 0.0,
            p2p_exchange=layout.p2p_exchange)

    def stage_costs(self, layout: TrainingPlan) -> StageCosts:
        """Per-stage F, B (input gradient), W seconds and the p2p message time of ``layout``:
        what ``--chimera-zb-costs @file.json`` reads (``tools/autotune.py --stage-costs-json``).
        StageCosts has one message time: the mean over the links the schedule's messages
        cross (the simulator itself prices each link, :meth:`_p2p_edges`)."""
        schedule = self.schedule(layout)
        times = [self.stage_times(layout, p) for p in self.partition(layout)]
        size = self.message_bytes(layout)
        edges = self._p2p_edges(layout, schedule)
        p2p = (sum(alpha + beta * size for _, _, alpha, beta in edges) / len(edges)
               if edges else 0.0)
        a2a = self.all_to_all_costs(layout) if layout.EP > 1 else ()
        return StageCosts(tuple(t.forward for t in times),
                          tuple(t.backward - t.weight for t in times),
                          tuple(t.weight for t in times), p2p, a2a if any(a2a) else ())

    def message_bytes(self, layout: TrainingPlan) -> int:
        """Bytes one rank sends per pipeline message: ``[s, b, h]``, its ``1/T`` share under
        sequence parallelism or Megatron's scatter/gather (T > 1); ``s / (CP k)`` tokens."""
        return activation_message_bytes(self.local_spec(layout), layout.B, layout.T,
                                        layout.sequence_parallel or layout.T > 1)

    def _grad_bytes(self, pieces: list[StagePiece], tensor_parallel: int = 1,
                    expert_parallel: int = 1) -> list[float]:
        """Bytes of each stage's gradient buffer on one of ``tensor_parallel`` ranks (fp32 for
        fp32 and bf16 models; ``experts / expert_parallel`` experts per MoE layer, all reduced
        on the stage's link)."""
        width = bytes_per_parameter(self.spec.config.params_dtype)["grad"]
        return [float(n * width) - expert_gradient_bytes_saved(self.spec.config, p,
                                                               expert_parallel, width)
                for n, p in zip(stage_parameters(self.spec, pieces, tensor_parallel), pieces,
                                strict=True)]

    def exposed_param_gather_s(self, layout: TrainingPlan) -> float:
        """The distributed optimizer's parameter all-gather that the next iteration waits for:
        the gathers run in the background (``--overlap-param-gather``), but the stage of each
        rank's first forward needs its parameters before it starts (slowest rank)."""
        if not layout.distributed_optimizer:
            return 0.0
        schedule = self.schedule(layout)
        costs = self.cost_model(layout)  # its all-reduce terms are the reduce-scatter halves
        nbytes = self._grad_bytes(self.partition(layout), layout.T, layout.EP)
        replicas = schedule.num_pipes * layout.W
        first = [schedule.actions[r][0].stage for r in range(schedule.num_ranks)
                 if schedule.actions[r]]
        return max((costs.allreduce_time(replicas, nbytes[s] / 2) for s in first), default=0.0)

    def simulate(self, layout: TrainingPlan) -> SimResult:
        """Simulated iteration of ``layout`` (cached by schedule and cost model)."""
        schedule = self.schedule(layout)
        costs = self.cost_model(layout)
        key = (id(schedule), costs)
        if key not in self._sims:
            self._sims[key] = simulate(schedule, costs)
        return self._sims[key]

    def work_lower_bound(self, layout: TrainingPlan) -> float:
        """A bound below the iteration time, without building the schedule: every micro-batch
        passes every stage forward and backward, spread at best evenly over the D ranks."""
        pieces = self.partition(layout)
        work = sum(t.forward + t.backward for t in (self.stage_times(layout, p) for p in pieces))
        return layout.N * work / layout.D

    # ------------------------------------------------------------------ the prediction
    def predict(self, layout: TrainingPlan, with_memory: bool = True) -> Prediction:
        """Iteration time (the simulated makespan), bubble ratio and per-rank peak memory."""
        if min(layout.D, layout.W, layout.B, layout.N, layout.T) < 1:
            raise ConfigError(f"layout sizes must be positive: {layout.describe()}")
        self.check_experts(layout)
        sim = self.simulate(layout)
        memory = self.memory(layout) if with_memory else []
        # the simulator gives the pipeline messages and the gradient all-reduces separate
        # channels; where they share one link (one NIC per GPU) its bytes bound the iteration
        period = sim.longest_rank_span if layout.steps_overlap else sim.makespan
        busy = max(period, self.link_busy_s(layout))
        seconds = busy + self.optimizer_step_s(layout) + self.exposed_param_gather_s(layout)
        return Prediction(layout, seconds, sim.bubble_ratio, memory, sim)

    def link_busy_s(self, layout: TrainingPlan) -> float:
        """The most seconds any rank's link is busy sending in one iteration: the pipeline
        messages it sends (each on its edge's link) plus its share of the stage gradient
        all-reduces on theirs (Rabenseifner: ``2 (r - 1) / r`` of the stage's bytes per rank; the
        reduce-scatter half with the distributed optimizer), bandwidth terms only, per kind of
        link. The simulator prices the messages and the all-reduces on separate channels; where
        both go through one NIC (one GPU per node, as on Piz Daint) the iteration cannot be
        shorter than the NIC's bytes over its bandwidth."""
        schedule = self.schedule(layout)
        costs = self.cost_model(layout)
        size = costs.activation_bytes
        betas = {(a, b): beta for a, b, _, beta in costs.p2p_edges}
        link = self._allreduce_link(layout, schedule)
        replicas = schedule.num_pipes * layout.W
        grad_bytes = costs.per_stage("grad_bytes", schedule.num_stages)
        worst = 0.0
        for rank in range(schedule.num_ranks):
            per_link: dict[float, float] = {}
            for action in schedule.actions[rank]:
                nxt = (action.stage + 1 if action.kind == FORWARD else
                       action.stage - 1 if action.kind == BACKWARD else None)
                if nxt is None or not 0 <= nxt < schedule.num_stages:
                    continue
                other = schedule.rank_of(action.pipe, nxt)
                if other != rank and (rank, other) in betas:
                    beta = betas[(rank, other)]
                    per_link[beta] = per_link.get(beta, 0.0) + size * beta
            if replicas > 1:
                # concurrent reductions (gloo: one connection each) each run at the link's rate
                beta = link.beta_s_per_byte / costs.allreduce_channels
                share = 2 * (replicas - 1) / replicas
                for stage in schedule.stages_of_rank(rank):
                    per_link[beta] = per_link.get(beta, 0.0) + share * grad_bytes[stage] * beta
            worst = max([worst, *per_link.values()])
        return worst

    def optimizer_step_s(self, layout: TrainingPlan) -> float:
        """Seconds of the optimizer step after the last all-reduce (slowest rank), when the
        compute source models it (measured profiles time it; the analytic model prices Adam's
        memory-bound step by its bytes)."""
        step = getattr(self.compute, "optimizer_step_s", None)
        if step is None:
            return 0.0
        schedule = self.schedule(layout)
        width = bytes_per_parameter(self.spec.config.params_dtype)["grad"]
        params = [b / width for b in self._grad_bytes(self.partition(layout), layout.T,
                                                      layout.EP)]
        shards = schedule.num_pipes * layout.W if layout.distributed_optimizer else 1
        return max(step(sum(params[s] for s in schedule.stages_of_rank(r)) / shards)
                   for r in range(schedule.num_ranks))
