"""FP8 training in the performance model: Megatron's recipes, the GEMMs they run in FP8, the
kernels they add and the memory they change.

Flags as Megatron-LM spells them (``megatron/training/arguments.py``, Transformer-Engine group):
``--fp8-format {e4m3,hybrid}`` (hybrid: E4M3 forward, E5M2 gradients; both one byte, so the two
cost the same here) and ``--fp8-recipe {tensorwise,delayed,mxfp8,blockwise}`` (default
``delayed``). What each recipe costs on top of the 16-bit model, per FP8 linear (the layers'
QKV, attention output and two MLP GEMMs with their input- and weight-gradient GEMMs; the
attention core, the LM head, the embeddings and the norms stay 16-bit, as Transformer Engine
runs them):

* **GEMMs** at the profile's FP8 peak (``HardwareProfile.peak_tflops_fp8``) with one-byte
  operands (:func:`~megatron_chimera.tuning.operators.gemm_seconds`); ``blockwise`` on tensor
  cores without block scales (Hopper) pays the promotion of each 128-deep partial sum on the CUDA
  cores (``fp8-block``, see operators); ``mxfp8`` needs MX tensor cores (Blackwell,
  ``mxfp8_tensor_cores``) and is refused elsewhere.
* **Casts and transposes** (memory-bound): every forward GEMM's input is quantised once, read in
  16-bit and written twice in FP8 (the row-wise copy for the GEMM and the column-wise /
  transposed copy Hopper's TN-only FP8 GEMM needs for the weight gradient; Transformer Engine
  fuses the cast and the transpose); every backward's output gradient the same. ``tensorwise``
  (current scaling) first reads the tensor once more for its amax (the scale must be known before
  the cast); ``delayed`` takes the scale from the amax history and updates it in one fused kernel
  per pass; ``blockwise`` / ``mxfp8`` compute each block's amax inside the cast kernel.
* **Weights**: cast once per iteration after the optimizer step (read 16-bit, write the two FP8
  copies: 4 bytes per parameter moved, charged to the step), kept for all micro-batches
  (+2 bytes per linear-weight parameter of memory).
* **Activations**: the linears' saved inputs are their FP8 copies (1 byte instead of 2): the two
  column-parallel inputs (``2 s b h``, or ``/T`` with sequence parallelism), the attention-output
  input (``s b heads d / T``) and the second MLP linear's input (``s b f / T``); an RMSNorm is
  Transformer Engine's (fused into the next linear), which keeps its 16-bit input and an fp32
  ``rstd`` per token where ours keeps the fp32 input and the normalised 16-bit output
  (``model/memory.py``: 4 bytes per element more, twice per layer); none of this with full
  recomputation (only the layer input is kept).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_chimera.config import DTYPE_BYTES, ConfigError, ModelConfig
from megatron_chimera.model.memory import norm_bytes_per_element
from megatron_chimera.tuning.hardware import HardwareProfile
from megatron_chimera.tuning.operators import Gemm, Ops, Streaming

FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("tensorwise", "delayed", "mxfp8", "blockwise")  # Megatron-LM's choices
DEFAULT_RECIPE = "delayed"  # Megatron-LM's default
FP8_LINEARS = ("qkv", "dense", "fc1", "fc2")
FP8_COPIES = 2  # row-wise and column-wise (transposed) FP8 copies of a weight or an input
WEIGHT_CAST_BYTES = 2 + FP8_COPIES  # per parameter and iteration: read 16-bit, write two copies


@dataclass(frozen=True)
class Fp8Config:
    """One FP8 training setting: ``--fp8-format`` and ``--fp8-recipe``."""

    format: str = "hybrid"
    recipe: str = DEFAULT_RECIPE

    def __post_init__(self) -> None:
        if self.format not in FP8_FORMATS:
            raise ConfigError(f"--fp8-format must be one of {FP8_FORMATS}, got {self.format!r}")
        if self.recipe not in FP8_RECIPES:
            raise ConfigError(f"--fp8-recipe must be one of {FP8_RECIPES}, got {self.recipe!r}")

    def describe(self) -> str:
        """E.g. ``fp8 hybrid/blockwise``."""
        return f"fp8 {self.format}/{self.recipe}"


def fp8_from_flags(fp8_format: str | None, fp8_recipe: str | None) -> Fp8Config | None:
    """The setting of ``--fp8-format`` / ``--fp8-recipe`` (None without ``--fp8-format``;
    ConfigError for a recipe without a format, as Megatron ignores it silently)."""
    if fp8_format is None:
        if fp8_recipe is not None:
            raise ConfigError("--fp8-recipe needs --fp8-format (e4m3 or hybrid)")
        return None
    return Fp8Config(fp8_format, fp8_recipe or DEFAULT_RECIPE)


def check_fp8(fp8: Fp8Config | None, hardware: HardwareProfile, config: ModelConfig) -> None:
    """ConfigError when the profile cannot run the recipe or the model is not priced in FP8."""
    if fp8 is None:
        return
    hardware.peak_flops("fp8")  # no FP8 tensor cores: one line naming the profile
    if fp8.recipe == "mxfp8" and not hardware.mxfp8_tensor_cores:
        raise ConfigError(f"--fp8-recipe mxfp8 needs MX block-scaled tensor cores (Blackwell); "
                          f"the {hardware.name} profile has none (mxfp8_tensor_cores false): "
                          f"use blockwise, tensorwise or delayed")
    if config.params_dtype == "fp32":
        raise ConfigError("--fp8-format needs --bf16 or --fp16 (FP8 GEMMs in a 16-bit model)")
    if config.moe.enabled:
        raise ConfigError("--fp8-format with --num-experts: the performance model does not "
                          "price FP8 expert GEMMs")


def gemm_dtype(fp8: Fp8Config, hardware: HardwareProfile) -> str:
    """``fp8`` (tensor-scaled, or MX scales in the tensor cores) or ``fp8-block`` (block scales
    promoted on the CUDA cores)."""
    return "fp8-block" if fp8.recipe == "blockwise" and not hardware.mxfp8_tensor_cores else "fp8"


def _base(name: str) -> tuple[str, str]:
    """(linear, role) of a GEMM name: role ``fwd``, ``dgrad`` or ``wgrad``."""
    for role in ("dgrad", "wgrad"):
        if name.endswith(f".{role}"):
            return name[: -len(role) - 1], role
    return name, "fwd"


def _quantise(fp8: Fp8Config, elements: float, width: int) -> list[Streaming]:
    """Kernels that quantise one 16-bit tensor of ``elements`` into its two FP8 copies."""
    streams = [Streaming("fp8-cast-transpose", elements * (width + FP8_COPIES))]
    if fp8.recipe == "tensorwise":  # current scaling: the amax before the cast
        streams.append(Streaming("fp8-amax", elements * width))
    return streams


def fp8_ops(fp8: Fp8Config | None, ops: Ops, hardware: HardwareProfile, width: int) -> Ops:
    """``ops`` as an FP8 recipe runs them: the linears' GEMMs in FP8 plus the quantisation kernels
    of their inputs (forward) and output gradients (input-gradient GEMMs); ``ops`` unchanged
    without FP8 (module doc)."""
    if fp8 is None:
        return ops
    dtype = gemm_dtype(fp8, hardware)
    streams: list[Streaming] = []

    def convert(gemms: tuple[Gemm, ...]) -> tuple[Gemm, ...]:
        out = []
        for g in gemms:
            linear, role = _base(g.name)
            if linear not in FP8_LINEARS:
                out.append(g)
                continue
            out.append(Gemm(g.name, g.m, g.n, g.k, g.batch, dtype))
            if role != "wgrad":  # the forward's input, or the gradient of its output
                streams.extend(_quantise(fp8, float(g.m) * g.k * g.batch, width))
        return tuple(out)

    gemms, weight_gemms = convert(ops.gemms), convert(ops.weight_gemms)
    if streams and fp8.recipe == "delayed":  # amax history and scale update, one fused kernel
        streams.append(Streaming("fp8-scale-update", 0.0))
    return Ops(gemms, ops.streams + tuple(streams), weight_gemms)


def fp8_weight_cast_bytes(fp8: Fp8Config | None) -> float:
    """Bytes per parameter the once-per-iteration weight cast moves (0 without FP8)."""
    return float(WEIGHT_CAST_BYTES) if fp8 is not None else 0.0


def linear_parameters_per_layer(config: ModelConfig, tensor_parallel: int = 1) -> int:
    """Weight elements of one layer's FP8 linears on one of ``tensor_parallel`` ranks."""
    h, t = config.hidden_size, tensor_parallel
    mlp_in = 2 * config.ffn_size if config.swiglu else config.ffn_size
    attention_out = config.num_attention_heads * config.head_dim
    return h * (config.qkv_size + attention_out + mlp_in + config.ffn_size) // t


def fp8_activation_saving(config: ModelConfig, micro_batch: int, tensor_parallel: int,
                          sequence_parallel: bool, recompute: str | None) -> int:
    """Bytes one layer saves less per micro-batch when its linears keep FP8 inputs (0 with full
    recomputation: only the layer's input is kept)."""
    if recompute == "full":
        return 0
    t = tensor_parallel
    tokens = config.seq_length * micro_batch
    chunks = t if sequence_parallel and t > 1 else 1
    column_inputs = 2 * tokens * config.hidden_size // chunks
    row_inputs = tokens * (config.num_attention_heads * config.head_dim + config.ffn_size) // t
    saving = (column_inputs + row_inputs) * (DTYPE_BYTES[config.params_dtype] - 1)
    if config.normalization == "RMSNorm":  # TE's norm keeps the 16-bit input and fp32 rstd
        ours = norm_bytes_per_element(config) - DTYPE_BYTES[config.params_dtype]
        saving += 2 * tokens * (ours * config.hidden_size - 4) // chunks
    return saving
