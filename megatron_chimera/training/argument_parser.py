"""Megatron's command-line flags: the argparse parser, one group per concern.

:func:`build_parser` defines every flag (its help from :mod:`.flag_catalog`, the schedule flags
from the schedule registry); :mod:`.arguments` turns the parsed namespace into the validated
configuration dataclasses. The parser raises :class:`~megatron_chimera.config.ConfigError`
instead of printing usage and exiting, so a bad flag fails every rank the same way.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from megatron_chimera.config import (
    GELU_VARIANTS,
    NORMALIZATIONS,
    POSITION_EMBEDDING_TYPES,
    ConfigError,
)
from megatron_chimera.data.tokenizers import TOKENIZER_TYPES
from megatron_chimera.errors import DEBUG_FLAG
from megatron_chimera.model.document_attention import IMPLEMENTATIONS as DOCUMENT_ATTENTIONS
from megatron_chimera.schedules.registry import add_schedule_arguments
from megatron_chimera.training.flag_catalog import apply_help, refused_flag_message

__all__ = ["build_parser", "add_architecture_arguments", "PARTITION_METHODS",
           "DEFAULT_PROFILE_ITERATIONS"]

PARTITION_METHODS = ("uniform", "parameters", "time")
DEFAULT_PROFILE_ITERATIONS = 3  # the first is a warm-up, the other two are measured


class _ArgumentParser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of printing usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(refused_flag_message(message) or message)


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("network size")
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--layernorm-epsilon", type=float, default=1e-5)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--attention-softmax-in-fp32", action="store_true")
    g.add_argument("--apply-query-key-layer-scaling", action="store_true")
    g.add_argument("--bert-no-binary-head", action="store_false", dest="bert_binary_head")
    g.add_argument("--no-masked-softmax-fusion", action="store_false",
                   dest="masked_softmax_fusion")
    g.add_argument("--no-bias-gelu-fusion", action="store_false", dest="bias_gelu_fusion")
    g.add_argument("--no-bias-dropout-fusion", action="store_false", dest="bias_dropout_fusion")
    g.add_argument("--use-flash-attn", action="store_true")
    g.add_argument("--document-attention", choices=DOCUMENT_ATTENTIONS, default="auto")
    g.add_argument("--gelu", choices=GELU_VARIANTS, default="megatron",
                   help="megatron: tanh approximation in the MLP, exact in BERT's LM head; "
                        "tanh / erf: that form everywhere (Hugging Face's gelu_new / gelu)")
    g.add_argument("--no-apex", action="store_true",
                   help="use torch-native kernels even when NVIDIA Apex is importable")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)
    add_architecture_arguments(g)
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)


def add_architecture_arguments(g: argparse._ActionsContainer) -> None:
    """Today's decoders (Megatron's flags and defaults): normalisation, SwiGLU, head sizes,
    grouped-query attention, biases, position embeddings."""
    g.add_argument("--normalization", choices=NORMALIZATIONS, default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=None, dest="norm_epsilon")
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    g.add_argument("--add-qkv-bias", action="store_true")
    g.add_argument("--position-embedding-type", choices=POSITION_EMBEDDING_TYPES,
                   default="learned_absolute")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--use-rope-scaling", action="store_true")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0)


def _add_parallel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--no-async-tensor-model-parallel-allreduce", action="store_false",
                   dest="async_tensor_model_parallel_allreduce")
    g.add_argument("--no-scatter-gather-tensors-in-pipeline", action="store_true")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    add_schedule_arguments(g)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="interleaved: layers per model chunk (alternative to "
                        "--num-virtual-stages-per-pipeline-rank)")
    g.add_argument("--partition-method", choices=PARTITION_METHODS, default="uniform")
    g.add_argument("--pipeline-model-parallel-layout", default=None)
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true")
    g.add_argument("--profile-iterations", type=int, default=None)
    g.add_argument("--distributed-backend", choices=("nccl", "gloo"), default=None)
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="accumulate and reduce gradients in fp32 buffers (always on with --bf16)")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="reduce each gradient bucket as soon as it is final, during the stage's "
                        "last backward (otherwise each stage once its last backward is done)")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="elements per gradient bucket (default: max(40M, 1M x stage-replica "
                        "group size) with --overlap-grad-reduce, else one bucket per stage)")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard fp32 main parameters and optimizer state over each "
                        "stage-replica group (ZeRO-1)")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="all-gather updated parameters in the background; each stage waits "
                        "before its first forward (needs --use-distributed-optimizer)")
    g.add_argument("--no-gradient-accumulation-fusion", action="store_false",
                   dest="gradient_accumulation_fusion",
                   help="materialise each weight gradient and add it into the gradient buffer "
                        "in a hook, instead of computing it straight into main_grad")
    g.add_argument("--allow-cpu-training", action="store_true",
                   help="with --distributed-backend gloo on a machine with CUDA devices: train "
                        "on the CPU on purpose (refused otherwise)")


def _add_training_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--rampup-batch-size", type=int, nargs=3, default=None,
                   metavar=("START", "INCREMENT", "SAMPLES"))
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None)
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--exit-duration-in-mins", type=float, default=None)
    g.add_argument("--exit-signal-handler", action="store_true")
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--check-for-nan-in-loss-and-grad", action="store_true", default=True)
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false",
                   dest="check_for_nan_in_loss_and_grad",
                   help="no NaN/Inf check of the losses and gradients (Megatron-LM's flag)")
    g.add_argument("--max-consecutive-skipped-iterations", type=int, default=100)
    g = parser.add_argument_group("optimizer")
    g.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"),
                   default="linear")
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-decay-samples", type=int, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=None)
    g.add_argument("--lr-warmup-samples", type=int, default=None)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g = parser.add_argument_group("mixed precision")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None)
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)


def _add_data_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data and tokenizer")
    g.add_argument("--data-path", nargs="*", default=None)
    g.add_argument("--split", default=None)
    g.add_argument("--train-data-path", nargs="*", default=None)
    g.add_argument("--valid-data-path", nargs="*", default=None)
    g.add_argument("--test-data-path", nargs="*", default=None)
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--data-impl", choices=("mmap", "infer"), default="mmap")
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--vocab-size", type=int, default=None)
    g.add_argument("--num-workers", type=int, default=2)
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--mask-prob", type=float, default=0.15)
    g.add_argument("--short-seq-prob", type=float, default=0.1)
    g.add_argument("--no-whole-word-masking", action="store_false", dest="whole_word_masking")
    g.add_argument("--masking-max-ngram", type=int, default=3)
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")


def _add_checkpoint_and_logging_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--use-checkpoint-args", action="store_true")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true")
    g.add_argument("--ckpt-format", default="torch_dist", choices=("torch_dist", "torch"))
    g.add_argument("--async-save", action="store_true")
    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--tensorboard-log-interval", type=int, default=1)
    g.add_argument("--log-throughput", action="store_true")
    g.add_argument("--log-timers-to-tensorboard", action="store_true")
    g.add_argument("--timing-log-level", type=int, default=0, choices=(0, 1, 2),
                   help="0: timers record CUDA events, read at logging iterations (no device "
                        "sync inside the step); 1 or 2: every timer synchronises the device at "
                        "start and stop (Megatron's accurate per-part timers; the same set of "
                        "timers at both levels)")
    g.add_argument("--log-memory-to-tensorboard", action="store_true")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--log-batch-size-to-tensorboard", action="store_true")
    g.add_argument("--pipeline-trace", default=None, metavar="FILE")
    g.add_argument("--wandb-project", default=None)
    g.add_argument("--wandb-exp-name", default=None)
    g.add_argument("--wandb-save-dir", default=None)
    g.add_argument(DEBUG_FLAG, action="store_true")


def build_parser(
    extra_args_provider: Callable[[argparse.ArgumentParser], argparse.ArgumentParser] | None = None,
) -> argparse.ArgumentParser:
    """The full Megatron-style parser; ``extra_args_provider`` may add script-specific flags."""
    parser = _ArgumentParser(description="megatron_chimera arguments", allow_abbrev=False)
    _add_model_args(parser)
    _add_parallel_args(parser)
    _add_training_args(parser)
    _add_data_args(parser)
    _add_checkpoint_and_logging_args(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser) or parser
    apply_help(parser)
    return parser
