"""Fused kernels: NVIDIA Apex when its CUDA extensions are importable, torch-native otherwise.

Which kernel runs, per op (``fused`` = ``--masked-softmax-fusion`` / ``--bias-gelu-fusion`` on,
the default; ``unfused`` = the reference composition of element-wise ops, for comparison):

* layer norm: Apex ``fused_layer_norm_affine``, else ``F.layer_norm`` (one native kernel).
* attention core: ``F.scaled_dot_product_attention`` on both backends (flash / memory-efficient
  kernels on CUDA; Apex has no better one). Unfused: matmul, masked softmax, dropout, matmul.
* bias + GeLU (tanh approximation): the bias is added by :class:`~.linear.Linear` (which must own
  it for the split backward), then ``F.gelu(approximate="tanh")``, one native kernel forward and
  backward. Unfused: the tanh formula in separate element-wise ops.
* SwiGLU (``--swiglu``): one autograd function that saves only ``[gate | up]`` and recomputes
  ``silu`` in its backward (:func:`swiglu`); on CUDA with ``--bias-dropout-fusion`` its forward
  and backward are each one ``torch.compile``d kernel (Megatron's ``bias_swiglu_impl``), and so
  is RoPE's rotation (:mod:`.rotary`), where the compiler runs (:func:`compiled_elementwise`).
* bias + dropout + add: the bias added inside the output projection's matmul (one ``addmm``;
  after the reduction with T > 1, deferrable to W in a split backward), then in training on
  CUDA ``residual + dropout(x)`` as one ``torch.compile``d kernel (Megatron's
  ``bias_dropout_add_fused_train``, which Megatron-core also compiles with ``torch.compile``);
  on the CPU the native ``residual + dropout(x)`` (compiling buys nothing there: host-bound, and
  a compile per shape). Where the compiler cannot run (no working Triton or C toolchain on the
  node) the eager ``residual + dropout(x)`` runs instead, after one warning
  (:func:`fused_bias_dropout_add`). With ``--no-bias-dropout-fusion`` nothing is compiled: the
  output projections return their bias and Megatron's unfused ``residual + dropout(x + bias)``
  adds it in separate ops.
* ``--use-flash-attn`` (CUDA): SDPA restricted to its cuDNN, flash and memory-efficient kernels; a
  configuration none of them supports raises :class:`ConfigError` with torch's reasons instead of
  falling back to the math kernel. On the CPU the flag cannot apply (those are CUDA kernels) and
  is reported once (:func:`warn_once`).
* the optimizer's kernels (Adam step, grad norm, grad copies) live in
  :mod:`megatron_chimera.optimizer.kernels` and use the same backend choice.

NVIDIA Apex is detected by its modules (``apex.normalization``, ``apex.optimizers``,
``apex.multi_tensor_apply``, ``amp_C``) on a CUDA machine; the PyPI package called ``apex`` is an
unrelated project. The choice is made and logged once per process and ``use_apex`` setting
(``--no-apex`` forces the native path).
"""

from __future__ import annotations

import functools
import importlib
import logging
import math
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megatron_chimera.config import ConfigError
from megatron_chimera.errors import one_line

logger = logging.getLogger(__name__)

APEX_MODULES = ("apex.normalization", "apex.optimizers", "apex.multi_tensor_apply", "amp_C")
# Megatron's additive mask value: finite, so fully masked rows stay NaN-free in fp16/bf16.
MASK_VALUE = -10000.0


@dataclass(frozen=True)
class FusedBackend:
    """The kernel family used for layer norm, the Adam step and multi-tensor ops."""

    apex: bool

    @property
    def name(self) -> str:
        """``"apex"`` or ``"native"``."""
        return "apex" if self.apex else "native"


def apex_importable() -> bool:
    """True when NVIDIA Apex's CUDA extensions import and a CUDA device exists."""
    if not torch.cuda.is_available():
        return False
    for name in APEX_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            return False
    return True


@functools.cache
def get_fused_backend(use_apex: bool | None = None) -> FusedBackend:
    """Choose the kernel family once per setting: ``None`` auto-detects, ``False`` forces native.

    ``True`` demands Apex and raises :class:`ConfigError` when it is missing.
    """
    available = apex_importable()
    if use_apex and not available:
        raise ConfigError(
            "--use-apex: NVIDIA Apex with CUDA extensions (apex.normalization, apex.optimizers, "
            "amp_C) is not importable on a CUDA machine; drop the flag to use torch-native kernels"
        )
    backend = FusedBackend(apex=available and use_apex is not False)
    reason = "forced by --no-apex" if use_apex is False else (
        "NVIDIA Apex found" if available else "NVIDIA Apex not importable")
    logger.info("fused kernels: %s (%s)", backend.name, reason)
    return backend


# --------------------------------------------------------------------------- layer norm
class LayerNorm(nn.Module):
    """Layer norm over the last dimension with Megatron's parameter names (``weight``, ``bias``)."""

    def __init__(self, hidden_size: int, eps: float, backend: FusedBackend,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.normalized_shape = (hidden_size,)
        self.eps = eps
        self.backend = backend
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``x`` with the Apex kernel or ``F.layer_norm``."""
        if self.backend.apex:
            fln = importlib.import_module("apex.normalization.fused_layer_norm")
            return fln.fused_layer_norm_affine(
                x, self.weight, self.bias, self.normalized_shape, self.eps)
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """Root-mean-square norm (``--normalization RMSNorm``): ``weight * x / rms(x)``, the statistic
    in fp32 and the product in the input's dtype (as Megatron and transformers); no bias."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``x`` over its last dimension (``F.rms_norm``'s one kernel where this torch
        has it: the weight folded in for float32/64 inputs; 16-bit inputs normalised in fp32
        and rounded before the weight, as Megatron and transformers do)."""
        if _RMS_NORM is None:
            x32 = x.float()
            normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
            return self.weight * normed.to(x.dtype)
        shape = (x.shape[-1],)
        if x.dtype == self.weight.dtype and x.dtype in (torch.float32, torch.float64):
            return _RMS_NORM(x, shape, self.weight, self.eps)
        return self.weight * _RMS_NORM(x.float(), shape, None, self.eps).to(x.dtype)


_RMS_NORM = getattr(F, "rms_norm", None)  # torch >= 2.4


# --------------------------------------------------------------------------- element-wise
def gelu(x: torch.Tensor, fused: bool = True) -> torch.Tensor:
    """GeLU with the tanh approximation (Megatron's ``bias_gelu``; the bias comes from ``Linear``).

    ``fused`` runs the one native kernel; otherwise the tanh formula in separate element-wise ops.
    """
    if fused:
        return F.gelu(x, approximate="tanh")
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def _swiglu_forward(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _swiglu_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # the ops autograd runs for silu(gate) * up, in its order: the same values
    gate, up = x.chunk(2, dim=-1)
    return torch.cat((torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)), -1)


class _SwiGLU(torch.autograd.Function):
    """SwiGLU saving only its input ``[gate | up]`` (``2f`` per token, where autograd's
    composition also keeps ``silu(gate)``: ``3f``); the backward recomputes ``silu``."""

    @staticmethod
    def forward(ctx, x, kernels):  # noqa: D102
        ctx.save_for_backward(x)
        ctx.kernels = kernels
        return _run(kernels[0], _swiglu_forward, x)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        (x,) = ctx.saved_tensors
        return _run(ctx.kernels[1], _swiglu_backward, grad, x), None


def _run(kernel: Callable, eager: Callable, *args: torch.Tensor) -> torch.Tensor:
    """``kernel(*args)``; a compiled kernel whose (re)compile fails runs ``eager`` instead."""
    if kernel is eager:
        return eager(*args)
    try:
        return kernel(*args)
    except _compiler_errors() as exc:
        _compiler_failed(BIAS_DROPOUT_ADD_BACKEND, exc)
        return eager(*args)


def swiglu(x: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` of ``x = [gate | up]`` along the last dimension (Megatron's order),
    saving ``x`` only. ``fused`` (the layers pass it on CUDA with ``--bias-dropout-fusion``):
    forward and backward each one ``torch.compile``d kernel (Megatron's ``bias_swiglu_impl``)
    where the compiler runs (:func:`compiled_elementwise`), else the eager ops -- bitwise what
    autograd computes for the composition."""
    forward = compiled_elementwise(_swiglu_forward, x.device, x.dtype) if fused else None
    if forward is None:
        return _SwiGLU.apply(x, (_swiglu_forward, _swiglu_backward))
    backward = compiled_elementwise(_swiglu_backward, x.device, x.dtype)
    return _SwiGLU.apply(x, (forward, backward))


def bias_dropout_add(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                     prob: float, training: bool, fused: bool = False) -> torch.Tensor:
    """``residual + dropout(x + bias)``, Megatron's residual connection after attention and MLP.

    ``fused`` (``--bias-dropout-fusion`` in training, on CUDA): one ``torch.compile``d kernel
    (:func:`compiled_bias_dropout_add`, Megatron's ``bias_dropout_add_fused_train``) instead of
    separate dropout and add kernels. Its dropout draws from the same generator (so keyed
    dropout and recomputation replay it) but through the compiler's own random kernel: the masks
    differ from the eager path's, as Megatron's fused masks do."""
    if fused and training and prob > 0:
        compiled = fused_bias_dropout_add(x.device, x.dtype)
        if compiled is not None:
            try:
                return compiled(x, bias, residual, prob)
            except _compiler_errors() as exc:  # a recompile (new shape) the compiler failed
                _compiler_failed(BIAS_DROPOUT_ADD_BACKEND, exc)
    if bias is not None:
        x = x + bias
    return residual + F.dropout(x, p=prob, training=training)


def _bias_dropout_add_train(x: torch.Tensor, bias: torch.Tensor | None,
                            residual: torch.Tensor, prob: float) -> torch.Tensor:
    if bias is not None:
        x = x + bias
    return residual + F.dropout(x, p=prob, training=True)


@functools.cache
def compiled_bias_dropout_add(backend: str | Callable = "inductor"):
    """``residual + dropout(x + bias)`` in training, compiled whole (``fullgraph``: a graph
    break would silently unfuse it) by ``backend`` -- inductor, which fuses it into one kernel
    on CUDA; tests trace it with ``aot_eager`` on the CPU (the same graph, eager kernels)."""
    return torch.compile(_bias_dropout_add_train, fullgraph=True, backend=backend)


# the compiler backend of the fused path (tests put a failing one here)
BIAS_DROPOUT_ADD_BACKEND: str | Callable = "inductor"
_COMPILER_FAILED: set = set()  # backends that failed once: eager from then on


def _compiler_errors() -> tuple[type[BaseException], ...]:
    """What a failing ``torch.compile`` raises: Dynamo's errors (a backend failure, inductor's
    errors -- no working Triton included -- are wrapped in them) and inductor's C++ compile
    error."""
    from torch._dynamo.exc import TorchDynamoException
    from torch._inductor.exc import CppCompileError

    return TorchDynamoException, CppCompileError


def _compiler_failed(backend: str | Callable, exc: BaseException) -> None:
    """Remember that ``backend`` cannot compile here and say so once."""
    _COMPILER_FAILED.add(backend)
    reason = f"{type(exc).__name__}: {one_line(exc)[:200]}"
    warn_once("--bias-dropout-fusion: torch.compile cannot run on this node "
              f"({reason}); bias-dropout-add, SwiGLU and RoPE run eager (unfused) instead. "
              "Install a working "
              "Triton / C compiler, or pass --no-bias-dropout-fusion to silence this")


def _bias_dropout_add_probe(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    # the fused function's body under another code object: its compile cache stays apart
    return residual + F.dropout(x, p=0.5, training=True)


def _probe_compiler(backend: str | Callable, device: torch.device, dtype: torch.dtype) -> None:
    """Compile and run forward *and backward* of a tiny bias-dropout-add with ``backend`` (the
    backward is compiled lazily, at its first call: a probe of the forward alone would let a
    failing backward compile end a training step). Runs in its own thread, so none of the
    caller's autograd context (saved-tensor hooks of activation checkpointing, autocast,
    no-grad) applies, with the random state forked: the probe's dropout draws nothing from the
    run's generators."""
    failure: list[BaseException] = []

    def probe() -> None:
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [],
                                       device_type=device.type):
                compiled = torch.compile(_bias_dropout_add_probe, fullgraph=True,
                                         backend=backend)
                x = torch.ones(8, 8, device=device, dtype=dtype, requires_grad=True)
                compiled(x, torch.zeros(8, 8, device=device, dtype=dtype)).sum().backward()
        except Exception as exc:  # noqa: BLE001 - handed to the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=probe, name="compile-probe")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]


_PROBED: dict[tuple, bool] = {}


def compiler_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :data:`BIAS_DROPOUT_ADD_BACKEND` compiles and runs here for ``device`` and
    ``dtype`` -- checked once by a probe (:func:`_probe_compiler`); False after one warning."""
    backend = BIAS_DROPOUT_ADD_BACKEND
    if backend in _COMPILER_FAILED:
        return False
    key = (backend, device.type, dtype)
    if key not in _PROBED:
        try:
            _probe_compiler(backend, device, dtype)
            _PROBED[key] = True
        except Exception as exc:  # noqa: BLE001 - any failure: the compiler cannot run here
            _PROBED[key] = False
            _compiler_failed(backend, exc)
    return _PROBED[key]


def fused_bias_dropout_add(device: torch.device, dtype: torch.dtype) -> Callable | None:
    """The compiled bias-dropout-add (:func:`compiled_bias_dropout_add` with
    :data:`BIAS_DROPOUT_ADD_BACKEND`) when the compiler runs (:func:`compiler_runs`), else None:
    the caller runs the eager ops."""
    if not compiler_runs(device, dtype):
        return None
    return compiled_bias_dropout_add(BIAS_DROPOUT_ADD_BACKEND)


@functools.cache
def _compiled(function: Callable, backend: str | Callable) -> Callable:
    return torch.compile(function, fullgraph=True, backend=backend)


def compiled_elementwise(function: Callable, device: torch.device, dtype: torch.dtype
                         ) -> Callable | None:
    """``function`` (element-wise ops: SwiGLU, RoPE) compiled whole by
    :data:`BIAS_DROPOUT_ADD_BACKEND` -- inductor fuses it into one kernel on CUDA -- when the
    compiler runs here (:func:`compiler_runs`), else None: the caller runs it eager. A caller
    catches :func:`compiler_errors` of a later recompile (:func:`compiler_failed`) and runs it
    eager the same way."""
    if not compiler_runs(device, dtype):
        return None
    return _compiled(function, BIAS_DROPOUT_ADD_BACKEND)


def compiler_errors() -> tuple[type[BaseException], ...]:
    """What a failing compile of :func:`compiled_elementwise`'s function raises."""
    return _compiler_errors()


def compiler_failed(exc: BaseException) -> None:
    """Record that the compiler failed (:data:`BIAS_DROPOUT_ADD_BACKEND`: eager from now on)."""
    _compiler_failed(BIAS_DROPOUT_ADD_BACKEND, exc)


# --------------------------------------------------------------------------- notices
_NOTICES: set[str] = set()


def warn_once(message: str) -> None:
    """Log ``message`` as a warning once per process, on global rank 0 only."""
    if message in _NOTICES:
        return
    _NOTICES.add(message)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    logger.warning("warning: %s", message)


# --------------------------------------------------------------------------- attention core
def _flash_backends() -> list:
    """The fused SDPA kernels ``--use-flash-attn`` allows: cuDNN attention (where this torch has
    it; its default on Hopper), FlashAttention-2 and memory-efficient attention -- torch picks
    among them in its own priority order."""
    from torch.nn.attention import SDPBackend

    cudnn = getattr(SDPBackend, "CUDNN_ATTENTION", None)
    return [b for b in (cudnn, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)
            if b is not None]


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
         allowed: torch.Tensor | None, dropout_p: float, is_causal: bool,
         flash_only: bool = False, enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention``; ``flash_only`` limits it to the fused kernels
    (cuDNN, flash, memory-efficient) and turns "no kernel" into a ConfigError naming torch's
    reasons.
    ``enable_gqa``: key and value have fewer heads than the query, each shared by a group of
    consecutive query heads (:func:`sdpa_handles_gqa` says when the kernel takes them so)."""
    if not flash_only:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=allowed,
                                              dropout_p=dropout_p, is_causal=is_causal,
                                              enable_gqa=enable_gqa)
    from torch.nn.attention import sdpa_kernel

    try:
        with sdpa_kernel(_flash_backends()):
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed,
                                                 dropout_p=dropout_p, is_causal=is_causal,
                                                 enable_gqa=enable_gqa)
    except RuntimeError as exc:
        if "No available kernel" not in str(exc):
            raise
        raise ConfigError(_no_flash_kernel_message(query, key, value, allowed, dropout_p,
                                                   is_causal, enable_gqa)) from None
    _note_flash_kernel(query, key, value, allowed, dropout_p, is_causal, enable_gqa)
    return out


_GQA_KERNEL: dict[tuple, bool] = {}  # sdpa_handles_gqa's answers, by what decides them


def sdpa_handles_gqa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     allowed: torch.Tensor | None, dropout_p: float, is_causal: bool) -> bool:
    """Whether SDPA should get grouped-query keys and values as they are (``enable_gqa``)
    rather than repeated per query head: on the CPU (its kernels read the shared heads; the
    same results), and on CUDA where the flash kernel takes this call with ``enable_gqa`` --
    the memory-efficient kernel does not, and SDPA would fall back to its math kernel, slower
    than repeating the heads for the memory-efficient one. Decided once per dtype, head size,
    mask, dropout and causality (what the flash kernel's checks depend on here)."""
    if not query.is_cuda:
        return True
    what = (query.device, query.dtype, query.shape[-1], allowed is None, dropout_p > 0,
            is_causal)
    handled = _GQA_KERNEL.get(what)
    if handled is None:
        from torch.nn.attention import SDPAParams, can_use_flash_attention

        params = SDPAParams(query, key, value, allowed, dropout_p, is_causal, True)
        handled = _GQA_KERNEL[what] = bool(can_use_flash_attention(params))
    return handled


def repeat_heads(tensor: torch.Tensor, times: int) -> torch.Tensor:
    """Grouped-query keys or values ``[b, groups, s, d]`` repeated for each query head of their
    group (``[b, groups x times, s, d]``)."""
    return tensor if times == 1 else tensor.repeat_interleave(times, dim=1)


def _no_flash_kernel_message(query, key, value, allowed, dropout_p, is_causal,
                             enable_gqa=False) -> str:
    """Why SDPA has neither kernel: rerun the selection, collecting torch's warnings."""
    from torch.nn.attention import sdpa_kernel

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel(_flash_backends()):
                F.scaled_dot_product_attention(query, key, value, attn_mask=allowed,
                                               dropout_p=dropout_p, is_causal=is_causal,
                                               enable_gqa=enable_gqa)
        except RuntimeError:
            pass
    reasons = []
    for warning in caught:
        text = str(warning.message).split(" (Triggered internally")[0].strip()
        if text and not text.endswith("not used because:") and text not in reasons:
            reasons.append(text)
    what = (f"dtype {str(query.dtype).replace('torch.', '')}, head dim {query.shape[-1]}, "
            f"{'explicit mask' if allowed is not None else 'no mask'}, dropout {dropout_p:g}, "
            f"{query.device.type}")
    return (f"--use-flash-attn: scaled_dot_product_attention has no cuDNN, flash or "
            f"memory-efficient kernel for this configuration ({what}): "
            f"{'; '.join(reasons) or 'no reason given'}")


def _note_flash_kernel(query, key, value, allowed, dropout_p, is_causal,
                       enable_gqa=False) -> None:
    """Say once which fused kernel SDPA can use first (CUDA only; cuDNN where it takes the call
    and this torch can say so)."""
    if not query.is_cuda:
        return
    from torch.nn.attention import SDPAParams, can_use_flash_attention

    params = SDPAParams(query, key, value, allowed, dropout_p, is_causal, enable_gqa)
    cudnn = getattr(torch.backends.cuda, "can_use_cudnn_attention", None)
    if cudnn is not None and cudnn(params):
        kernel = "cuDNN"
    else:
        kernel = "flash" if can_use_flash_attention(params) else "memory-efficient"
    if f"kernel:{kernel}" not in _NOTICES:
        _NOTICES.add(f"kernel:{kernel}")
        logger.info("--use-flash-attn: scaled_dot_product_attention uses its %s kernel", kernel)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              mask: torch.Tensor | None, causal: bool, dropout_p: float, training: bool,
              fused: bool = True, softmax_in_fp32: bool = False,
              layer_scale: float = 1.0, flash_only: bool = False) -> torch.Tensor:
    """Scaled, masked softmax attention on ``[b, heads, s, head_dim]`` tensors.

    ``mask`` is boolean, True where attention is *forbidden*, broadcastable to
    ``[b, heads, sq, sk]``; ``causal`` adds the upper-triangular mask. ``softmax_in_fp32`` and
    ``layer_scale`` (Megatron's query-key layer scaling: divide the scores by it, multiply back
    in the fp32 softmax; mathematically a no-op that guards the fp16 range) concern the unfused
    path; the fused kernels accumulate the softmax in fp32 anyway. ``flash_only``: see
    :func:`sdpa` (fused path only). Grouped-query attention: ``key`` and ``value`` may have
    fewer heads than ``query`` (each shared by consecutive query heads); SDPA takes them as
    they are where its kernel can (:func:`sdpa_handles_gqa`), else they are repeated per head.
    """
    p = dropout_p if training else 0.0
    repeats = query.shape[-3] // key.shape[-3]
    if fused:
        allowed = None if mask is None else ~mask
        if allowed is not None and causal:
            sq, sk = query.shape[-2], key.shape[-2]
            allowed = allowed & _causal_allowed(sq, sk, query.device)
            causal = False
        if repeats > 1 and sdpa_handles_gqa(query, key, value, allowed, p, causal):
            # (own copies of the few key and value heads: views of the layer's QKV buffer
            # would keep all of it alive for the backward)
            return sdpa(query, key.contiguous(), value.contiguous(), allowed, p, causal,
                        flash_only, enable_gqa=True)
        key, value = repeat_heads(key, repeats), repeat_heads(value, repeats)
        return sdpa(query, key, value, allowed, p, causal, flash_only)

    key, value = repeat_heads(key, repeats), repeat_heads(value, repeats)

    b, heads, sq, hd = query.shape
    sk = key.shape[-2]
    norm = math.sqrt(hd) * layer_scale
    scores = torch.matmul(query, key.transpose(-1, -2)) / norm
    if softmax_in_fp32 or layer_scale != 1.0:
        scores = scores.float() * layer_scale
    forbidden = mask
    if causal:
        tri = ~_causal_allowed(sq, sk, query.device)
        forbidden = tri if forbidden is None else (forbidden | tri)
    if forbidden is not None:
        scores = scores.masked_fill(forbidden, MASK_VALUE)
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    probs = F.dropout(probs, p=p, training=training)
    return torch.matmul(probs, value)


def _causal_allowed(sq: int, sk: int, device: torch.device) -> torch.Tensor:
    """Lower-triangular boolean ``[sq, sk]``: query i may attend to keys ``<= i``."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril()
