"""What every command-line flag means, which model family it applies to, and which of Megatron-LM's
GPT/BERT pretraining flags are refused and why.

``arguments.build_parser`` takes the help strings from here, and a flag Megatron-LM accepts but this
framework does not is rejected with one line naming it and the reason (``refused_flag_message``).
``tools/gen_flags_doc.py`` turns the parser and these tables into ``docs/FLAGS.md``; the tests
check that the document is current, that every flag has a description, and that every parsed flag
lands in a configuration field that library code reads (or is listed in ``CONSUMED_WHILE_PARSING``).
"""

from __future__ import annotations

import argparse
import dataclasses
import re

from megatron_chimera.model.family import FAMILIES, ModelFamily

HELP: dict[str, str] = {
    # network size / model
    "num_layers": "number of transformer layers",
    "hidden_size": "transformer hidden size h",
    "ffn_hidden_size": "MLP hidden size (default 4h; with --swiglu 8h/3 rounded down to a "
                       "multiple of 64)",
    "num_attention_heads": "attention heads (h must be divisible by them)",
    "seq_length": "tokens per sample",
    "max_position_embeddings": "learned position embeddings (default --seq-length)",
    "make_vocab_size_divisible_by": "pad the vocabulary to a multiple of this",
    "hidden_dropout": "dropout after the embedding and on each residual branch",
    "attention_dropout": "dropout on the attention probabilities",
    "init_method_std": "std of the normal weight initialisation (output layers scaled by "
                       "1/sqrt(2L))",
    "layernorm_epsilon": "epsilon of the layer norms (LayerNorm or RMSNorm; Megatron's older "
                         "name of --norm-epsilon)",
    "norm_epsilon": "epsilon of the layer norms (LayerNorm or RMSNorm; default 1e-5)",
    "normalization": "the layer norms: LayerNorm or RMSNorm (weight only)",
    "swiglu": "GPT: SwiGLU MLP, silu(x W_gate) * (x W_up) from one fused [gate; up] projection "
              "(each tensor rank holds matching halves)",
    "kv_channels": "channels per attention head (default hidden size / attention heads)",
    "group_query_attention": "GPT: grouped-query attention (--num-query-groups key/value heads, "
                             "divided over the tensor-parallel ranks)",
    "num_query_groups": "GPT: key/value heads with --group-query-attention (default 1); must "
                        "divide the attention heads, T must divide it",
    "add_bias_linear": "GPT: no biases in the transformer's linear layers (QKV, dense, MLP)",
    "add_qkv_bias": "GPT: a QKV bias even with --disable-bias-linear (Qwen2)",
    "position_embedding_type": "GPT: learned_absolute (learned table), rope (rotary, in the "
                               "attention; positions follow --reset-position-ids) or none",
    "rotary_base": "RoPE: base of the rotation frequencies",
    "rotary_percent": "RoPE: fraction of each head's channels rotated",
    "use_rope_scaling": "RoPE: Llama 3.1's frequency scaling (low/high frequency factors 1 and "
                        "4, original context 8192)",
    "rope_scaling_factor": "RoPE: the factor of --use-rope-scaling",
    "untie_embeddings_and_output_weights": "GPT: separate output layer instead of the tied "
                                           "word embedding",
    "attention_softmax_in_fp32": "unfused attention: softmax in fp32 (the fused kernels "
                                 "already accumulate in fp32; warned once there)",
    "apply_query_key_layer_scaling": "unfused attention: scale scores by 1/layer and back in "
                                     "the fp32 softmax (a no-op on the fused path; warned once)",
    "bert_binary_head": "BERT: no sentence-order head (and no token types)",
    "masked_softmax_fusion": "attention as matmul, masked softmax, dropout, matmul instead of "
                             "scaled_dot_product_attention",
    "bias_gelu_fusion": "GeLU as its tanh formula in separate ops instead of one kernel",
    "bias_dropout_fusion": "output projections return their bias and residual + dropout(x + "
                           "bias) runs as separate ops (bias gradient then computed in B, not W)",
    "use_flash_attn": "CUDA: restrict scaled_dot_product_attention to its flash / "
                      "memory-efficient kernels and fail naming the reason when neither applies "
                      "(CPU: warned once, no effect)",
    "document_attention": "GPT --reset-attention-mask kernel: varlen (flash, CUDA 16-bit, no "
                          "attention dropout), flex (flex_attention, CUDA), loop (SDPA per "
                          "document), mask (block-diagonal mask); auto picks",
    "no_apex": "use torch-native kernels even when NVIDIA Apex is importable",
    "recompute_granularity": "activation recomputation: selective (the attention core; skipped "
                             "where a CUDA flash kernel keeps no scores) or full",
    "recompute_method": "full recomputation: uniform (groups of layers) or block (first layers)",
    "recompute_num_layers": "layers per group (uniform) or recomputed layers per stage (block)",
    # distributed
    "tensor_model_parallel_size": "tensor-parallel size T: attention heads, MLP and vocabulary "
                                  "split over T ranks (world = T x W x D)",
    "sequence_parallel": "with T > 1: LayerNorm / dropout regions split along the sequence over "
                         "the tensor-parallel ranks; pipeline messages are [s/T, b, h]",
    "async_tensor_model_parallel_allreduce": "T > 1: sum a column-parallel layer's input "
                                             "gradient synchronously after its backward instead "
                                             "of asynchronously, overlapped with its weight "
                                             "gradient",
    "no_scatter_gather_tensors_in_pipeline": "accepted: pipeline messages are never split over "
                                             "the tensor-parallel ranks (--sequence-parallel "
                                             "sends 1/T of the bytes)",
    "pipeline_model_parallel_size": "pipeline stages D (data-parallel size W = world / (T x D))",
    "num_layers_per_virtual_pipeline_stage": "interleaved 1F1B: layers per model chunk",
    # the schedule flags (--pipeline-schedule, --chimera-*, ...) carry their help in the
    # schedule registry (megatron_chimera/schedules/registry.py)
    "partition_method": "layers per stage: uniform counts, balanced parameters, or balanced "
                        "measured time (embedding and LM head included; for Chimera the time "
                        "of each rank's stage replicas together)",
    "pipeline_model_parallel_layout": "uneven stages as Megatron's layout string: E embedding, t "
                                      "layer, L loss, | stage boundary, x*k and (...)*k repeat, "
                                      "e.g. \"Et*3|t*2|t*2|tL\" (Chimera: one pipe's stages, the "
                                      "mirror pipe holds the same)",
    "decoder_first_pipeline_num_layers": "transformer layers of the first stage (the other "
                                         "layers split evenly over the remaining stages)",
    "decoder_last_pipeline_num_layers": "transformer layers of the last stage (the other layers "
                                        "split evenly over the remaining stages)",
    "account_for_embedding_in_pipeline_split": "count the embedding as one layer when splitting: "
                                               "the first stage holds one layer less",
    "account_for_loss_in_pipeline_split": "count the loss (final norm, head) as one layer when "
                                          "splitting: the last stage holds one layer less",
    "profile_iterations": "split-backward schedules (chimera-zb, zb-h1): time F, B, W per stage "
                          "during the first K iterations (the first one a warm-up when K > 1), "
                          "then rebuild the order for the measured costs; 0 turns it off "
                          "(default 3, or 0 with --chimera-zb-costs)",
    "distributed_backend": "nccl or gloo (default: nccl on CUDA, gloo on CPU)",
    "distributed_timeout_minutes": "timeout of collective operations",
    # training
    "micro_batch_size": "samples per micro-batch",
    "global_batch_size": "samples per iteration (default micro batch x data-parallel size)",
    "rampup_batch_size": "START INCREMENT SAMPLES: the global batch grows from START by "
                         "INCREMENT over the first SAMPLES samples to --global-batch-size "
                         "(needs --train-samples; one schedule per number of micro-batches, "
                         "built once; no --profile-iterations)",
    "train_iters": "iterations to train",
    "train_samples": "samples to train (instead of --train-iters)",
    "exit_interval": "save and exit after this many iterations",
    "exit_duration_in_mins": "save and exit (status 0) at the first iteration boundary after "
                             "the job has run this many minutes (wall clock from the earliest "
                             "rank's start, agreed across ranks)",
    "exit_signal_handler": "on SIGTERM to any rank (scancel, preemption, torchrun): save at the "
                           "next iteration boundary (the ranks agree) and exit 0",
    "eval_interval": "validate every this many iterations",
    "eval_iters": "iterations per validation / test evaluation",
    "seed": "random seed (weights, dropout, data order)",
    "check_for_nan_in_loss_and_grad": "stop with the iteration and rank when a loss or gradient "
                                      "is NaN/Inf (default on; --no-... turns it off)",
    "max_consecutive_skipped_iterations": "stop when the optimizer skips this many iterations "
                                          "in a row (fp16 overflow at every loss scale); 0: no "
                                          "bound",
    "optimizer": "adam (AdamW semantics, as Megatron) or sgd",
    "lr": "peak learning rate",
    "min_lr": "learning rate floor of the decay",
    "lr_decay_style": "constant, linear or cosine",
    "lr_decay_iters": "decay period in iterations (default --train-iters)",
    "lr_decay_samples": "decay period in samples (default --train-samples)",
    "lr_warmup_iters": "linear warmup in iterations",
    "lr_warmup_samples": "linear warmup in samples",
    "lr_warmup_fraction": "linear warmup as a fraction of the decay period",
    "weight_decay": "decoupled weight decay (not on biases and layer norms)",
    "adam_beta1": "Adam beta1",
    "adam_beta2": "Adam beta2",
    "adam_eps": "Adam epsilon",
    "sgd_momentum": "SGD momentum",
    "clip_grad": "clip the global gradient norm to this (0: off)",
    "fp16": "fp16 model with fp32 main parameters and loss scaling",
    "bf16": "bf16 model with fp32 main parameters",
    "loss_scale": "constant fp16 loss scale (default dynamic)",
    "initial_loss_scale": "initial dynamic loss scale",
    "min_loss_scale": "floor of the dynamic loss scale",
    "loss_scale_window": "iterations without overflow before the scale doubles",
    "hysteresis": "overflows tolerated before the scale halves",
    # data
    "data_path": "dataset prefix, or weight prefix pairs to blend",
    "split": "train, valid, test proportions of --data-path, e.g. 969,30,1 (the default)",
    "train_data_path": "training data: every document of a prefix, or weight prefix pairs to "
                       "blend (instead of --data-path / --split)",
    "valid_data_path": "validation data: a prefix or weight prefix pairs (instead of "
                       "--data-path / --split)",
    "test_data_path": "test data: a prefix or weight prefix pairs (instead of --data-path / "
                      "--split)",
    "mock_data": "deterministic synthetic samples instead of --data-path",
    "data_impl": "indexed dataset implementation: mmap (Megatron's MMIDIDX, the only one)",
    "tokenizer_type": "Megatron tokenizer name",
    "tokenizer_model": "SentencePiece model file, or HuggingFaceTokenizer's local directory "
                       "(tokenizer.json, tokenizer_config.json; nothing is downloaded)",
    "vocab_file": "GPT-2 vocab.json or WordPiece vocab.txt",
    "merge_file": "GPT-2 merges.txt",
    "vocab_size": "vocabulary of the NullTokenizer / bare --mock-data",
    "num_workers": "DataLoader worker processes",
    "data_cache_path": "directory of the cached sample indices (default next to the data)",
    "mask_prob": "BERT: fraction of tokens to predict",
    "short_seq_prob": "BERT: probability of a shorter target length",
    "whole_word_masking": "BERT: mask tokens one by one instead of whole words (WordPiece ## "
                          "continuations, SentencePiece word starts)",
    "masking_max_ngram": "BERT: longest n-gram of words masked together (Megatron: 3; 1 "
                         "masks single words)",
    "reset_position_ids": "GPT: position ids restart after every end-of-document token",
    "reset_attention_mask": "GPT: tokens attend only within their own document of a packed "
                            "sample",
    "eod_mask_loss": "GPT: no loss at positions whose input is the end-of-document token",
    # checkpointing
    "save": "checkpoint directory to write",
    "load": "checkpoint directory to resume from",
    "save_interval": "save every this many iterations",
    "no_save_optim": "do not save the optimizer state",
    "no_load_optim": "do not load the optimizer state",
    "no_load_rng": "do not restore the random-number generator states",
    "finetune": "load weights only and start at iteration 0",
    "use_checkpoint_args": "take the model flags (shape, model settings, --seq-length, "
                           "--tokenizer-type, --vocab-size) from --load's checkpoint; flags "
                           "given on the command line win (the parallel layout is never taken: "
                           "any layout loads)",
    "exit_on_missing_checkpoint": "a --load directory without a checkpoint is an error (exit "
                                  "code 2, before any process group) instead of training from "
                                  "scratch",
    "ckpt_format": "torch_dist: every rank saves and loads only its own shards through "
                   "torch.distributed.checkpoint (any layout loads); torch: one file per stage "
                   "with full tensors. Loading reads either",
    "async_save": "torch_dist: stage each checkpoint in host memory and write it in the "
                  "background while training goes on (the next save and the exit wait for it)",
    # logging
    "log_interval": "print the log line every this many iterations",
    "tensorboard_dir": "write TensorBoard scalars here",
    "tensorboard_log_interval": "write TensorBoard scalars every this many iterations",
    "log_throughput": "TFLOP/s per GPU in the log line and TensorBoard (throughput)",
    "log_timers_to_tensorboard": "timers in TensorBoard under Megatron's names "
                                 "(forward-backward-time, optimizer-time, ...)",
    "log_memory_to_tensorboard": "allocated / reserved CUDA memory (CPU: resident set size) of "
                                 "every rank in TensorBoard",
    "log_validation_ppl_to_tensorboard": "validation perplexity in TensorBoard (always written)",
    "log_batch_size_to_tensorboard": "global batch size in TensorBoard (always written)",
    "pipeline_trace": "write the measured per-rank timeline of two iterations (after a warm-up "
                      "one) to FILE as a Chrome / Perfetto trace: compute actions, sends, "
                      "waits for messages, gradient reductions, optimizer step "
                      "(tools/plot_schedule.py --measured FILE draws it)",
    "wandb_project": "Weights & Biases project: the logging rank writes the TensorBoard "
                     "scalars there too (needs --wandb-exp-name and the wandb package; "
                     "WANDB_MODE=offline works without a network)",
    "wandb_exp_name": "Weights & Biases run name (with --wandb-project)",
    "wandb_save_dir": "directory of the W&B files (default <--save>/wandb)",
    "debug_tracebacks": "print the traceback of every error (also: MEGATRON_CHIMERA_TRACEBACKS=1)",
}

# Flags one model family reads: the other entry script rejects them rather than ignore them.
FAMILY: dict[str, str] = {
    "reset_position_ids": "gpt2", "reset_attention_mask": "gpt2", "eod_mask_loss": "gpt2",
    "document_attention": "gpt2", "untie_embeddings_and_output_weights": "gpt2",
    "swiglu": "gpt2", "num_query_groups": "gpt2", "add_bias_linear": "gpt2",
    "add_qkv_bias": "gpt2", "position_embedding_type": "gpt2", "rotary_base": "gpt2",
    "rotary_percent": "gpt2", "use_rope_scaling": "gpt2", "rope_scaling_factor": "gpt2",
    "normalization": "gpt2", "kv_channels": "gpt2",
    "mask_prob": "bert", "short_seq_prob": "bert", "whole_word_masking": "bert",
    "masking_max_ngram": "bert", "bert_binary_head": "bert",
}

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
    **{name: f"`training.layer_split.{name}`" for name in (
        "pipeline_model_parallel_layout", "decoder_first_pipeline_num_layers",
        "decoder_last_pipeline_num_layers", "account_for_embedding_in_pipeline_split",
        "account_for_loss_in_pipeline_split")},
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
    "--num-experts": "mixture of experts is not implemented",
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
    "--context-parallel-size": "context parallelism is not implemented",
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
    "--fp8-format": _TE, "--transformer-impl": _TE, "--attention-backend": _TE,
    "--use-mcore-models": "one model implementation (Megatron's legacy module names)",
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
    "--onnx-safe", "--bert-no-binary-head", "--num-experts",
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
    "--context-parallel-size",
    # validation
    "--eval-iters", "--eval-interval", "--skip-train",
    # data and tokenizer
    "--data-path", "--split", "--train-data-path", "--valid-data-path", "--test-data-path",
    "--data-cache-path", "--mock-data", "--vocab-size", "--vocab-file", "--merge-file",
    "--vocab-extra-ids", "--seq-length", "--encoder-seq-length", "--decoder-seq-length",
    "--retriever-seq-length", "--sample-rate", "--mask-prob", "--short-seq-prob", "--mmap-warmup",
    "--num-workers", "--tokenizer-type", "--tokenizer-model", "--data-impl",
    "--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss",
    # transformer engine
    "--fp8-e4m3", "--fp8-hybrid", "--no-fp8-wgrad", "--fp8-margin", "--fp8-interval",
    "--fp8-amax-history-len", "--fp8-amax-compute-algo", "--fp8-format", "--transformer-impl",
    "--attention-backend", "--use-mcore-models", "--use-legacy-models",
)


def apply_help(parser: argparse.ArgumentParser) -> None:
    """Give every flag without a help string its description from :data:`HELP`."""
    for action in parser._actions:  # noqa: SLF001 (argparse has no public API for this)
        if action.help is None and action.dest in HELP:
            action.help = HELP[action.dest]


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
    for section in dataclasses.fields(config):
        part = getattr(config, section.name)
        if not dataclasses.is_dataclass(part):
            continue
        for field in dataclasses.fields(part):
            owner = FAMILY.get(field.name)
            if owner is None or owner == family.name:
                continue
            if getattr(part, field.name) != field.default:
                other = FAMILIES[owner]
                errors.append(f"{_flag_name(field.name)} applies to {other.title} "
                              f"({other.entry_point}) only")
    return errors


_NEGATED = {"bert_binary_head": "--bert-no-binary-head",
            "whole_word_masking": "--no-whole-word-masking"}


def _flag_name(dest: str) -> str:
    return _NEGATED.get(dest, "--" + dest.replace("_", "-"))
