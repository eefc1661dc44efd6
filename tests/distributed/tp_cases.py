"""Per-rank bodies of the tensor-parallel runtime tests: real GPT-2 and BERT stages (the entry
scripts' model providers and forward steps), Megatron's optimizer with gradient clipping, the
executor on T x W x D ranks, against one process training the whole model.

For each case the world first trains the whole model once (no groups: the reference, computed
on one rank and broadcast), then each rank creates the groups, builds its shard of its stages,
trains the same steps (``TPCase.steps``, 3 by default) and compares the losses, the global
gradient norm (clipping is active, so a norm counting a replicated parameter twice changes the
weights) and the full weights (shards joined) with the reference; it also checks that every
replica of a shard, and every tensor-parallel copy of a replicated parameter, is bitwise equal.
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import pretrain_bert
import pretrain_gpt2
from megatron_chimera import parallel_state
from megatron_chimera.checkpoint.checkpointing import (
    CheckpointContents,
    StageSlice,
    checkpoint_dir,
    global_name,
    read_tracker,
    save_checkpoint,
    stage_named_parameters,
)
from megatron_chimera.checkpoint.loading import CheckpointTarget, load_checkpoint
from megatron_chimera.config import DDPConfig, ModelConfig, OptimizerConfig
from megatron_chimera.distributed.data_parallel import build_data_parallel
from megatron_chimera.distributed.grad_sync import assert_replicas_identical
from megatron_chimera.model.partition import partition_layers
from megatron_chimera.optimizer import get_data_parallel_optimizer, get_megatron_optimizer
from megatron_chimera.pipeline.executor import (
    ExecutorPolicy,
    Gradients,
    PipelineExecutor,
    StageWork,
)
from megatron_chimera.pipeline.topology import PipelineTopology
from megatron_chimera.schedules import build_schedule
from megatron_chimera.schedules.validate import validate
from megatron_chimera.tensor_parallel import model_parallel_cuda_manual_seed
from megatron_chimera.tensor_parallel.utils import is_tensor_parallel
from tests.helpers.tensor_parallel import full_state

from .cases import run_each

STEPS = 3
RTOL = 1e-5
SEQ, MICRO_BATCH, VOCAB = 16, 2, 40
SEED = 11
# the vocabulary pads to 48 for one rank but to 64 for T = 2 (rows 48..63 are T's padding)
MODEL = dict(hidden_size=32, num_attention_heads=4, seq_length=SEQ, vocab_size=VOCAB,
             make_vocab_size_divisible_by=16, hidden_dropout=0.0, attention_dropout=0.0)
# SGD with momentum: updates linear in the gradients, so summation-order differences stay at
# 1e-7 (Adam's normalisation would blow up those of near-zero gradient entries)
OPTIMIZER = OptimizerConfig(optimizer="sgd", lr=0.5, sgd_momentum=0.9, weight_decay=0.01,
                            clip_grad=0.3)
FAMILIES = {"gpt2": pretrain_gpt2, "bert": pretrain_bert}
# Megatron's data-parallel flags all on: small buckets reduced during the last backward (the
# sequence-parallel gradients summed over the tensor-parallel group inside them), the distributed
# optimizer sharded over each tensor rank's stage-replica groups, parameters gathered in the
# background
# today's decoder (Llama-shaped): RMSNorm, SwiGLU, two query groups, no linear biases, RoPE with
# base 500000 and Llama 3.1's scaling, untied output layer
LLAMA_MODEL = (("normalization", "RMSNorm"), ("swiglu", True), ("num_query_groups", 2),
               ("add_bias_linear", False), ("position_embedding_type", "rope"),
               ("rotary_base", 500000), ("use_rope_scaling", True), ("ffn_hidden_size", 48),
               ("untie_embeddings_and_output_weights", True))
SHARDED_OVERLAP = DDPConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True, bucket_size=2000,
                            use_distributed_optimizer=True, overlap_param_gather=True)


@dataclass(frozen=True)
class TPCase:
    """One configuration: model family, schedule, T and D (W = world / (T x D)), N, options."""

    family: str
    schedule: str
    tensor_size: int
    pipeline_size: int
    num_microbatches: int
    options: tuple[tuple[str, Any], ...] = ()
    sequence_parallel: bool = False
    num_layers: int = 4
    untied: bool = False
    ddp: DDPConfig = DDPConfig()  # the data-parallel flags (default: Megatron's defaults)
    model: tuple[tuple[str, Any], ...] = ()  # ModelConfig overrides (e.g. LLAMA_MODEL)
    reset_positions: bool = False  # positions restart mid-sequence (--reset-position-ids)
    context_size: int = 1  # --context-parallel-size (W = world / (T x CP x D))
    slices: int = 1  # sequence slices per micro-batch (pipeline messages [s / k, b, h])
    steps: int = STEPS  # training steps compared with one process

    @property
    def name(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options)
        sp = " +SP" if self.sequence_parallel else ""
        ddp = " +dist-opt+overlap" if self.ddp == SHARDED_OVERLAP else \
            "" if self.ddp == DDPConfig() else f" {self.ddp}"
        model = " +" + ",".join(f"{k}={v}" for k, v in self.model) if self.model else ""
        reset = " +reset-positions" if self.reset_positions else ""
        cp = f" CP={self.context_size}" if self.context_size > 1 else ""
        cp += f" slices={self.slices}" if self.slices > 1 else ""
        return (f"{self.family} {self.schedule}[{opts}] T={self.tensor_size} "
                f"D={self.pipeline_size}{cp} N={self.num_microbatches}{sp}{ddp}{model}{reset}")

    def model_config(self, **overrides: Any) -> ModelConfig:
        """The tiny model of the case."""
        values = dict(MODEL, num_layers=self.num_layers, sequence_parallel=self.sequence_parallel,
                      untie_embeddings_and_output_weights=self.untied)
        values.update(self.model)
        values.update(overrides)
        return ModelConfig(**values)


def make_batch(family: str, step: int, dp_rank: int, microbatch: int,
               reset_positions: bool = False) -> dict[str, torch.Tensor]:
    """Deterministic micro-batch ``(step, data-parallel replica, micro-batch)`` of ``family``;
    ``reset_positions``: the GPT positions restart at a micro-batch-dependent token (a second
    document), as --reset-position-ids makes them."""
    g = torch.Generator().manual_seed(7919 * step + 104_729 * dp_rank + microbatch)
    b, s = MICRO_BATCH, SEQ
    if family == "gpt2":
        loss_mask = (torch.rand(b, s, generator=g) > 0.2).float()
        loss_mask[:, 0] = 1.0
        positions = torch.arange(s).expand(b, s).contiguous()
        if reset_positions:
            start = 3 + microbatch % (s - 6)
            positions = positions.clone()
            positions[:, start:] -= start
        return {"text": torch.randint(0, VOCAB, (b, s + 1), generator=g),
                "loss_mask": loss_mask, "position_ids": positions}
    masked = torch.rand(b, s, generator=g) < 0.3
    masked[:, 1] = True
    padding = torch.ones(b, s, dtype=torch.int64)
    padding[1, s - 3:] = 0
    return {"text": torch.randint(4, VOCAB, (b, s), generator=g),
            "types": (torch.arange(s) >= s // 2).long().expand(b, s).contiguous(),
            "is_random": torch.randint(0, 2, (b,), generator=g),
            "loss_mask": (masked & (padding > 0)).float(),
            "labels": torch.where(masked, torch.randint(4, VOCAB, (b, s), generator=g), -1),
            "padding_mask": padding}


def _loss_stats(family: str, output_and_loss_func) -> tuple[torch.Tensor, dict[str, float]]:
    output, loss_func = output_and_loss_func
    loss, stats = loss_func(output)
    return loss, {k: float(v) for k, v in stats.items()}


def reference_training(case: TPCase, data_parallel_size: int, config: ModelConfig):
    """One process, the whole model, the same mini-batches: (per-step losses by (replica,
    micro-batch), per-step grad norms, final named parameters)."""
    entry = FAMILIES[case.family]
    model = entry.model_provider(config, SEED)
    optimizer = get_megatron_optimizer(OPTIMIZER, [model])
    n, w = case.num_microbatches, data_parallel_size
    losses, norms = [], []
    for step in range(case.steps):
        optimizer.zero_grad()
        step_losses = []
        for dp in range(w):
            for m in range(n):
                loss, stats = _loss_stats(case.family, entry.forward_step(
                    make_batch(case.family, step, dp, m, case.reset_positions), model))
                (loss / (n * w)).backward()
                step_losses.append(stats)
        _, norm, _ = optimizer.step()
        losses.append(step_losses)
        norms.append(norm)
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def _reference_name(module: torch.nn.Module, local_name: str, start: int) -> str:
    """The whole model's name of a stage parameter (the last stage's tied copy is the
    embedding)."""
    name = global_name(local_name, start)
    if name == "word_embeddings.weight":
        return "language_model.embedding.word_embeddings.weight"
    return name


def _check_close(value: float, reference: float, what: str) -> None:
    if abs(value - reference) > RTOL * max(abs(reference), 1e-12):
        raise AssertionError(f"{what}: {value!r} != reference {reference!r}")


def check_losses(gathered, ref_losses: list[list[dict[str, float]]], what: str,
                 keys: tuple[str, ...] | None = None) -> None:
    """Every step's every micro-batch figure (``keys``, default all the reference's) of the
    gathered results (``executor.gather``; None off the logging rank) against the one-process
    run's (RTOL); prints the number of steps, the last loss and the largest relative
    difference for the record."""
    if gathered is None:
        return
    if len(gathered) != len(ref_losses):
        raise AssertionError(f"{what}: {len(gathered)} steps, reference {len(ref_losses)}")
    worst = 0.0
    for step, figures in enumerate(gathered):
        for i, (got, want) in enumerate(zip(figures.losses, ref_losses[step], strict=True)):
            for key in keys or want:
                _check_close(got[key], want[key], f"{what}: step {step} micro-batch {i} {key}")
                worst = max(worst, abs(got[key] - want[key]) / max(abs(want[key]), 1e-12))
    last = gathered[-1].losses[-1]["lm loss"]
    print(f"\n{what}: {len(gathered)} steps equal one process, last lm loss {last:.6f}, "
          f"max rel. loss difference {worst:.1e}", flush=True)


def _assert_tensor_parallel_copies_equal(modules: dict[int, torch.nn.Module]) -> None:
    """Every parameter replicated over the tensor-parallel ranks is bitwise the same on each."""
    world = parallel_state.get_tensor_model_parallel_world_size()
    if world == 1:
        return
    for stage in sorted(modules):
        for name, param in modules[stage].named_parameters():
            if is_tensor_parallel(param):
                continue
            parts = [torch.empty_like(param) for _ in range(world)]
            dist.all_gather(parts, param.detach().contiguous(),
                            group=parallel_state.get_tensor_model_parallel_group())
            if any(not torch.equal(p, parts[0]) for p in parts):
                raise AssertionError(f"stage {stage} {name}: tensor-parallel copies differ")


DEFAULT_POLICY = ExecutorPolicy()


def build_run(case: TPCase, config: ModelConfig, schedule, recompute: bool = False,
              optimizer_config: OptimizerConfig = OPTIMIZER,
              policy: ExecutorPolicy = DEFAULT_POLICY):
    """This rank's stage modules, optimizer and executor (groups already created; ``policy``:
    the executor's)."""
    entry = FAMILIES[case.family]
    prank = parallel_state.get_pipeline_model_parallel_rank()
    partition = partition_layers(config.num_layers, schedule.num_stages)
    last = schedule.num_stages - 1
    modules = {s: entry.model_provider(config, SEED, pre_process=s == 0, post_process=s == last,
                                       layer_range=partition[s], stage=s)
               for s in schedule.stages_of_rank(prank)}
    data_parallel = build_data_parallel(case.ddp, modules)
    grad_sync = data_parallel.grad_sync
    optimizer = get_data_parallel_optimizer(optimizer_config, data_parallel)
    if case.ddp.use_distributed_optimizer:  # the flag took effect: this rank holds a shard
        held = sum(p.numel() for m in modules.values() for p in m.parameters())
        if sum(m.numel() for m in optimizer.main_params) >= held:
            raise AssertionError("the distributed optimizer holds every parameter")
    seq = SEQ // (case.context_size * case.slices)
    seq = seq // case.tensor_size if case.sequence_parallel else seq
    executor = PipelineExecutor(
        schedule, PipelineTopology.from_parallel_state(),
        StageWork(modules, entry.forward_step, (seq, MICRO_BATCH, config.hidden_size),
                  torch.float32, recompute=recompute),
        Gradients(loss_scale_divisor=case.num_microbatches
                  * parallel_state.get_data_parallel_world_size(),
                  grad_sync=grad_sync, scale_loss=optimizer.scale_loss), policy=policy)
    return modules, optimizer, executor, partition


def _init_groups(case: TPCase, schedule) -> None:
    parallel_state.initialize_model_parallel(
        case.pipeline_size, schedule.placement, schedule.num_stages, case.tensor_size,
        timeout=datetime.timedelta(seconds=60), context_parallel_size=case.context_size)
    model_parallel_cuda_manual_seed(1234 + 100 * parallel_state.get_pipeline_model_parallel_rank())


def _data_parallel_size(case: TPCase, world_size: int) -> int:
    return world_size // (case.tensor_size * case.pipeline_size * case.context_size)


def shared_references(rank: int, world_size: int, cases: list, reference) -> list:
    """``reference(case)`` of every case, computed once in the world (case i on rank
    i % world, in parallel) and broadcast from there: every rank would otherwise repeat the
    same sequential one-process run."""
    mine = {i: reference(case) for i, case in enumerate(cases) if i % world_size == rank}
    out = []
    for i in range(len(cases)):
        box = [mine.get(i)]
        dist.broadcast_object_list(box, src=i % world_size)
        out.append(box[0])
    return out


def run_tp_case(rank: int, world_size: int, case: TPCase, reference=None) -> dict[str, int]:
    """Train ``case.steps`` steps and compare with the single-process run (``reference``, or
    computed here); returns p2p bytes sent."""
    schedule = build_schedule(case.schedule, case.pipeline_size, case.num_microbatches,
                              **dict(case.options))
    validate(schedule)
    config = case.model_config()
    if reference is None:
        reference = reference_training(case, _data_parallel_size(case, world_size), config)
    ref_losses, ref_norms, ref_params = reference
    if ref_norms[0] <= OPTIMIZER.clip_grad:
        raise AssertionError(f"grad norm {ref_norms[0]} does not reach --clip-grad: the norm "
                             f"would not be tested")
    _init_groups(case, schedule)
    try:
        modules, optimizer, executor, partition = build_run(case, config, schedule)
        dp = parallel_state.get_data_parallel_rank()
        prank = parallel_state.get_pipeline_model_parallel_rank()
        results, p2p_bytes = [], 0
        for step in range(case.steps):
            optimizer.zero_grad()
            result = executor.run([make_batch(case.family, step, dp, m, case.reset_positions)
                                   for m in range(case.num_microbatches)])
            if result.executed != schedule.actions[prank]:
                raise AssertionError(f"pipeline rank {prank}: executed order differs")
            _, norm, _ = optimizer.step()
            _check_close(norm, ref_norms[step], f"step {step} grad norm")
            results.append(result)
            p2p_bytes += result.p2p_bytes_sent
        check_losses(executor.gather(results), ref_losses, case.name)
        optimizer.finish_param_sync()
        assert_replicas_identical(modules)
        _assert_tensor_parallel_copies_equal(modules)
        for stage, module in modules.items():
            start = partition[stage][0]
            for local, value in full_state(module).items():
                name = _reference_name(module, local, start)
                want = ref_params[name]
                err = float((value - want).abs().max() / want.abs().max().clamp_min(1e-12))
                if err > RTOL:
                    raise AssertionError(f"stage {stage} {name}: rel. error {err:.2e}")
        return {"p2p_bytes": p2p_bytes}
    finally:
        parallel_state.destroy_model_parallel()


def run_tp_cases(rank: int, world_size: int, cases: list[TPCase]) -> None:
    """Run every case in sequence in this world (against one-process runs computed once in the
    world); name the failing case. A sequence-parallel case whose twin without sequence
    parallelism ran too must have sent exactly 1/T of its p2p bytes (on every rank); the
    figures are printed for the record."""
    sent: dict[TPCase, int] = {}
    references = shared_references(rank, world_size, cases, lambda case: reference_training(
        case, _data_parallel_size(case, world_size), case.model_config()))

    def run(rank: int, world_size: int, case: TPCase) -> None:
        sent[case] = run_tp_case(rank, world_size, case,
                                 references[cases.index(case)])["p2p_bytes"]

    run_each(rank, world_size, cases, run)
    for case, nbytes in sent.items():
        twin = dataclasses.replace(case, sequence_parallel=False)
        if not case.sequence_parallel or twin not in sent:
            continue
        if sent[twin] == 0 or nbytes * case.tensor_size != sent[twin]:
            raise AssertionError(f"{case.name}: p2p bytes {nbytes} with sequence parallelism, "
                                 f"{sent[twin]} without")
        totals = torch.tensor([sent[twin], nbytes], dtype=torch.int64)
        dist.all_reduce(totals)
        if rank == 0:
            per_microbatch = totals // (case.steps * case.num_microbatches * (
                world_size // (case.tensor_size * case.pipeline_size)))
            print(f"\n{twin.name}, [s, b, h] = [{SEQ}, {MICRO_BATCH}, {MODEL['hidden_size']}] "
                  f"fp32: p2p bytes per micro-batch (all ranks) {int(per_microbatch[0])}, with "
                  f"--sequence-parallel {int(per_microbatch[1])}", flush=True)


def _train_with_dropout(case: TPCase, schedule, recompute: bool,
                        **model: Any) -> list[torch.Tensor]:
    """Two steps with dropout; this rank's final parameters."""
    config = case.model_config(hidden_dropout=0.2, attention_dropout=0.2, **model)
    model_parallel_cuda_manual_seed(99 + 100 * parallel_state.get_pipeline_model_parallel_rank())
    modules, optimizer, executor, _ = build_run(case, config, schedule, recompute=recompute)
    dp = parallel_state.get_data_parallel_rank()
    for step in range(2):
        optimizer.zero_grad()
        executor.run([make_batch(case.family, step, dp, m)
                      for m in range(case.num_microbatches)])
        optimizer.step()
    _assert_tensor_parallel_copies_equal(modules)
    return [p.detach().clone() for s in sorted(modules) for p in modules[s].parameters()]


def run_recompute_replays_tensor_parallel_dropout(rank: int, world_size: int, family: str,
                                                  model: tuple[tuple[str, Any], ...] = ()
                                                  ) -> None:
    """Dropout inside and outside tensor-parallel regions (sequence parallel): recomputing the
    stage (the executor) or the layers (``--recompute-granularity full``) replays both random
    streams, so the weights equal the stored-activation run bitwise."""
    case = TPCase(family, "chimera", 2, 2, 4, sequence_parallel=True, model=model)
    schedule = build_schedule(case.schedule, case.pipeline_size, case.num_microbatches)
    _init_groups(case, schedule)
    try:
        stored = _train_with_dropout(case, schedule, recompute=False)
        runs = {
            "executor recomputation": _train_with_dropout(case, schedule, recompute=True),
            "full layer recomputation": _train_with_dropout(
                case, schedule, recompute=False, recompute_granularity="full",
                recompute_method="uniform", recompute_num_layers=1),
            "selective recomputation": _train_with_dropout(
                case, schedule, recompute=False, recompute_granularity="selective"),
        }
    finally:
        parallel_state.destroy_model_parallel()
    for what, weights in runs.items():
        for i, (a, b) in enumerate(zip(stored, weights, strict=True)):
            if not torch.equal(a, b):
                raise AssertionError(f"{what}: parameter {i} differs from the stored run")


# ----------------------------------------------------------------------------- checkpoints
ADAM = OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.01, clip_grad=1.0)


def _stage_slices(modules: dict[int, torch.nn.Module], partition) -> list[StageSlice]:
    rank = dist.get_rank()
    return [StageSlice(s, partition[s], m,
                       writer=rank == min(parallel_state.get_stage_replica_ranks(s)))
            for s, m in sorted(modules.items())]


def _local_state(optimizer, stages: list[StageSlice]) -> dict[str, torch.Tensor]:
    """This rank's shards: parameters and their Adam state, by global name."""
    out = {}
    for stage in stages:
        for name, param in stage_named_parameters(stage).items():
            out[name] = param.detach().clone()
            for key, value in optimizer.optimizer.state.get(param, {}).items():
                out[f"{name}/{key}"] = value.detach().clone()
    return out


def read_checkpoint_tensors(root: str) -> dict[str, torch.Tensor]:
    """Every tensor of every stage file of the latest checkpoint under ``root``, by name."""
    import glob
    import os

    directory = checkpoint_dir(root, read_tracker(root))
    out = {}
    for path in sorted(glob.glob(os.path.join(directory, "layers_*.pt"))):
        payload = torch.load(path, weights_only=True)
        out.update(payload["model"])
        for name, entry in (payload["optimizer"] or {}).items():
            out.update({f"{name}/{key}": value for key, value in entry.items()})
    return out


def _layout_run(case: TPCase, config: ModelConfig, steps: int, root_in: str | None,
                root_out: str, ckpt_format: str = "torch", keep_states: bool = True
                ) -> dict[str, Any]:
    """Create the case's groups, build, load ``root_in`` (if given), train ``steps`` steps, save
    to ``root_out`` in ``ckpt_format``; returns this rank's bytes read (``read``) and, with
    ``keep_states``, its local state right after loading / building and after saving."""
    schedule = build_schedule(case.schedule, case.pipeline_size, case.num_microbatches,
                              **dict(case.options))
    _init_groups(case, schedule)
    try:
        modules, optimizer, executor, partition = build_run(case, config, schedule,
                                                            optimizer_config=ADAM)
        stages = _stage_slices(modules, partition)
        rank, world = dist.get_rank(), dist.get_world_size()
        result: dict[str, Any] = {"read": 0}
        if root_in is not None:
            target = CheckpointTarget(stages, schedule.num_stages, optimizer)
            loaded = load_checkpoint(root_in, target, rank=rank, world_size=world)
            result["read"] = loaded.bytes_read
        if keep_states:
            result["loaded"] = _local_state(optimizer, stages)
        dp = parallel_state.get_data_parallel_rank()
        for step in range(steps):
            optimizer.zero_grad()
            executor.run([make_batch(case.family, step, dp, m)
                          for m in range(case.num_microbatches)])
            optimizer.step()
        save_checkpoint(root_out, CheckpointContents(1, stages, partition, optimizer=optimizer),
                        rank=rank, world_size=world, barrier=dist.barrier,
                        ckpt_format=ckpt_format)
        if keep_states:
            result["saved"] = _local_state(optimizer, stages)
        return result
    finally:
        parallel_state.destroy_model_parallel()


def _assert_states_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                         what: str) -> None:
    if got.keys() != want.keys():
        raise AssertionError(f"{what}: names differ: {sorted(got.keys() ^ want.keys())[:5]}")
    for name in got:
        if not torch.equal(got[name], want[name]):
            raise AssertionError(f"{what}: {name} differs")


def run_checkpoint_round_trip(rank: int, world_size: int, family: str, root: str,
                              model: tuple[tuple[str, Any], ...] = ()) -> None:
    """T=2 D=4 Chimera trains 2 steps (Adam) and saves; T=1 D=2 1F1B (W=4) loads it and saves
    again at once; T=2 D=4 Chimera loads that. The two checkpoints are bitwise the same full
    tensors (weights and Adam state), T=1 loads exactly the saved full tensors, and T=2 gets
    back exactly the shards it saved. ``model``: ModelConfig overrides (e.g. LLAMA_MODEL, whose
    fused gate+up shards are strided)."""
    import os

    config_case = TPCase(family, "chimera", 2, 4, 4, (("pipes", 2),), untied=family == "gpt2",
                         model=model)
    config = config_case.model_config()
    one = TPCase(family, "1f1b", 1, 2, 4, untied=config_case.untied, model=model)
    first, second = os.path.join(root, "t2"), os.path.join(root, "t1")
    t2 = _layout_run(config_case, config, 2, None, first)
    t1 = _layout_run(one, config, 0, first, second)
    saved = read_checkpoint_tensors(first)
    _assert_states_equal({k: v for k, v in saved.items() if k in t1["loaded"]}, t1["loaded"],
                         "T=1 loaded vs the T=2 checkpoint")
    if rank == 0:  # every tensor of the checkpoint is loaded by some rank; files compared whole
        _assert_states_equal(read_checkpoint_tensors(second), saved,
                             "checkpoint written by T=1 vs by T=2")
    back = _layout_run(config_case, config, 0, second, os.path.join(root, "t2-again"))
    _assert_states_equal(back["loaded"], t2["saved"], "T=2 shards after the round trip")
