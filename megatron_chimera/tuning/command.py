"""The ready-to-run ``torchrun ... pretrain_gpt2.py|pretrain_bert.py`` command of a layout."""

from __future__ import annotations

import shlex

from megatron_chimera.model.flags import model_flags
from megatron_chimera.model.stage_split import format_layout
from megatron_chimera.tuning.analytic_costs import ModelSpec, partition_stages
from megatron_chimera.tuning.training_plan import TrainingPlan

DATA_FLAGS = {
    "gpt2": ["--data-path", "$DATA_PATH", "--tokenizer-type", "GPT2BPETokenizer",
             "--vocab-file", "$VOCAB_FILE", "--merge-file", "$MERGE_FILE"],
    "bert": ["--data-path", "$DATA_PATH", "--tokenizer-type", "BertWordPieceLowerCase",
             "--vocab-file", "$VOCAB_FILE"],
}
# a RoPE decoder (Llama, Mistral, Qwen2) takes its Hugging Face tokenizer
HF_DATA_FLAGS = ["--data-path", "$DATA_PATH", "--tokenizer-type", "HuggingFaceTokenizer",
                 "--tokenizer-model", "$TOKENIZER_DIR"]


def data_flags(spec: ModelSpec) -> list[str]:
    """The data and tokenizer flags of the command (paths left as environment variables)."""
    if spec.family.name == "gpt2" and spec.config.position_embedding_type == "rope":
        return HF_DATA_FLAGS
    return DATA_FLAGS[spec.family.name]


def _launcher(num_gpus: int, gpus_per_node: int) -> list[str]:
    if num_gpus <= gpus_per_node:
        return ["torchrun", "--nproc-per-node", str(num_gpus)]
    nodes = -(-num_gpus // gpus_per_node)
    return ["torchrun", "--nnodes", str(nodes), "--nproc-per-node", str(gpus_per_node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", "$MASTER_ADDR:29500"]


def pretrain_flags(spec: ModelSpec, layout: TrainingPlan) -> list[str]:
    """Megatron flags of the model and of ``layout`` (sizes, schedule, batch, precision)."""
    cfg = spec.config
    flags = model_flags(cfg, seq_length=cfg.seq_length)
    if layout.T > 1:
        flags += ["--tensor-model-parallel-size", str(layout.T)]
        if layout.sequence_parallel:
            flags.append("--sequence-parallel")
    if layout.CP > 1:  # ring attention; no dropout with CP (the training flags refuse it)
        flags += ["--context-parallel-size", str(layout.CP), "--cp-comm-type", "p2p",
                  "--hidden-dropout", "0", "--attention-dropout", "0"]
    flags += ["--pipeline-model-parallel-size", str(layout.D)]
    if layout.EP > 1:
        flags += ["--expert-model-parallel-size", str(layout.EP)]
    moe = cfg.moe
    if moe.enabled and moe.moe_token_dispatcher_type != "allgather":
        flags += ["--moe-token-dispatcher-type", moe.moe_token_dispatcher_type]
    if moe.enabled and moe.moe_grouped_gemm:
        flags.append("--moe-grouped-gemm")
    flags += layout.spec.to_flags(layout.options)
    if layout.slices > 1:
        flags += ["--pipeline-sequence-slices", str(layout.slices)]
    if layout.partition != "uniform":  # the stages proposed, as Megatron's layout string
        pieces = partition_stages(spec, layout.num_stages, layout.partition)
        flags += ["--pipeline-model-parallel-layout",
                  format_layout([p.layer_range for p in pieces])]
    flags += ["--micro-batch-size", str(layout.B),
              "--global-batch-size", str(layout.global_batch_size)]
    if layout.recompute_mode == "selective":
        flags += ["--recompute-granularity", "selective"]
    elif layout.recompute:
        flags += ["--recompute-granularity", "full", "--recompute-method", "uniform",
                  "--recompute-num-layers", "1"]
    if layout.distributed_optimizer:
        flags += ["--use-distributed-optimizer", "--overlap-param-gather"]
    if cfg.params_dtype == "fp16":
        flags.append("--fp16")
    elif cfg.params_dtype == "bf16":
        flags.append("--bf16")
    return flags


def torchrun_command(spec: ModelSpec, layout: TrainingPlan, gpus_per_node: int) -> str:
    """The shell command that trains ``layout`` (data paths left as environment variables)."""
    num_gpus = layout.num_gpus
    words = _launcher(num_gpus, gpus_per_node) + [spec.family.entry_point]
    words += pretrain_flags(spec, layout) + data_flags(spec)
    words += ["--train-iters", "$TRAIN_ITERS", "--lr", "$LR"]
    quoted = [w if w.startswith("$") else shlex.quote(w) for w in words]
    lines, current = [], quoted[0]
    for word in quoted[1:]:
        if word.startswith("--") and len(current) > 60:
            lines.append(current)
            current = "    " + word
        else:
            current += " " + word
    lines.append(current)
    return " \\\n".join(lines)
