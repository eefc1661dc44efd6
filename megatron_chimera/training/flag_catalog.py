"""Which of Megatron-LM's GPT/BERT pretraining flags are refused and why, where the flags that set
no configuration field of their own go, and the check that a model family's flags are not given to
the other family's entry script.

A flag's help, default, choices and model family live on its configuration field
(:mod:`megatron_chimera.config.flag`). A flag Megatron-LM accepts but this framework does not is
rejected with one line naming it and the reason (``refused_flag_message``).
``tools/gen_flags_doc.py`` turns the parser and these tables into ``docs/FLAGS.md``; the tests
check that the document is current, that every flag has a description, and that every parsed flag
lands in a configuration field that library code reads (or is listed in ``CONSUMED_WHILE_PARSING``).
"""

from __future__ import annotations

import dataclasses
import re

from megatron_chimera.config import flag_fields
from megatron_chimera.model.family import FAMILIES, ModelFamily

# Parsed flags that are not a configuration field of the same name: where arguments.py puts them.
CONSUMED_WHILE_PARSING: dict[str, str] = {
    "accumulate_allreduce_grads_in_fp32": "`ddp.grad_reduce_in_fp32` (also set by --bf16)",
    "ddp_bucket_size": "`ddp.bucket_size`",
    "group_query_attention": "`model.num_query_groups` (None without it)",
    "norm_epsilon": "`model.layernorm_epsilon`",
    "no_apex": "`model.use_apex`, `optimizer.use_apex` = False",
    "lr_decay_iters": "`optimizer.lr_decay_samples` = iterations x global batch",
    "lr_warmup_iters": "`optimizer.lr_warmup_samples` = iterations x global batch",
    "num_layers_per_virtual_pipeline_stage": "`parallel.schedule_options` (virtual stages per "
                                             "rank = layers / (chunk layers x D))",
    "use_checkpoint_args": "the checkpoint's model flags, parsed ahead of the command line "
                           "(`checkpoint.saved_args.saved_run_flags`)",
}

# Parsed flags that no configuration field holds: who reads them instead (the tests check that
# the named module uses the flag).
READ_OUTSIDE_CONFIG: dict[str, tuple[str, str]] = {
    "debug_tracebacks": ("errors", "`errors.tracebacks_requested` reads it from the command line "
                                   "(every rank, every tool; also MEGATRON_CHIMERA_TRACEBACKS=1)"),
}

# Megatron flags accepted because what they ask for always holds here (nothing to configure).
ALWAYS_ON: dict[str, str] = {
    "data_impl": "always mmap (Megatron's MMIDIDX files; `infer` finds the same)",
    "no_scatter_gather_tensors_in_pipeline": "pipeline messages are never split over the "
                                             "tensor-parallel ranks (whole [s, b, h]; [s/T, b, h] "
                                             "chunks with --sequence-parallel)",
    "log_validation_ppl_to_tensorboard": "always written",
    "log_batch_size_to_tensorboard": "always written",
}

_ENC_DEC = "encoder-decoder (T5) models only; this framework pretrains GPT-2 and BERT"
_ARCH = "pre-norm transformers only (GeLU or SwiGLU MLP, LayerNorm or RMSNorm)"
_TE = "no Transformer Engine / FP8: the local implementation is the only one"
_FP8 = ("no FP8 training path yet (no Transformer Engine); tools/autotune.py --predict prices "
        "it")

# Megatron-LM GPT/BERT pretraining flags (23.06's network-size, regularization, training,
# initialization, learning-rate, checkpointing, mixed-precision, distributed, validation, data,
# logging and transformer-engine groups, plus later common ones) that are refused, and why.
REFUSED: dict[str, str] = {
    "--encoder-num-layers": _ENC_DEC, "--decoder-num-layers": _ENC_DEC,
    "--encoder-seq-length": _ENC_DEC, "--decoder-seq-length": _ENC_DEC,
    "--pipeline-model-parallel-split-rank": _ENC_DEC, "--vocab-extra-ids": _ENC_DEC,
    "--use-rotary-position-embeddings": "older spelling: use --position-embedding-type rope",
    "--no-position-embedding": "older spelling: use --position-embedding-type none",
    "--apply-layernorm-1p": _ARCH, "--apply-residual-connection-post-layernorm": _ARCH,
    "--openai-gelu": "use --gelu tanh", "--squared-relu": _ARCH,
    "--rotary-interleaved": "RoPE uses the rotate-half convention only (Megatron's and "
                            "transformers' default)",
    "--rotary-seq-len-interpolation-factor": "RoPE position interpolation is not implemented "
                                             "(--use-rope-scaling is Llama 3.1's)",
    "--onnx-safe": "no ONNX export",
    "--embedding-weights-in-fp32": "embeddings are kept in the parameter dtype",
    "--log-params-norm": "the parameter norm is not computed",
    "--log-num-zeros-in-grad": "zero-gradient counting is not wired to the log line",
    "--timing-log-option": "timers are those of the logging rank (no min/max over ranks)",
    "--no-barrier-with-level-1-timing": "timers never add a barrier across ranks (level 1 "
                                        "synchronises the device only)",
    "--tensorboard-queue-size": "the TensorBoard writer queue is fixed (1000)",
    "--no-log-learnig-rate-to-tensorboard": "the learning rate is always written",
    "--no-log-loss-scale-to-tensorboard": "the loss scale is always written",
    "--log-world-size-to-tensorboard": "not implemented",
    "--log-progress": "not implemented",
    "--disable-straggler-on-startup": "the straggler detector has no runtime switch (Megatron's "
                                      "controller port): leave --log-straggler off instead",
    "--straggler-ctrlr-port": "the straggler detector has no runtime switch (no controller "
                              "port); --log-straggler turns it on for the whole run",
    "--start-weight-decay": "weight decay is constant (no increment schedule)",
    "--end-weight-decay": "weight decay is constant (no increment schedule)",
    "--weight-decay-incr-style": "weight decay is constant (no increment schedule)",
    "--batch-size": "removed in Megatron-LM: use --micro-batch-size",
    "--recompute-activations": "use --recompute-granularity selective",
    "--checkpoint-activations": "removed in Megatron-LM: use --recompute-granularity full "
                                "--recompute-method uniform --recompute-num-layers 1",
    "--distribute-saved-activations": "not implemented: full recomputation keeps each "
                                      "checkpointed layer input whole on every tensor-parallel "
                                      "rank (--sequence-parallel splits it)",
    "--model-parallel-size": "removed in Megatron-LM: use --tensor-model-parallel-size",
    "--dataloader-type": "only Megatron's default single (sequential, resumable) sampler",
    "--no-persist-layer-norm": "there is no persistent layer-norm kernel to turn off; drop "
                               "the flag",
    "--data-parallel-random-init": "data-parallel replicas always start identical",
    "--init-method-xavier-uniform": "only Megatron's normal initialisation",
    "--warmup": "removed in Megatron-LM: use --lr-warmup-fraction / --lr-warmup-iters",
    "--no-save-rng": "the RNG states are always saved (--no-load-rng skips loading them)",
    "--no-initialization": "weights are always initialised before loading",
    "--use-dist-ckpt": "deprecated in Megatron-LM: --ckpt-format torch_dist (the default) is "
                       "the distributed format",
    "--fp32-residual-connection": "the residual stream is kept in the parameter dtype",
    "--no-query-key-layer-scaling": "older spelling: layer scaling is off by default, as in "
                                    "current Megatron-LM (--apply-query-key-layer-scaling)",
    "--fp16-lm-cross-entropy": "the LM cross-entropy is always computed in fp32",
    "--overlap-p2p-communication": "point-to-point messages are part of the lowered schedule "
                                   "(receives posted ahead); no flag",
    "--DDP-impl": "one gradient synchroniser (contiguous buckets, eager reduction order)",
    "--no-contiguous-buffers-in-local-ddp": "gradient buckets are always contiguous",
    "--use-ring-exchange-p2p": "not implemented",
    "--lazy-mpu-init": "not implemented",
    "--use-cpu-initialization": "weights are always initialised on the CPU; drop the flag",
    "--empty-unused-memory-level": "not implemented",
    "--standalone-embedding-stage": "not implemented (--partition-method parameters balances "
                                    "the embedding instead)",
    "--skip-train": "not implemented",
    "--retriever-seq-length": "retrieval (ICT / Retro) models only",
    "--sample-rate": "not implemented",
    "--mmap-warmup": "not implemented",
    "--fp8-e4m3": _TE, "--fp8-hybrid": _TE, "--no-fp8-wgrad": _TE, "--fp8-margin": _TE,
    "--fp8-interval": _TE, "--fp8-amax-history-len": _TE, "--fp8-amax-compute-algo": _TE,
    "--fp8-format": _FP8, "--fp8-recipe": _FP8, "--fp8-param-gather": _FP8,
    "--transformer-impl": _TE, "--attention-backend": _TE,
    "--use-mcore-models": "one model implementation (Megatron's legacy module names)",
    "--moe-router-enable-expert-bias": "aux-loss-free expert-bias routing is not implemented "
                                       "(--moe-router-load-balancing-type balances instead)",
    "--moe-router-bias-update-rate": "aux-loss-free expert-bias routing is not implemented",
    "--moe-router-num-groups": "group-limited routing is not implemented",
    "--moe-router-group-topk": "group-limited routing is not implemented",
    "--moe-router-topk-scaling-factor": "the routing weights are not rescaled",
    "--moe-token-drop-policy": "over capacity, the lowest-probability tokens are dropped "
                               "(Megatron's default policy, probs)",
    "--moe-pad-expert-input-to-capacity": "expert inputs are never padded to the capacity",
    "--moe-input-jitter-eps": "no input jitter in the router",
    "--moe-permute-fusion": "no fused permutation kernels (torch-native token permutation)",
    "--moe-enable-deepep": "no DeepEP dispatcher: --moe-token-dispatcher-type alltoall or "
                           "allgather",
    "--moe-shared-expert-overlap": "not implemented: --overlap-moe-expert-parallel-comm hides the "
                                   "all-to-all behind the paired micro-batch instead",
    "--use-legacy-models": "one model implementation (Megatron's legacy module names); drop "
                           "the flag",
}

# Megatron-LM's GPT/BERT pretraining flags this audit covers (see REFUSED for the groups).
MEGATRON_FLAGS: tuple[str, ...] = (
    # network size
    "--num-layers", "--encoder-num-layers", "--decoder-num-layers", "--hidden-size",
    "--ffn-hidden-size", "--num-attention-heads", "--kv-channels", "--max-position-embeddings",
    "--use-rotary-position-embeddings", "--rotary-percent", "--no-position-embedding",
    "--make-vocab-size-divisible-by", "--layernorm-epsilon", "--apply-layernorm-1p",
    "--apply-residual-connection-post-layernorm", "--openai-gelu", "--squared-relu", "--swiglu",
    "--onnx-safe", "--bert-no-binary-head",
    "--untie-embeddings-and-output-weights", "--embedding-weights-in-fp32",
    "--position-embedding-type", "--normalization", "--group-query-attention",
    "--num-query-groups", "--norm-epsilon", "--add-qkv-bias", "--rotary-base",
    "--use-rope-scaling", "--rope-scaling-factor", "--rotary-interleaved",
    "--rotary-seq-len-interpolation-factor",
    # logging
    "--log-params-norm", "--log-num-zeros-in-grad", "--timing-log-level",
    "--no-barrier-with-level-1-timing", "--timing-log-option", "--tensorboard-log-interval",
    "--tensorboard-queue-size", "--log-timers-to-tensorboard", "--log-batch-size-to-tensorboard",
    "--no-log-learnig-rate-to-tensorboard", "--no-log-loss-scale-to-tensorboard",
    "--log-validation-ppl-to-tensorboard", "--log-memory-to-tensorboard",
    "--log-world-size-to-tensorboard", "--log-throughput", "--log-progress",
    "--disable-straggler-on-startup", "--straggler-ctrlr-port",
    "--wandb-project", "--wandb-exp-name", "--wandb-save-dir",
    # regularization
    "--attention-dropout", "--hidden-dropout", "--weight-decay", "--start-weight-decay",
    "--end-weight-decay", "--weight-decay-incr-style", "--clip-grad", "--adam-beta1",
    "--adam-beta2", "--adam-eps", "--sgd-momentum",
    # training
    "--micro-batch-size", "--batch-size", "--global-batch-size", "--rampup-batch-size",
    "--recompute-activations", "--recompute-granularity", "--distribute-saved-activations",
    "--recompute-method", "--recompute-num-layers", "--checkpoint-activations", "--train-iters",
    "--train-samples", "--log-interval", "--exit-interval", "--exit-duration-in-mins",
    "--no-check-for-nan-in-loss-and-grad",
    "--exit-signal-handler", "--tensorboard-dir", "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--use-flash-attn",
    "--disable-bias-linear", "--optimizer", "--dataloader-type",
    "--no-async-tensor-model-parallel-allreduce", "--no-persist-layer-norm",
    "--sequence-parallel", "--no-gradient-accumulation-fusion",
    # initialization
    "--seed", "--data-parallel-random-init", "--init-method-std", "--init-method-xavier-uniform",
    # learning rate
    "--lr", "--lr-decay-style", "--lr-decay-iters", "--lr-decay-samples", "--lr-warmup-fraction",
    "--lr-warmup-iters", "--lr-warmup-samples", "--warmup", "--min-lr",
    # checkpointing
    "--save", "--save-interval", "--no-save-optim", "--no-save-rng", "--load", "--no-load-optim",
    "--no-load-rng", "--finetune", "--no-initialization", "--use-checkpoint-args",
    "--exit-on-missing-checkpoint", "--ckpt-format", "--use-dist-ckpt", "--async-save",
    # mixed precision
    "--fp16", "--bf16", "--loss-scale", "--initial-loss-scale", "--min-loss-scale",
    "--loss-scale-window", "--hysteresis", "--fp32-residual-connection",
    "--no-query-key-layer-scaling", "--apply-query-key-layer-scaling",
    "--attention-softmax-in-fp32", "--accumulate-allreduce-grads-in-fp32",
    "--fp16-lm-cross-entropy",
    # distributed
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
    "--pipeline-model-parallel-split-rank", "--model-parallel-size",
    "--num-layers-per-virtual-pipeline-stage", "--overlap-p2p-communication",
    "--distributed-backend", "--distributed-timeout-minutes", "--DDP-impl",
    "--no-contiguous-buffers-in-local-ddp", "--no-scatter-gather-tensors-in-pipeline",
    "--use-ring-exchange-p2p", "--lazy-mpu-init", "--use-cpu-initialization",
    "--empty-unused-memory-level", "--standalone-embedding-stage", "--use-distributed-optimizer",
    "--pipeline-model-parallel-layout", "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers", "--account-for-embedding-in-pipeline-split",
    "--account-for-loss-in-pipeline-split",
    "--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size",
    "--context-parallel-size", "--cp-comm-type", "--hierarchical-context-parallel-sizes",
    # validation
    "--eval-iters", "--eval-interval", "--skip-train",
    # data and tokenizer
    "--data-path", "--split", "--train-data-path", "--valid-data-path", "--test-data-path",
    "--data-cache-path", "--mock-data", "--vocab-size", "--vocab-file", "--merge-file",
    "--vocab-extra-ids", "--seq-length", "--encoder-seq-length", "--decoder-seq-length",
    "--retriever-seq-length", "--sample-rate", "--mask-prob", "--short-seq-prob", "--mmap-warmup",
    "--num-workers", "--tokenizer-type", "--tokenizer-model", "--data-impl",
    "--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss",
    # mixture of experts (Megatron-core's MoE group)
    "--num-experts", "--moe-ffn-hidden-size", "--moe-router-topk", "--moe-router-score-function",
    "--moe-router-load-balancing-type", "--moe-aux-loss-coeff", "--moe-z-loss-coeff",
    "--moe-router-pre-softmax", "--moe-shared-expert-intermediate-size",
    "--moe-shared-expert-gate", "--moe-layer-freq",
    "--moe-expert-capacity-factor", "--moe-token-dispatcher-type", "--moe-grouped-gemm",
    "--moe-per-layer-logging", "--expert-model-parallel-size", "--expert-tensor-parallel-size",
    "--overlap-moe-expert-parallel-comm", "--moe-router-enable-expert-bias",
    "--moe-router-bias-update-rate", "--moe-router-num-groups", "--moe-router-group-topk",
    "--moe-router-topk-scaling-factor", "--moe-token-drop-policy",
    "--moe-pad-expert-input-to-capacity", "--moe-input-jitter-eps", "--moe-permute-fusion",
    "--moe-enable-deepep", "--moe-shared-expert-overlap",
    # transformer engine
    "--fp8-e4m3", "--fp8-hybrid", "--no-fp8-wgrad", "--fp8-margin", "--fp8-interval",
    "--fp8-amax-history-len", "--fp8-amax-compute-algo", "--fp8-format", "--fp8-recipe",
    "--fp8-param-gather", "--transformer-impl",
    "--attention-backend", "--use-mcore-models", "--use-legacy-models",
)


_UNRECOGNIZED = re.compile(r"unrecognized arguments: (.*)")


def refused_flag_message(argparse_message: str) -> str | None:
    """For argparse's "unrecognized arguments" naming a refused Megatron flag: one line naming
    it and the reason; None otherwise (argparse's own message stands)."""
    match = _UNRECOGNIZED.match(argparse_message)
    if match is None:
        return None
    for token in match.group(1).split():
        flag = token.split("=", 1)[0]
        if flag in REFUSED:
            return f"{flag} is not supported: {REFUSED[flag]}"
    return None


def family_flag_errors(config: object, family: ModelFamily) -> list[str]:
    """One message per flag of the other model family that ``config`` (a TrainConfig) sets away
    from its default, so an entry script rejects it instead of ignoring it."""
    errors = []
    parts = [getattr(config, section.name) for section in dataclasses.fields(config)]
    parts = [p for p in parts if dataclasses.is_dataclass(p)]
    parts += [getattr(p, f.name) for p in parts for f in dataclasses.fields(p)  # ModelConfig.moe
              if hasattr(getattr(p, f.name), "FLAG_GROUP")]  # (a nested flag section)
    for part in parts:
        for field, spec in flag_fields(type(part)):
            if spec.family is None or spec.family == family.name:
                continue
            if getattr(part, field.name) != field.default:
                other = FAMILIES[spec.family]
                errors.append(f"{spec.name} applies to {other.title} ({other.entry_point}) only")
    return errors
