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
NORMALIZATIONS = ("LayerNorm", "RMSNorm")  # --normalization (Megatron's spelling)
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")  # --position-embedding-type


MOE_ROUTER_SCORE_FUNCTIONS = ("softmax", "sigmoid")  # --moe-router-score-function
MOE_LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")  # --moe-router-load-balancing-type
MOE_TOKEN_DISPATCHERS = ("alltoall", "allgather")  # --moe-token-dispatcher-type


@dataclass(frozen=True)
class MoEConfig:
    """Mixture of experts (Megatron-core's flags); ``num_experts`` None: every MLP is dense.

    ``moe_layer_freq`` is an int k (layers 0, k, 2k, ... are MoE) or Megatron's list string, e.g.
    ``"[1,0,1,0]"`` or ``"([1]*3+[0])*2"`` (one 0/1 per layer; see :meth:`moe_layers`)."""

    num_experts: int | None = None
    moe_ffn_hidden_size: int | None = None  # default: the dense --ffn-hidden-size
    moe_router_topk: int = 2
    moe_router_score_function: str = "softmax"  # one of MOE_ROUTER_SCORE_FUNCTIONS
    moe_router_pre_softmax: bool = False  # softmax over all experts before the top-k
    moe_router_load_balancing_type: str = "aux_loss"  # one of MOE_LOAD_BALANCING_TYPES
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float | None = None
    moe_expert_capacity_factor: float | None = None  # None: dropless
    moe_shared_expert_intermediate_size: int | None = None
    moe_layer_freq: int | str = 1
    moe_token_dispatcher_type: str = "alltoall"  # one of MOE_TOKEN_DISPATCHERS
    moe_grouped_gemm: bool = False
    moe_per_layer_logging: bool = False  # log each MoE layer's auxiliary losses too

    @property
    def enabled(self) -> bool:
        """Whether the model has MoE layers."""
        return self.num_experts is not None

    def moe_layers(self, num_layers: int) -> tuple[bool, ...]:
        """Which of the ``num_layers`` layers (0-based) are MoE layers (Megatron's
        ``--moe-layer-freq``: int k -> every k-th layer from layer 0; a list -> its 0/1 pattern,
        one entry per layer)."""
        if not self.enabled:
            return (False,) * num_layers
        return parse_moe_layer_freq(self.moe_layer_freq, num_layers)


def parse_moe_layer_freq(freq: int | str, num_layers: int) -> tuple[bool, ...]:
    """``--moe-layer-freq`` as one flag per layer; ConfigError naming the flag when malformed.
    A string is an int or a Python list expression of 0/1 built from list literals, ``+`` and
    ``*`` (evaluated on its syntax tree, never by ``eval``)."""
    if isinstance(freq, str):
        freq = _layer_freq_value(freq)
    if isinstance(freq, int) and not isinstance(freq, bool):
        if freq < 1:
            raise ConfigError(f"--moe-layer-freq {freq} must be >= 1")
        return tuple(i % freq == 0 for i in range(num_layers))
    pattern = list(freq)
    if len(pattern) != num_layers or any(v not in (0, 1) for v in pattern):
        raise ConfigError(f"--moe-layer-freq {pattern} must hold one 0 or 1 per layer "
                          f"(--num-layers {num_layers})")
    return tuple(bool(v) for v in pattern)


def _layer_freq_value(text: str) -> int | list[int]:
    """The int or list a ``--moe-layer-freq`` string denotes (list literals, ``+``, ``*``)."""
    import ast

    def value(node: ast.AST):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, (ast.List, ast.Tuple)):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ConfigError(f"--moe-layer-freq {text!r}: only ints, lists, + and * are allowed")

    try:
        result = value(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, TypeError) as error:
        raise ConfigError(f"--moe-layer-freq {text!r} is not an int or a list expression "
                          f"({error})") from None
    if isinstance(result, list) and any(isinstance(v, list) for v in result):
        raise ConfigError(f"--moe-layer-freq {text!r} must be a flat list of 0/1")
    return result


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
    # the input-gradient all-reduce of column-parallel layers overlapped with their weight
    # gradient (--no-async-tensor-model-parallel-allreduce turns it off)
    async_tensor_model_parallel_allreduce: bool = True
    # today's decoders (Megatron's flags): normalisation, gated MLP, attention and positions
    normalization: str = "LayerNorm"  # one of NORMALIZATIONS
    swiglu: bool = False  # MLP: silu(x W_gate) * (x W_up) from one fused [gate; up] projection
    kv_channels: int | None = None  # head dimension (default hidden / heads)
    num_query_groups: int | None = None  # grouped-query attention's K/V heads (None: one per head)
    add_bias_linear: bool = True  # --disable-bias-linear turns every transformer bias off
    add_qkv_bias: bool = False  # the QKV bias even with --disable-bias-linear (Qwen2)
    position_embedding_type: str = "learned_absolute"  # one of POSITION_EMBEDDING_TYPES
    rotary_base: int = 10000
    rotary_percent: float = 1.0  # fraction of the head dimension RoPE rotates
    use_rope_scaling: bool = False  # Llama-3's frequency scaling (--rope-scaling-factor)
    rope_scaling_factor: float = 8.0
    moe: MoEConfig = MoEConfig()  # mixture of experts (default: dense MLPs)

    @property
    def ffn_size(self) -> int:
        """Hidden size of the MLP (``--ffn-hidden-size``; default 4h, or with ``--swiglu``
        Megatron's 2/3 of it rounded down to a multiple of 64)."""
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        if self.swiglu:
            return int(4 * self.hidden_size * 2 / 3 / 64) * 64
        return 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        """Channels per attention head (``--kv-channels``, default hidden / heads)."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        """Key/value heads: ``--num-query-groups`` with grouped-query attention, else one per
        attention head."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def qkv_size(self) -> int:
        """Output features of the fused QKV projection: the query heads plus a key and a value
        head per query group."""
        return (self.num_attention_heads + 2 * self.query_groups) * self.head_dim

    @property
    def has_qkv_bias(self) -> bool:
        """Whether the QKV projection has a bias (``add_bias_linear`` or ``--add-qkv-bias``)."""
        return self.add_bias_linear or self.add_qkv_bias

    @property
    def learned_positions(self) -> bool:
        """Whether the model holds learned absolute position embeddings."""
        return self.position_embedding_type == "learned_absolute"

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
    # expert parallelism (MoE): EP ranks folded out of each pipeline rank's T x W ranks
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None  # None: 1 (experts are not tensor-split)

    @property
    def layout(self) -> ParallelLayout:
        """The T x W x D layout with EP folded in (the one owner of every size rule and of the
        rank order)."""
        return ParallelLayout(self.tensor_model_parallel_size, self.data_parallel_size,
                              self.pipeline_model_parallel_size, self.expert_model_parallel_size)

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
    ``gradient_accumulation_fusion``: weight gradients computed straight into ``main_grad``
    (``--no-gradient-accumulation-fusion`` turns it off; see ``tensor_parallel.weight_grad``).
    """

    grad_reduce_in_fp32: bool = False
    overlap_grad_reduce: bool = False
    bucket_size: int | None = None
    use_distributed_optimizer: bool = False
    overlap_param_gather: bool = False
    gradient_accumulation_fusion: bool = True

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
    # per-split files (--train-data-path ...; each a [weight] prefix list), instead of data_path
    train_data_path: tuple[str, ...] | None = None
    valid_data_path: tuple[str, ...] | None = None
    test_data_path: tuple[str, ...] | None = None
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

    @property
    def split_data_paths(self) -> tuple[tuple[str, ...] | None, ...] | None:
        """(train, valid, test) per-split paths, or None when the run uses ``data_path``."""
        paths = (self.train_data_path, self.valid_data_path, self.test_data_path)
        return paths if any(p is not None for p in paths) else None


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
    # save and exit once the job's wall clock passes this many minutes (agreed across ranks)
    exit_duration_in_mins: float | None = None
    # SIGTERM to any rank: save at the next iteration boundary and exit 0
    exit_signal_handler: bool = False
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

    # --rampup-batch-size START INCREMENT SAMPLES: the global batch grows from START by
    # INCREMENT over the first SAMPLES samples (Megatron's ramp; needs --train-samples)
    rampup_batch_size: tuple[int, int, int] | None = None

    @property
    def total_train_iters(self) -> int:
        """Iterations to run: ``--train-iters``, or ``--train-samples`` / global batch (the
        ramp-up's iterations counted as Megatron does: the ramp, then the constant batch)."""
        if self.train_iters is not None:
            return self.train_iters
        if self.rampup_batch_size is None:
            return (self.train_samples or 0) // self.global_batch_size
        iterations, consumed = self._rampup_phase()
        return iterations + ((self.train_samples or 0) - consumed) // self.global_batch_size

    @property
    def total_train_samples(self) -> int:
        """The samples all iterations consume (datasets and the LR schedule are sized by it)."""
        if self.rampup_batch_size is None:
            return self.total_train_iters * self.global_batch_size
        iterations, consumed = self._rampup_phase()
        return consumed + (self.total_train_iters - iterations) * self.global_batch_size

    def _rampup_phase(self) -> tuple[int, int]:
        """(iterations, samples) of the ramp: Megatron counts every iteration that starts at
        or before SAMPLES consumed samples."""
        assert self.rampup_batch_size is not None
        iterations = consumed = 0
        while consumed <= self.rampup_batch_size[2]:
            consumed += self.global_batch_at(consumed)
            iterations += 1
        return iterations, consumed

    def global_batch_at(self, consumed_samples: int) -> int:
        """The global batch of the iteration that starts after ``consumed_samples`` samples:
        START + INCREMENT x (consumed / (SAMPLES / increments)) during the ramp (Megatron's
        rule), the full ``global_batch_size`` after it."""
        if self.rampup_batch_size is None:
            return self.global_batch_size
        start, increment, samples = self.rampup_batch_size
        increments = (self.global_batch_size - start) // increment
        if consumed_samples > samples or increments == 0:
            return self.global_batch_size
        steps = int(consumed_samples / (samples / increments))
        return min(start + steps * increment, self.global_batch_size)

    def num_microbatches_at(self, consumed_samples: int) -> int:
        """N of the iteration that starts after ``consumed_samples`` samples."""
        per_microbatch = self.global_batch_size // self.num_microbatches  # micro batch x W
        return self.global_batch_at(consumed_samples) // per_microbatch

    def microbatch_counts(self) -> list[int]:
        """Every N the run uses, the final one last (one schedule each)."""
        if self.rampup_batch_size is None:
            return [self.num_microbatches]
        start, increment, _ = self.rampup_batch_size
        per_microbatch = self.global_batch_size // self.num_microbatches
        return [batch // per_microbatch
                for batch in range(start, self.global_batch_size + 1, increment)]


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
    # a --load without a checkpoint is an error instead of training from scratch
    exit_on_missing_checkpoint: bool = False
    # torch_dist: every rank writes its own pieces (DCP); torch: one file per stage
    ckpt_format: str = "torch_dist"
    # --async-save: torch_dist checkpoints written in the background (checkpoint/async_save.py)
    async_save: bool = False


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
    # Weights & Biases (training/scalar_writers.py): the same scalars as TensorBoard
    wandb_project: str | None = None
    wandb_exp_name: str | None = None
    wandb_save_dir: str | None = None  # default <save>/wandb
    # --timing-log-level: >= 1 synchronises the device in every timer (training/monitor.py)
    timing_log_level: int = 0


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
