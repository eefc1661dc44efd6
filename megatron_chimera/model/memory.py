"""Per-stage memory estimates: weights, gradients, optimizer state, activations per micro-batch.

What a rank holds under a schedule (several stages, in-flight micro-batches) is added by
:mod:`megatron_chimera.tuning.rank_memory`, the one per-rank model.

Bytes per parameter (Megatron's mixed precision, as :mod:`megatron_chimera.optimizer` does it):

=========  ======  ==========  ============================  ==================================
precision  params  grads       optimizer state               transient in ``step()``
=========  ======  ==========  ============================  ==================================
fp32       4       4           Adam m, v: 8 (SGD momentum 4)  -
bf16       2       4 (fp32)    fp32 main params 4 + Adam 8   -
fp16       2       2 (or 4)    fp32 main params 4 + Adam 8   fp32 main grads 4 with 2-byte grads
=========  ======  ==========  ============================  ==================================

Gradients accumulate in contiguous buffers (:mod:`megatron_chimera.distributed.grad_buffer`):
fp32 with ``--accumulate-allreduce-grads-in-fp32`` (always with ``--bf16``), where they serve as
the fp32 main gradients directly; otherwise in the parameter dtype, copied to fp32 in the step.
With the distributed optimizer the optimizer state of a stage is divided among the ranks of its
stage-replica group (:mod:`megatron_chimera.tuning.rank_memory` applies that per rank).

Activations saved for backward per transformer layer and micro-batch follow Korthikanti et al.
("Reducing Activation Recomputation in Large Transformer Models", 2022): ``s*b*h*(34 + 5*a*s/h)``
bytes for 16-bit with dropout, generalised here to ``B`` bytes per element and 1-byte dropout
masks: ``sbh*(16*B + 2) + a*s*s*b*(2*B + 1)`` (fp32: ``sbh*(66 + 9*a*s/h)``). Without attention
dropout the ``a*s*s*b`` term is ``B`` (the softmax output only); without hidden dropout the two
``sbh`` masks vanish. With fused attention (``scaled_dot_product_attention``: flash or
memory-efficient kernels) no ``s x s`` tensor is stored; the kernel keeps its output
(``sbh*B``) and an fp32 log-sum-exp (``4*a*s*b``). Selective recomputation drops the attention
core's own tensors (``34*s*b*h`` for 16-bit, as the paper). Full recomputation stores only each
checkpointed chunk's input (``s*b*h*B``, i.e. ``2*s*b*h`` for 16-bit) and rebuilds one chunk's
activations at a time during backward (``recompute_working_bytes``, once per rank).
The first stage adds the embedding dropout mask and token/position indices; the last stage the
final layer norm, the head's saved inputs and the fp32 log-probabilities of the loss (``4*s*b*V``).

Tensor parallelism (T ranks; Korthikanti et al.'s ``sbh(10 + 24/T)``): the ``12*sbh*B`` bytes inside
the tensor-parallel regions (QKV, attention, MLP inner activations; in general
:func:`tensor_parallel_elements`: SwiGLU keeps gate and up, ``--kv-channels`` changes the attention
width) and the attention core are divided by T; the two LayerNorm inputs and dropout masks
(``2*sbh*B + masks``) and the inputs of the two column-parallel linears (``2*sbh*B``) are whole on
every rank. Sequence parallelism divides the LayerNorm inputs and masks by T too, and the
column-parallel linears' inputs: each keeps its ``[s/T, b, h]`` chunk and all-gathers it again for
the (deferrable) weight gradient, as Megatron (Korthikanti et al.'s ``sbh(34 + 5as/h)/T``).
Weights, gradients and optimizer state are the per-rank parameter counts of
:mod:`~megatron_chimera.model.partition`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_chimera.config import DTYPE_BYTES, ConfigError, ModelConfig
from megatron_chimera.model.family import ModelFamily
from megatron_chimera.model.partition import (
    embedding_parameters,
    expert_parameters,
    head_parameters,
    layers_parameters,
)


def mask_bytes(params_dtype: str, device_type: str = "cuda") -> int:
    """Bytes per dropout-mask element: 1 on CUDA (bool mask), the activation dtype's width on
    the CPU (torch's CPU dropout saves a mask in the input dtype)."""
    return 1 if device_type == "cuda" else DTYPE_BYTES[params_dtype]


def grads_in_fp32(params_dtype: str, grad_reduce_in_fp32: bool | None = None) -> bool:
    """Whether gradients accumulate in fp32: fp32 models, bf16 (always, as Megatron), fp16 with
    ``--accumulate-allreduce-grads-in-fp32`` (None: the flag's default, off)."""
    return params_dtype in ("fp32", "bf16") or bool(grad_reduce_in_fp32)


def bytes_per_parameter(params_dtype: str, optimizer: str = "adam",
                        sgd_momentum: float = 0.9,
                        grad_reduce_in_fp32: bool | None = None) -> dict[str, int]:
    """Bytes per parameter: ``param``, ``grad`` (the gradient buffer), ``optimizer`` (main copy +
    moments) and ``main_grad`` (a separate fp32 main gradient during ``step()``: 16-bit
    gradients only)."""
    if params_dtype not in DTYPE_BYTES:
        raise ConfigError(f"params dtype must be one of {tuple(DTYPE_BYTES)}, got {params_dtype!r}")
    if optimizer not in ("adam", "sgd"):
        raise ConfigError(f"--optimizer must be 'adam' or 'sgd', got {optimizer!r}")
    width = DTYPE_BYTES[params_dtype]
    moments = 8 if optimizer == "adam" else (4 if sgd_momentum else 0)
    half = width == 2
    grad = 4 if grads_in_fp32(params_dtype, grad_reduce_in_fp32) else width
    return {"param": width, "grad": grad, "optimizer": moments + (4 if half else 0),
            "main_grad": 4 if grad == 2 else 0}


def tied_embedding_parameters(config: ModelConfig, family: ModelFamily,
                              tensor_parallel: int = 1) -> int:
    """Elements of the word embedding tied to the output layer on one of ``tensor_parallel``
    ranks (its vocabulary rows; 0 when untied)."""
    tied = family.always_tied or not config.untie_embeddings_and_output_weights
    rows = config.tensor_parallel_vocab_size(tensor_parallel) // tensor_parallel
    return rows * config.hidden_size if tied else 0


def _sequence_chunks(tensor_parallel: int, sequence_parallel: bool) -> int:
    """By how much the residual stream's tensors are divided: T under sequence parallelism."""
    return tensor_parallel if sequence_parallel else 1


def layer_activation_bytes(config: ModelConfig, micro_batch_size: int,
                           recompute: str | None = None, device_type: str = "cuda",
                           tensor_parallel: int = 1, sequence_parallel: bool = False) -> int:
    """Bytes one transformer layer saves for backward for one micro-batch on one of
    ``tensor_parallel`` ranks (see module doc).

    ``recompute``: None, ``"selective"`` or ``"full"`` (then: the layer's input only).
    """
    s, b, h, a = config.seq_length, micro_batch_size, config.hidden_size, config.num_attention_heads
    width, mask = DTYPE_BYTES[config.params_dtype], mask_bytes(config.params_dtype, device_type)
    t, chunks = tensor_parallel, _sequence_chunks(tensor_parallel, sequence_parallel)
    sbh = s * b * h
    if recompute == "full":
        return sbh * width // chunks
    hidden_masks = 2 * sbh * mask if config.hidden_dropout > 0 else 0
    norms = 2 * sbh * norm_bytes_per_element(config)
    residual = (norms + hidden_masks) // chunks  # the two norms' saved inputs, dropout masks
    column_inputs = 2 * sbh * width // chunks  # sequence parallel: the chunk, gathered again
    total = residual + column_inputs + tensor_parallel_elements(config) * s * b * width // t
    if recompute == "selective":
        return total
    if recompute is not None:
        raise ConfigError(
            f"--recompute-granularity must be 'selective' or 'full', got {recompute!r}")
    if config.masked_softmax_fusion:  # fused kernel: output and log-sum-exp, no s x s tensors
        return total + (s * b * config.num_attention_heads * config.head_dim * width
                        + 4 * a * s * b) // t
    scores = a * s * s * b
    if config.attention_dropout > 0:
        return total + scores * (2 * width + mask) // t
    return total + scores * width // t


def tensor_parallel_elements(config: ModelConfig) -> int:
    """Elements per token a layer saves inside its tensor-parallel regions: query, key and value
    as the attention core sees them and the dense input (``4 x heads x head_dim``; with
    grouped-query attention the fused kernel keeps the keys and values of the query groups,
    ``(2 x heads + 2 x groups) x head_dim``, where the unfused core repeats them per head -- as
    SDPA on CUDA does for inputs its flash kernel cannot take, fp32: there this is low), the
    MLP's activation input and the second linear's input (``2f``; SwiGLU: gate and up -- its
    function recomputes silu(gate) in the backward -- and the product, ``3f``): ``12h`` for
    GPT-2."""
    heads = config.num_attention_heads
    kv_heads = config.query_groups if config.masked_softmax_fusion else heads
    attention = (2 * heads + 2 * kv_heads) * config.head_dim
    return attention + (3 if config.swiglu else 2) * config.ffn_size


def norm_bytes_per_element(config: ModelConfig) -> int:
    """Bytes a layer norm saves per element of its input: the input (LayerNorm), or with
    RMSNorm the fp32 input its statistic uses and the normalised output the weight multiplies."""
    width = DTYPE_BYTES[config.params_dtype]
    return width if config.normalization == "LayerNorm" else 4 + width


def embedding_activation_bytes(config: ModelConfig, micro_batch_size: int,
                               device_type: str = "cuda", tensor_parallel: int = 1,
                               sequence_parallel: bool = False) -> int:
    """First stage: embedding dropout mask and the int64 token and position indices."""
    s, b, h = config.seq_length, micro_batch_size, config.hidden_size
    masks = s * b * h * mask_bytes(config.params_dtype, device_type)
    masks //= _sequence_chunks(tensor_parallel, sequence_parallel)
    return (masks if config.hidden_dropout > 0 else 0) + 2 * s * b * 8


def head_activation_bytes(config: ModelConfig, family: ModelFamily,
                          micro_batch_size: int, tensor_parallel: int = 1,
                          sequence_parallel: bool = False) -> int:
    """Last stage: final layer norm input, the head's saved inputs, fp32 log-probabilities (of
    this rank's vocabulary range)."""
    s, b, h = config.seq_length, micro_batch_size, config.hidden_size
    width = DTYPE_BYTES[config.params_dtype]
    chunked = 4 if family.lm_head_transform else 1  # final norm (BERT: + dense, gelu, norm)
    chunks = _sequence_chunks(tensor_parallel, sequence_parallel)
    vocab = config.tensor_parallel_vocab_size(tensor_parallel) // tensor_parallel
    # the logits' input (all-gathered under sequence parallelism) is whole
    norm = s * b * h * norm_bytes_per_element(config)
    return ((norm + (chunked - 1) * s * b * h * width) // chunks + s * b * h * width
            + 4 * s * b * vocab)


@dataclass(frozen=True)
class StageMemory:
    """Memory of one stage replica: weights-related bytes and activation bytes per micro-batch."""

    stage: int
    num_layers: int
    parameters: int
    # the stage's copy of the tied word embedding (this tensor rank's rows; never sharded over
    # the stage-replica group: the distributed optimizer shards it over the embedding group)
    tied_parameters: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    main_grad_bytes: int
    activation_bytes: int
    activation_bytes_recompute: int
    recompute_working_bytes: int
    # of ``parameters``, the MoE experts this rank holds (sharded over their own replicas)
    expert_parameters: int = 0

    @property
    def weight_bytes(self) -> int:
        """Parameters + gradients + optimizer state (held for the whole run)."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


def estimate_stage_memory(config: ModelConfig, family: ModelFamily,
                          partition: Sequence[tuple[int, int]], micro_batch_size: int,
                          optimizer: str = "adam", sgd_momentum: float = 0.9,
                          device_type: str = "cuda", tensor_parallel: int = 1,
                          sequence_parallel: bool = False,
                          grad_reduce_in_fp32: bool | None = None,
                          expert_parallel: int = 1) -> list[StageMemory]:
    """:class:`StageMemory` of every stage of ``partition`` on one of ``tensor_parallel`` ranks.
    ``activation_bytes_recompute`` uses the config's recompute method (``uniform`` by default,
    one layer per chunk); ``device_type`` only changes the dropout-mask width (see
    :func:`mask_bytes`). ``expert_parallel``: the MoE layers' experts held per rank are
    ``experts / expert_parallel`` (the dispatched tokens' activations are not modelled)."""
    per_param = bytes_per_parameter(config.params_dtype, optimizer, sgd_momentum,
                                    grad_reduce_in_fp32)
    t, sp = tensor_parallel, sequence_parallel and tensor_parallel > 1
    full = layer_activation_bytes(config, micro_batch_size, device_type=device_type,
                                  tensor_parallel=t, sequence_parallel=sp)
    layer_input = layer_activation_bytes(config, micro_batch_size, "full", tensor_parallel=t,
                                         sequence_parallel=sp)
    chunk = config.recompute_num_layers or 1
    result = []
    for stage, (start, end) in enumerate(partition):
        n = end - start
        params = layers_parameters(config, start, end, t, expert_parallel)
        extra = 0
        if stage == 0:
            params += embedding_parameters(config, family, t)
            extra += embedding_activation_bytes(config, micro_batch_size, device_type, t, sp)
        if stage == len(partition) - 1:
            params += head_parameters(config, family, len(partition), t)
            extra += head_activation_bytes(config, family, micro_batch_size, t, sp)
        if config.recompute_method == "block":
            stored = min(chunk, n) * layer_input + max(n - chunk, 0) * full
            working = full if n else 0
        else:
            stored = math.ceil(n / chunk) * layer_input
            working = min(chunk, n) * full
        ends = (stage == 0) + (stage == len(partition) - 1 and len(partition) > 1)
        result.append(StageMemory(
            stage=stage, num_layers=n, parameters=params,
            tied_parameters=ends * tied_embedding_parameters(config, family, t),
            param_bytes=params * per_param["param"], grad_bytes=params * per_param["grad"],
            optimizer_bytes=params * per_param["optimizer"],
            main_grad_bytes=params * per_param["main_grad"],
            activation_bytes=n * full + extra,
            activation_bytes_recompute=stored + extra,
            recompute_working_bytes=working,
            expert_parameters=expert_parameters(config, start, end, expert_parallel)))
    return result
