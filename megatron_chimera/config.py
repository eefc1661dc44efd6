"""Frozen configuration dataclasses passed explicitly to library code.

``arguments.py`` builds these from Megatron-style command-line flags; library modules receive
them as arguments and never read a global args object. Field names follow Megatron's flags
(``--hidden-size`` -> ``hidden_size``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_chimera.errors import ConfigError  # noqa: F401 - re-exported: the flags' error
from megatron_chimera.layout import ParallelLayout, pad_vocab_size

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}  # bytes per element of each --params-dtype

# GeLU forms: "megatron" = tanh approximation in the MLP (Megatron's fused bias-GeLU) and exact erf
# GeLU in BERT's LM head (Megatron-LM's default); "tanh" = tanh approximation everywhere (Megatron's
# --openai-gelu, Hugging Face's gelu_new); "erf" = exact erf GeLU everywhere (Hugging Face's gelu).
GELU_VARIANTS = ("megatron", "tanh", "erf")




@dataclass(frozen=True)
class ModelConfig:
    """Transformer shape, regularisation, initialisation, precision and recomputation settings."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None  # default 4 * hidden_size
    seq_length: int = 32
    max_position_embeddings: int | None = None  # default seq_length
    vocab_size: int = 128  # tokenizer vocabulary (unpadded)
    make_vocab_size_divisible_by: int = 128
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    layernorm_epsilon: float = 1e-5
    untie_embeddings_and_output_weights: bool = False
    attention_softmax_in_fp32: bool = False
    apply_query_key_layer_scaling: bool = False
    # precision of the model parameters and activations: "fp32", "fp16" or "bf16"
    params_dtype: str = "fp32"
    # recomputation (Megatron flags): granularity None|"selective"|"full", method "uniform"|"block"
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    # BERT-only
    num_tokentypes: int = 0
    bert_binary_head: bool = True
    # None: use NVIDIA Apex kernels when importable; False: force torch-native kernels
    use_apex: bool | None = None
    # fused attention (scaled_dot_product_attention) and GeLU kernels; False: unfused reference ops
    # (Megatron's --no-masked-softmax-fusion / --no-bias-gelu-fusion)
    masked_softmax_fusion: bool = True
    bias_gelu_fusion: bool = True
    # --no-bias-dropout-fusion: bias-dropout-add is always the unfused torch composition here
    bias_dropout_fusion: bool = True
    # --use-flash-attn: on CUDA, SDPA restricted to its flash / memory-efficient kernels
    use_flash_attn: bool = False
    # per-document attention kernel with --reset-attention-mask (model/document_attention.py)
    document_attention: str = "auto"
    gelu: str = "megatron"  # one of GELU_VARIANTS (--gelu)
    # --sequence-parallel: LayerNorm / dropout regions split along the sequence over the
    # tensor-parallel ranks (a no-op with --tensor-model-parallel-size 1)
    sequence_parallel: bool = False

    @property
    def ffn_size(self) -> int:
        """Hidden size of the MLP (``--ffn-hidden-size``, default 4h)."""
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def max_positions(self) -> int:
        """Number of learned position embeddings."""
        return self.max_position_embeddings or self.seq_length

    @property
    def padded_vocab_size(self) -> int:
        """Vocabulary rounded up to ``make_vocab_size_divisible_by``: the layout-independent
        padding checkpoints store (a tensor-parallel run pads further, see
        :meth:`tensor_parallel_vocab_size`)."""
        return pad_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by)

    def tensor_parallel_vocab_size(self, tensor_parallel: int) -> int:
        """Megatron's padded vocabulary with ``tensor_parallel`` ranks: a multiple of
        ``make_vocab_size_divisible_by x T`` (the rows beyond :attr:`padded_vocab_size` are zero
        and never used)."""
        return ParallelLayout(tensor=tensor_parallel).padded_vocab_size(
            self.vocab_size, self.make_vocab_size_divisible_by)

    @property
    def dtype_bytes(self) -> int:
        """Bytes of one parameter / activation element in the model's precision."""
        return DTYPE_BYTES[self.params_dtype]

    @property
    def torch_dtype(self) -> torch.dtype:
        """torch dtype of ``params_dtype``."""
        return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[
            self.params_dtype
        ]


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel layout and schedule: world = tensor x data-parallel x pipeline size.

    ``schedule_options`` is the typed options dataclass of ``pipeline_schedule`` from the
    schedule registry (``megatron_chimera.schedules.registry``), built from the flags.
    """

    pipeline_model_parallel_size: int = 1
    data_parallel_size: int = 1
    tensor_model_parallel_size: int = 1
    pipeline_schedule: str = "1f1b"  # a name of the schedule registry
    schedule_options: Any = None  # None: the schedule's defaults
    distributed_backend: str | None = None  # None: nccl on CUDA, gloo on CPU
    distributed_timeout_minutes: float = 10.0
    allow_cpu_training: bool = False  # gloo on a machine with CUDA devices is deliberate

    @property
    def layout(self) -> ParallelLayout:
        """The T x W x D layout (the one owner of every size rule and of the rank order)."""
        return ParallelLayout(self.tensor_model_parallel_size, self.data_parallel_size,
                              self.pipeline_model_parallel_size)

    @property
    def world_size(self) -> int:
        """Total ranks: T x W x D."""
        return self.layout.world_size


@dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer, learning-rate schedule, clipping and mixed-precision loss scaling."""

    optimizer: str = "adam"  # adam (AdamW semantics, as Megatron) | sgd
    lr: float = 1e-4
    min_lr: float = 0.0
    lr_decay_style: str = "linear"  # constant | linear | cosine
    lr_decay_samples: int | None = None
    lr_warmup_samples: int = 0
    lr_warmup_fraction: float | None = None  # of the decay samples; overrides lr_warmup_samples
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0
    fp16: bool = False
    bf16: bool = False
    loss_scale: float | None = None  # constant scale when set, dynamic otherwise (fp16)
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    use_apex: bool | None = None


@dataclass(frozen=True)
class DDPConfig:
    """Gradient buffers and data-parallel reduction (Megatron's ``DistributedDataParallelConfig``).

    ``grad_reduce_in_fp32``: accumulate and reduce gradients in fp32 buffers
    (``--accumulate-allreduce-grads-in-fp32``; always on with ``--bf16``, as in Megatron).
    ``overlap_grad_reduce``: reduce each bucket as soon as its gradients are final, during the
    stage's last backward; otherwise each stage is reduced whole once its last backward is done.
    ``bucket_size``: elements per bucket (None: Megatron's ``max(40M, 1M x group size)`` with
    overlap, one bucket per stage without). ``use_distributed_optimizer``: shard the fp32 main
    parameters and optimizer state over each stage-replica group (ZeRO-1).
    ``overlap_param_gather``: all-gather the updated parameters in the background, waiting for
    a stage's parameters before its first forward of the next iteration.
    """

    grad_reduce_in_fp32: bool = False
    overlap_grad_reduce: bool = False
    bucket_size: int | None = None
    use_distributed_optimizer: bool = False
    overlap_param_gather: bool = False

    def bucket_elements(self, group_size: int) -> int | None:
        """Elements per bucket for a reducing group of ``group_size`` ranks (None: whole)."""
        if self.bucket_size is not None:
            return self.bucket_size
        if self.overlap_grad_reduce:
            return max(40_000_000, 1_000_000 * group_size)
        return None


@dataclass(frozen=True)
class DataConfig:
    """Datasets and tokenizer (``--data-path``, ``--split``, ``--tokenizer-type``, ...)."""

    data_path: tuple[str, ...] | None = None  # Megatron's [weight] prefix list, as given
    split: str = "969, 30, 1"
    tokenizer_type: str | None = None
    tokenizer_model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    vocab_size: int | None = None  # NullTokenizer / --mock-data vocabulary
    mock_data: bool = False
    num_workers: int = 2
    data_cache_path: str | None = None
    # BERT masking (Megatron's defaults): whole words (WordPiece / SentencePiece), n-grams <= 3
    mask_prob: float = 0.15
    short_seq_prob: float = 0.1
    whole_word_masking: bool = True
    masking_max_ngram: int = 3
    # GPT samples packed from several documents (Megatron's flags; computed in the data workers)
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False


@dataclass(frozen=True)
class LayerSplit:
    """Megatron's uneven-stage flags (resolved by :mod:`megatron_chimera.model.stage_layout`):
    a layout string, the first / last stage's layers, or the embedding / loss counted as layers.
    All unset: ``--partition-method`` splits."""

    pipeline_model_parallel_layout: str | None = None
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False

    @property
    def given(self) -> bool:
        """Whether any of the flags is set."""
        return self != LayerSplit()


@dataclass(frozen=True)
class TrainingConfig:
    """Batch sizes, iteration counts, evaluation cadence, seed; ``num_microbatches`` derived."""

    micro_batch_size: int = 1
    global_batch_size: int = 1
    num_microbatches: int = 1  # N = global batch / (micro batch x data-parallel size)
    train_iters: int | None = None
    train_samples: int | None = None
    eval_interval: int = 1000
    eval_iters: int = 100
    exit_interval: int | None = None
    seed: int = 1234
    partition_method: str = "uniform"  # uniform | parameters | time (measured, per rank)
    layer_split: LayerSplit = LayerSplit()  # uneven stages by Megatron's flags (else the method)
    # split-backward schedules: time F/B/W during the first K iterations, then rebuild the
    # order for the measured costs (0: never; resolved from --profile-iterations)
    profile_iterations: int = 0
    # stop on a NaN/Inf loss or gradient (Megatron's --check-for-nan-in-loss-and-grad)
    check_for_nan_in_loss_and_grad: bool = True
    # stop after this many skipped iterations in a row (0: no bound)
    max_consecutive_skipped_iterations: int = 100

    @property
    def total_train_iters(self) -> int:
        """Iterations to run: ``--train-iters`` or ``--train-samples`` / global batch."""
        if self.train_iters is not None:
            return self.train_iters
        return (self.train_samples or 0) // self.global_batch_size


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoint directories and what to save / load."""

    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    no_save_optim: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False


@dataclass(frozen=True)
class LoggingConfig:
    """stdout and TensorBoard logging cadence and content."""

    log_interval: int = 100
    tensorboard_dir: str | None = None
    log_throughput: bool = False
    log_timers_to_tensorboard: bool = False
    log_memory_to_tensorboard: bool = False
    tensorboard_log_interval: int = 1
    log_bubble_ratio: bool = True
    pipeline_trace: str | None = None  # write the measured timeline (Chrome / Perfetto JSON)


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs, built by ``arguments.parse_args`` and validated."""

    model: ModelConfig
    parallel: ParallelConfig
    optimizer: OptimizerConfig
    data: DataConfig
    training: TrainingConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    ddp: DDPConfig = DDPConfig()
    extra: tuple[tuple[str, object], ...] = ()  # flags added by an extra_args_provider

    def extra_arg(self, name: str, default: object = None) -> object:
        """Value of a flag registered by the entry script's ``extra_args_provider``."""
        return dict(self.extra).get(name, default)
