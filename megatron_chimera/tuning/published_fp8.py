"""Published FP8 training throughput on H100 as data, and the model's prediction of it (out of
sample: none of these rows was used to build the model; :mod:`megatron_chimera.tuning.precision`
was written from the recipes' mechanics and the data sheets, then scored here).

**Absolute rows** (tokens per second per GPU, DGX H100: 8 x H100 SXM 80 GB per node, NVLink 4,
8 x 400 Gb/s InfiniBand; Megatron-core with Transformer Engine, flash attention, the distributed
optimizer, sequence parallelism with T > 1, no recomputation as the tables state none):

* NVIDIA NeMo, ``docs/source/performance/performance_summary.md`` (github.com/NVIDIA/NeMo at
  070a0bb1), "pre-training performance for various tasks at FP8 precision", container NeMo
  24.07, DGX-H100: LLAMA3-70B, LLAMA2-70B, LLAMA2-7B, LLAMA3-8B, GPT3-175B (128 GPUs). The
  recipe is Transformer Engine's delayed scaling (the only FP8 recipe of TE 1.x, that release).
* NVIDIA Megatron-Bridge, ``docs/performance-summary.md`` (github.com/NVIDIA-NeMo/Megatron-Bridge
  at 00b7660b), 25.11 container, DGX-H100: LLAMA3_70B "FP8-CS" (current scaling: Megatron's
  ``--fp8-recipe tensorwise``); ``docs/performance-summary-archive.md``, 26.02 container,
  DGX-H100 LLAMA3_70B "FP8" at GBS 256 (the same layout; its recipe, not restated there, is
  taken as the 25.11 table's FP8-CS).

**Ratio rows** (FP8 over bf16 throughput, the same run otherwise): torchtitan,
``benchmarks/llama3_h100_202412_torchtitan.md`` (github.com/pytorch/torchtitan), Tables 1 and 3:
Llama 3.1 8B, FSDP on 8 and 128 H100s (500 W, 96 GB HBM2e), local batch 2, sequence 8192,
selective activation checkpointing, torch.compile: 6,667 -> 8,532 and 6,514 -> 8,380 TPS/GPU with
torchao's Float8 (dynamic tensor-wise scaling: ``tensorwise``). Priced as plain data parallelism
with the distributed optimizer (the model has no FSDP; the ratio is what is compared).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_chimera.config import ModelConfig
from megatron_chimera.model.presets import LLAMA3_8B, LLAMA3_70B
from megatron_chimera.tuning.analytic_costs import ModelSpec
from megatron_chimera.tuning.hardware import HardwareProfile
from megatron_chimera.tuning.perf_model import PerformanceModel
from megatron_chimera.tuning.precision import Fp8Config
from megatron_chimera.tuning.training_plan import TrainingPlan

FP8_SOURCE = ("NeMo 24.07 and Megatron-Bridge 25.11 / 26.02 performance summaries (DGX-H100, "
              "tokens/s/GPU) and torchtitan's H100 Float8 tables (FP8 / bf16 ratios)")
_LLAMA2 = dict(seq_length=4096, vocab_size=32000, normalization="RMSNorm", swiglu=True,
               add_bias_linear=False, position_embedding_type="rope",
               untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
               attention_dropout=0.0)
MODELS: dict[str, ModelConfig] = {
    "llama3-70b": LLAMA3_70B,
    "llama3-8b": LLAMA3_8B,
    "llama2-70b": ModelConfig(num_layers=80, hidden_size=8192, num_attention_heads=64,
                              ffn_hidden_size=28672, num_query_groups=8, **_LLAMA2),
    "llama2-7b": ModelConfig(num_layers=32, hidden_size=4096, num_attention_heads=32,
                             ffn_hidden_size=11008, **_LLAMA2),
    "gpt3-175b": ModelConfig(num_layers=96, hidden_size=12288, num_attention_heads=96,
                             seq_length=2048, vocab_size=51200, hidden_dropout=0.0,
                             attention_dropout=0.0),
}


@dataclass(frozen=True)
class Fp8Run:
    """One published FP8 run: model, layout, recipe and the published figure (tokens/s/GPU, or
    with ``bf16_baseline`` the FP8 / bf16 throughput ratio of two runs)."""

    source: str
    model: str
    gpus: int
    batch: int  # global batch (sequences)
    T: int
    D: int
    recipe: str
    published: float
    CP: int = 1
    virtual: int = 1
    micro_batch: int = 1
    recompute: str | None = None
    bf16_baseline: bool = False  # published is FP8 / bf16 throughput

    @property
    def W(self) -> int:
        """Data-parallel width: GPUs / (T CP D)."""
        return self.gpus // (self.T * self.CP * self.D)


FP8_RUNS: tuple[Fp8Run, ...] = (
    Fp8Run("MB 25.11", "llama3-70b", 64, 128, 4, 8, "tensorwise", 1602, virtual=5),
    Fp8Run("MB 26.02", "llama3-70b", 64, 256, 4, 8, "tensorwise", 1621, virtual=5),
    Fp8Run("NeMo 24.07", "llama3-70b", 64, 128, 4, 4, "delayed", 1533, CP=2, virtual=5),
    Fp8Run("NeMo 24.07", "llama2-70b", 64, 128, 4, 4, "delayed", 1707, virtual=20),
    Fp8Run("NeMo 24.07", "llama3-8b", 8, 128, 1, 1, "delayed", 12036, CP=2),
    Fp8Run("NeMo 24.07", "llama2-7b", 8, 128, 1, 1, "delayed", 16847),
    Fp8Run("NeMo 24.07", "gpt3-175b", 128, 256, 4, 8, "delayed", 726, virtual=6),
    Fp8Run("torchtitan T1", "llama3-8b", 8, 16, 1, 1, "tensorwise", 8532 / 6667,
           micro_batch=2, recompute="selective", bf16_baseline=True),
    Fp8Run("torchtitan T3", "llama3-8b", 128, 256, 1, 1, "tensorwise", 8380 / 6514,
           micro_batch=2, recompute="selective", bf16_baseline=True),
)


def run_layout(run: Fp8Run) -> TrainingPlan:
    """The layout of a published run (interleaved with its VP, 1F1B / no pipeline otherwise)."""
    N = run.batch // (run.W * run.micro_batch)
    common = dict(T=run.T, sequence_parallel=run.T > 1, distributed_optimizer=True,
                  recompute_granularity=run.recompute or "full")
    if run.D > 1 and run.virtual > 1:
        plan = TrainingPlan.of("interleaved", run.D, run.W, run.micro_batch, N,
                               run.recompute is not None, virtual_pipeline_size=run.virtual,
                               **common)
    else:
        plan = TrainingPlan.of("1f1b", run.D, run.W, run.micro_batch, N,
                               run.recompute is not None, **common)
    return dataclasses.replace(plan, CP=run.CP)


def tokens_per_gpu_s(run: Fp8Run, hardware: HardwareProfile, fp8: Fp8Config | None) -> float:
    """Predicted tokens per second per GPU of ``run`` in bf16 with ``fp8`` (or without)."""
    config = dataclasses.replace(MODELS[run.model], params_dtype="bf16")
    model = PerformanceModel(ModelSpec(config, "gpt2", fp8), hardware)
    seconds = model.predict(run_layout(run), with_memory=False).iteration_s
    return run.batch * config.seq_length / seconds / run.gpus


@dataclass(frozen=True)
class Fp8Comparison:
    """Predicted against published figure of one run."""

    run: Fp8Run
    predicted: float

    @property
    def ratio(self) -> float:
        """Predicted / published."""
        return self.predicted / self.run.published

    @property
    def error(self) -> float:
        """|ratio - 1|."""
        return abs(self.ratio - 1.0)


def predict_fp8_run(run: Fp8Run, hardware: HardwareProfile) -> Fp8Comparison:
    """The model's figure for one run (tokens/s/GPU, or the FP8 / bf16 ratio)."""
    fp8 = tokens_per_gpu_s(run, hardware, Fp8Config("hybrid", run.recipe))
    if run.bf16_baseline:
        return Fp8Comparison(run, fp8 / tokens_per_gpu_s(run, hardware, None))
    return Fp8Comparison(run, fp8)


def format_fp8(rows: Sequence[Fp8Comparison], hardware_name: str) -> str:
    """Markdown table of the FP8 rows plus the summary line."""
    lines = [f"FP8 runs: {FP8_SOURCE}; model: --hardware {hardware_name}", "",
             "| source | model | GPUs | T | CP | D | VP | batch | recipe | quantity | predicted "
             "| published | ratio |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        run = r.run
        what = "FP8/bf16" if run.bf16_baseline else "tok/s/GPU"
        lines.append(f"| {run.source} | {run.model} | {run.gpus} | {run.T} | {run.CP} | {run.D} "
                     f"| {run.virtual} | {run.batch} | {run.recipe} | {what} | "
                     f"{r.predicted:.4g} | {run.published:.4g} | {r.ratio:.3f} |")
    worst = max(rows, key=lambda r: r.error)
    lines.append(f"\nmean error {100 * statistics.mean(r.error for r in rows):.1f}%, worst "
                 f"{worst.run.source} {worst.run.model} (ratio {worst.ratio:.3f}) over "
                 f"{len(rows)} rows")
    return "\n".join(lines)
