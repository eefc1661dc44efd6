"""Qi et al.'s zero-bubble measurements (ICLR'24, Table 4) as data, and the model's prediction
of them (out of sample: none of these rows was used to build the model).

**Qi, Wan, Huang, Lin, "Zero Bubble Pipeline Parallelism", ICLR'24, Table 4**: A100 SXM 80 GB,
at most 32 GPUs on 4 nodes over RoCE; pure pipeline parallelism (pipeline stages = GPUs),
sequence 1024, first and last stage one layer fewer (they hold the embedding and the head);
samples per GPU per second for ``m`` micro-batches of ``b`` sequences.

The model as the authors ran it (their ``examples/pretrain_zero_bubble.sh`` of November 2023,
github.com/sail-sg/zero-bubble-pipeline-parallelism commit 425b42e): GPT with ``--fp16``, tied
embeddings, Megatron's default dropout (0.1) and fused scale-mask-softmax, no
``--use-flash-attn`` (the attention scores are materialised), ``GPTSentencePieceTokenizer``
(a 32,000-token SentencePiece vocabulary), ``--allow-padding-num-layers``, and 1F1B-I with
``--num-layers-per-virtual-pipeline-stage 1``. Priced from the ``a100-80gb`` profile with the
authors' stages (:func:`padded_layout`, their ``get_offset``): the layers padded up to a multiple
of the GPUs, split evenly, the two padding layers taken off the last and the first stage. 1F1B-I
has one layer per chunk, ``(layers + 2) / GPUs`` chunks per GPU (3, 4, 3, 2), so its first chunk
holds only the embedding and its last only the head (training here refuses such a chunk; the
model prices it). No recomputation. ZB-2p is our ``zb-2p`` (schedules/zb_2p.py). Each column
on the runtime it ran on (``TrainingPlan.runtime``): 1F1B and 1F1B-I on Megatron-LM's schedules
(blocking pipeline exchanges), ZB-2p and ZB-1p on the zero-bubble runtime (async exchanges; with
``--fp16`` a post-validated optimizer step, so back-to-back iterations overlap).
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_chimera.config import ModelConfig
from megatron_chimera.errors import ConfigError
from megatron_chimera.tuning.analytic_costs import ModelSpec
from megatron_chimera.tuning.hardware import HardwareProfile
from megatron_chimera.tuning.perf_model import PerformanceModel
from megatron_chimera.tuning.training_plan import TrainingPlan

QI_SOURCE = ("Qi et al., ICLR'24, Table 4: A100 SXM 80 GB, <= 32 GPUs on 4 nodes over RoCE, pure "
             "PP, s = 1024, samples per GPU per second")
QI_HARDWARE = "a100-80gb"  # the profile of the paper's cluster (its RoCE link's speed unpublished)
SCHEDULES = ("ZB-2p", "ZB-1p", "1F1B", "1F1B-I")
# Our schedule (registry name) for each published column; None: not in the IR yet.
OURS: dict[str, str | None] = {"ZB-2p": "zb-2p", "ZB-1p": "zb-h1", "1F1B": "1f1b",
                               "1F1B-I": "interleaved"}


@dataclass(frozen=True)
class ZBRun:
    """One (model, m) row of Table 4: published samples/GPU/s per schedule (``SCHEDULES``)."""

    params: str
    layers: int
    heads: int
    hidden: int
    gpus: int
    micro_batch: int
    microbatches: int
    published: tuple[float, float, float, float]


def _rows(params: str, layers: int, heads: int, hidden: int, gpus: int, b: int,
          ms: tuple[int, int, int], *columns: tuple[float, float, float]) -> tuple[ZBRun, ...]:
    return tuple(ZBRun(params, layers, heads, hidden, gpus, b, m,
                       tuple(col[i] for col in columns))  # type: ignore[arg-type]
                 for i, m in enumerate(ms))


QI_TABLE4: tuple[ZBRun, ...] = (
    _rows("1.5B", 22, 24, 2304, 8, 6, (24, 32, 64), (14.5, 14.8, 14.9), (12.9, 13.4, 14.2),
          (11.8, 12.5, 13.6), (13.1, 13.4, 13.9))
    + _rows("6.2B", 30, 32, 4096, 8, 3, (24, 32, 64), (4.32, 4.35, 4.39), (3.88, 4.00, 4.20),
            (3.50, 3.70, 4.03), (4.01, 4.08, 4.19))
    + _rows("14.6B", 46, 40, 5120, 16, 1, (48, 64, 128), (1.81, 1.83, 1.85), (1.61, 1.67, 1.76),
            (1.40, 1.49, 1.64), (1.54, 1.59, 1.66))
    + _rows("28.3B", 62, 48, 6144, 32, 1, (96, 128, 256), (0.99, 1.00, 1.00), (0.87, 0.90, 0.96),
            (0.76, 0.80, 0.88), (0.82, 0.85, 0.90))
)


def padded_layout(num_layers: int, ranks: int, virtual: int = 1) -> str:
    """The stages of the authors' ``--allow-padding-num-layers`` as a layout string: the layers
    padded up to a multiple of ``ranks``, split evenly over the ``ranks x virtual`` stages (in
    Megatron's chunk order), the padding then taken one layer each off the last stage, the first,
    the second, ... (their ``ParallelTransformer.get_offset``); a stage may end up empty."""
    padded = -(-num_layers // ranks) * ranks
    stages = ranks * virtual
    if padded % stages:
        raise ValueError(f"{padded} padded layers do not split over {stages} stages")
    sizes = [padded // stages] * stages
    for index in range(-1, padded - num_layers - 1):
        sizes[index] -= 1
    if min(sizes) < 0:
        raise ValueError(f"{padded - num_layers} padding layers exceed the stages' layers")
    parts = ["" if n == 0 else "t" if n == 1 else f"t*{n}" for n in sizes]
    return "E" + "|".join(parts) + "L"


def plan_of(run: ZBRun, column: str) -> TrainingPlan:
    """Our layout of a published column, on the authors' stages and runtime (module doc)."""
    name = OURS[column]
    if name is None:
        raise ValueError(f"{column} is not in the schedule IR")
    runtime = TrainingPlan.runtime_of(name)
    if name != "interleaved":
        return TrainingPlan.of(name, run.gpus, 1, run.micro_batch, run.microbatches, False,
                               partition=padded_layout(run.layers, run.gpus), runtime=runtime)
    virtual = -(-run.layers // run.gpus)  # one layer per chunk of the padded model
    return TrainingPlan.of(name, run.gpus, 1, run.micro_batch, run.microbatches, False,
                           partition=padded_layout(run.layers, run.gpus, virtual),
                           runtime=runtime, virtual_pipeline_size=virtual)


def zb_spec(run: ZBRun) -> ModelSpec:
    """The GPT model of a Table 4 row as the authors ran it (module doc): fp16, unfused attention
    with dropout, a 32,000-token vocabulary."""
    config = ModelConfig(num_layers=run.layers, hidden_size=run.hidden,
                         num_attention_heads=run.heads, seq_length=1024, vocab_size=32000,
                         make_vocab_size_divisible_by=128, params_dtype="fp16",
                         masked_softmax_fusion=False)
    return ModelSpec(config, "gpt2")


def predict_zb(run: ZBRun, hardware: HardwareProfile,
               model: PerformanceModel | None = None) -> dict[str, float | None]:
    """Predicted samples/GPU/s per published column (None: not priced, the schedule absent
    from the IR or the layout impossible)."""
    model = model or PerformanceModel(zb_spec(run), hardware)
    out: dict[str, float | None] = {}
    for column in SCHEDULES:
        try:
            seconds = model.predict(plan_of(run, column), with_memory=False).iteration_s
        except (ConfigError, ValueError):
            out[column] = None
            continue
        out[column] = run.micro_batch * run.microbatches / run.gpus / seconds
    return out


def order_holds(predicted: dict[str, float | None], published: Sequence[float],
                tie: float = 0.02) -> bool:
    """Whether the priced columns rank as published; two columns within ``tie`` of each other
    (published or predicted) count as either order."""
    cells = [(p, q) for p, q in zip((predicted[c] for c in SCHEDULES), published, strict=True)
             if p is not None]
    for (p1, q1), (p2, q2) in itertools.combinations(cells, 2):
        if abs(q1 / q2 - 1) <= tie or abs(p1 / p2 - 1) <= tie:
            continue
        if (p1 > p2) != (q1 > q2):
            return False
    return True


def format_zb(hardware: HardwareProfile) -> tuple[str, dict[str, object]]:
    """Markdown table (predicted / published / ratio per column) and the JSON record."""
    lines = [f"{QI_SOURCE}; model: --hardware {hardware.name}", "",
             "| model | GPUs | b | m | " + " | ".join(f"{c} pred / pub" for c in SCHEDULES) + " |",
             "|---|---|---|---|" + "---|" * len(SCHEDULES)]
    errors: list[float] = []
    records = []
    ordered = 0
    models: dict[str, PerformanceModel] = {}
    for run in QI_TABLE4:
        model = models.setdefault(run.params, PerformanceModel(zb_spec(run), hardware))
        predicted = predict_zb(run, hardware, model)
        cells = []
        for column, pub in zip(SCHEDULES, run.published, strict=True):
            pred = predicted[column]
            if pred is None:
                cells.append(f"n/a / {pub:g}")
            else:
                errors.append(abs(pred / pub - 1))
                cells.append(f"{pred:.3g} / {pub:g} ({pred / pub:.3f})")
        lines.append(f"| {run.params} | {run.gpus} | {run.micro_batch} | {run.microbatches} | "
                     + " | ".join(cells) + " |")
        holds = order_holds(predicted, run.published)
        ordered += holds
        records.append({"params": run.params, "m": run.microbatches, "predicted": predicted,
                        "order_as_published": holds,
                        "published": dict(zip(SCHEDULES, run.published, strict=True))})
    mean = statistics.mean(errors)
    lines.append(f"\nmean error {100 * mean:.1f}%, worst {100 * max(errors):.1f}% over "
                 f"{len(errors)} priced cells; the schedules in the published order (ties within "
                 f"2 %) in {ordered} of {len(QI_TABLE4)} (model, m) rows")
    return "\n".join(lines), {"source": QI_SOURCE, "hardware": hardware.name, "rows": records,
                              "mean_error": mean,
                              "worst_error": max(errors)}
