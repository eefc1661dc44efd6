"""Throughput that papers measured on real clusters, as data, and the model's prediction of it:
Narayanan et al.'s Table 1 (the target of issue #40) and, out of sample, the PTD-P rows of its
Table 2 (:data:`MEGATRON_TABLE2`).

**Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC'21 (arXiv 2104.04473), Table 1** (weak scaling on Selene: DGX A100 80 GB, 8 GPUs
per node, NVLink 3, 8 x 200 Gb/s HDR InfiniBand per node; fp16, sequence 2048, vocabulary
51,200, full activation recomputation, the interleaved schedule with scatter/gather of pipeline
messages). The published TFLOP/s per GPU use the paper's Eq. (3),
``96 B s l h^2 (1 + s/(6h) + V/(16 l h))`` FLOPs per iteration of ``B`` sequences.

What the table does not state is filled in the same way for every row (not per row): micro-batch
1 (the paper's Table 2 uses 1 for the same model family), the interleaved schedule with the
smallest number of model chunks ``v > 1`` that divides the layers per stage (1F1B when none
does; no pipeline at D = 1), the 2021 implementation's unfused attention (the ``[s, s]`` scores
are materialised: ``masked_softmax_fusion=False`` here), no sequence parallelism and no
distributed optimizer (neither existed then).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_chimera.config import ModelConfig
from megatron_chimera.schedules.walk import no_cyclic_gc
from megatron_chimera.tuning.analytic_costs import ModelSpec
from megatron_chimera.tuning.hardware import HardwareProfile
from megatron_chimera.tuning.perf_model import PerformanceModel
from megatron_chimera.tuning.training_plan import TrainingPlan

MEGATRON_SOURCE = ("Narayanan et al., SC'21 (arXiv 2104.04473), Table 1: A100 80 GB on Selene, "
                   "fp16, s = 2048, V = 51200, full recomputation, interleaved schedule")


@dataclass(frozen=True)
class PublishedRun:
    """One measured configuration: the model, the layout and the published TFLOP/s per GPU."""

    params: str  # the paper's label, e.g. "1.7B"
    heads: int
    hidden: int
    layers: int
    T: int
    D: int
    gpus: int
    batch: int  # global batch (sequences)
    tflops: float  # published TFLOP/s per GPU (Eq. 3)
    seq_length: int = 2048
    vocab_size: int = 51200
    micro_batch: int = 1

    @property
    def W(self) -> int:
        """Data-parallel width: GPUs / (T D)."""
        return self.gpus // (self.T * self.D)


MEGATRON_TABLE1: tuple[PublishedRun, ...] = (
    PublishedRun("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    PublishedRun("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    PublishedRun("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    PublishedRun("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    PublishedRun("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    PublishedRun("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    PublishedRun("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    PublishedRun("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    PublishedRun("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    PublishedRun("1008B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
)

MEGATRON_TABLE2_SOURCE = ("Narayanan et al., SC'21 (arXiv 2104.04473), Table 2, PTD-P rows (out of "
                          "sample): the same cluster and settings, fixed global batch, 1x-4x GPUs")

# Table 2 of the same paper (the comparison with ZeRO-3), its PTD parallelism rows: the 174.6B and
# 529.6B models of Table 1's family (96 layers / 12288 hidden / 96 heads and 105 / 20480 / 128) at
# a fixed global batch on 1x, 2x and 4x the GPUs, micro-batch 1, model-parallel size 96 = T 8 x D 12
# and 280 = T 8 x D 35. Published TFLOP/s per GPU: 153 / 149 / 141 and 171 / 167 / 159. Read from
# two independent transcriptions of the table found with the search tool (a paper-notes file that
# reproduces the whole table, and a figure inventory that quotes the 174.6B row's 153 / 149 / 141);
# the 529.6B rows rest on the first. None of these rows was used to build or check the model before
# it was frozen (they are reported as they come out: tools/validate_perf_model.py --published).
MEGATRON_TABLE2: tuple[PublishedRun, ...] = (
    PublishedRun("174.6B", 96, 12288, 96, 8, 12, 384, 1536, 153),
    PublishedRun("174.6B", 96, 12288, 96, 8, 12, 768, 1536, 149),
    PublishedRun("174.6B", 96, 12288, 96, 8, 12, 1536, 1536, 141),
    PublishedRun("529.6B", 128, 20480, 105, 8, 35, 560, 2240, 171),
    PublishedRun("529.6B", 128, 20480, 105, 8, 35, 1120, 2240, 167),
    PublishedRun("529.6B", 128, 20480, 105, 8, 35, 2240, 2240, 159),
)


def megatron_flops(config: ModelConfig, batch: int) -> float:
    """FLOPs of one iteration by Megatron's formula (Eq. 3 of the paper, with recomputation):
    ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))``."""
    s, h, layers, v = (config.seq_length, config.hidden_size, config.num_layers,
                       config.padded_vocab_size)
    return 96.0 * batch * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))


def run_spec(run: PublishedRun) -> ModelSpec:
    """The GPT model of a published row (fp16, unfused attention as in 2021)."""
    config = ModelConfig(num_layers=run.layers, hidden_size=run.hidden,
                         num_attention_heads=run.heads, seq_length=run.seq_length,
                         vocab_size=run.vocab_size, make_vocab_size_divisible_by=128,
                         params_dtype="fp16", masked_softmax_fusion=False)
    return ModelSpec(config, "gpt2")


def run_layout(run: PublishedRun) -> TrainingPlan:
    """The layout of a published row (module doc: the rule for what the table leaves out), on
    Megatron-LM's runtime (its blocking pipeline exchanges, ``schedules/blocking_p2p.py``)."""
    N = run.batch // (run.W * run.micro_batch)
    per_stage = run.layers // run.D
    virtual = next((v for v in range(2, per_stage + 1) if per_stage % v == 0), 1)
    if run.D > 1 and virtual > 1:
        return TrainingPlan.of("interleaved", run.D, run.W, run.micro_batch, N, True,
                               T=run.T, runtime="megatron", virtual_pipeline_size=virtual)
    return TrainingPlan.of("1f1b", run.D, run.W, run.micro_batch, N, True, T=run.T,
                           runtime="megatron")


@dataclass(frozen=True)
class Comparison:
    """Predicted against published TFLOP/s per GPU of one row."""

    run: PublishedRun
    layout: TrainingPlan
    predicted_tflops: float
    iteration_s: float

    @property
    def ratio(self) -> float:
        """Predicted / published."""
        return self.predicted_tflops / self.run.tflops

    @property
    def error(self) -> float:
        """|ratio - 1|."""
        return abs(self.ratio - 1.0)


@no_cyclic_gc()  # a simulation allocates millions of short-lived tuples, no cycles
def predict_run(run: PublishedRun, hardware: HardwareProfile) -> Comparison:
    """The model's TFLOP/s per GPU for one published row (Eq. 3 over the predicted time)."""
    spec, layout = run_spec(run), run_layout(run)
    seconds = PerformanceModel(spec, hardware).predict(layout, with_memory=False).iteration_s
    tflops = megatron_flops(spec.config, run.batch) / run.gpus / seconds / 1e12
    return Comparison(run, layout, tflops, seconds)


def ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    result = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            result[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return result


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation (Pearson's on the tie-averaged ranks)."""
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    var_a = sum((x - ma) ** 2 for x in ra)
    var_b = sum((y - mb) ** 2 for y in rb)
    return cov / (var_a * var_b) ** 0.5


@dataclass(frozen=True)
class Summary:
    """Mean error, worst row and rank correlation of a set of comparisons."""

    mean_error: float
    worst: Comparison
    spearman: float


def summarize(rows: Sequence[Comparison]) -> Summary:
    """The table's summary statistics."""
    return Summary(statistics.mean(r.error for r in rows), max(rows, key=lambda r: r.error),
                   spearman([r.predicted_tflops for r in rows], [r.run.tflops for r in rows]))


def format_published(rows: Sequence[Comparison], title: str) -> str:
    """Markdown table of the rows plus the summary line."""
    lines = [title, "",
             "| params | heads | hidden | layers | T | D | GPUs | batch | layout | iteration s "
             "| predicted TFLOP/s | published | ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        run = r.run
        lines.append(f"| {run.params} | {run.heads} | {run.hidden} | {run.layers} | {run.T} | "
                     f"{run.D} | {run.gpus} | {run.batch} | {r.layout.label} B={r.layout.B} | "
                     f"{r.iteration_s:.2f} | {r.predicted_tflops:.1f} | {run.tflops:g} | "
                     f"{r.ratio:.3f} |")
    s = summarize(rows)
    lines.append(f"\nmean error {100 * s.mean_error:.1f}%, worst row {s.worst.run.params} "
                 f"(ratio {s.worst.ratio:.3f}), Spearman {s.spearman:.3f} over "
                 f"{len(rows)} rows")
    return "\n".join(lines)
