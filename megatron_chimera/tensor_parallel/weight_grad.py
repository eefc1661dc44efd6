"""The linear function whose weight gradient can be deferred, for split-backward (zero-bubble)
schedules, shared by ``model.linear.Linear`` and the tensor-parallel linears.

A split-backward schedule runs the backward of a micro-batch in two actions: ``B`` computes only
the gradient with respect to the layer inputs (it is on the pipeline's critical path), ``W``
computes the weight and bias gradients later, in time the pipeline would otherwise idle.

:class:`LinearWithDeferrableWeightGrad` computes ``y = x W^T (+ b)`` for a module that owns
``weight``, ``bias`` and ``weight_grad_store``. With no store attached its backward is the ordinary
one. With a :class:`WeightGradStore` attached (``with defer_weight_grad(module, store):
loss.backward()``) the backward returns the input gradient only and queues ``(input,
grad_output)``; ``store.flush()`` (the ``W`` action) computes ``grad_output^T @ input`` and
accumulates it into the weight's gradient buffer (``weight.main_grad``, see
:mod:`megatron_chimera.distributed.grad_buffer`) or, without one, into ``weight.grad``. The store
hangs off the module, not a global, so backward threads and several stage replicas on one rank
cannot mix up their queues. Tensor-parallel
communication runs in separate autograd functions around this one (:mod:`.mappings`), so the
input gradient's all-reduce or reduce-scatter happens in ``B`` and ``W`` is local.

**Gradient-accumulation fusion** (Megatron's, on unless ``--no-gradient-accumulation-fusion``): a
weight whose gradient buffer marked it (``weight.fuse_wgrad_accumulation``) gets its gradient
computed straight into ``weight.main_grad`` -- Apex's ``wgrad_gemm_accum_fp32`` /
``_fp16`` (chosen by ``main_grad``'s dtype) when its CUDA extension is importable, one
``addmm_`` into ``main_grad`` when the dtypes agree, or without Apex torch's ``addmm(...,
out_dtype=torch.float32, out=main_grad)`` for half-precision inputs into fp32 gradients where
the installed torch has that CUDA kernel (:func:`wgrad_accumulation_path`) -- instead of
materialising it and adding it in the buffer's post-accumulate hook. The backward then hands
autograd a placeholder and sets ``weight.grad_added_to_main_grad``, which tells the hook to
skip the add (its readiness callback still fires, so overlapped reductions see the parameter as
final). The deferred ``W`` of split-backward schedules accumulates the same way. It is turned on
where it saves a kernel (:func:`fusion_saves_work`: CUDA), as Megatron's needs its CUDA
extension.

**Host cost**: a layer whose weight gradient is neither deferrable (the executor turns that on
for split-backward schedules only, :func:`set_weight_grad_deferral`) nor fused runs torch's own
``F.linear``: no Python autograd function in its forward or backward.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from megatron_chimera.tensor_parallel.mappings import (
    gather_along_first_dim,
    reduce_scatter_along_first_dim,
)


class WeightGradStore:
    """Weight-gradient work queued by the B of one (pipe, stage, micro-batch), run by its W."""

    def __init__(self) -> None:
        self._pending: list[tuple[nn.Parameter | None, nn.Parameter | None,
                                  torch.Tensor | None, torch.Tensor, bool]] = []

    def put(
        self,
        weight: nn.Parameter | None,
        bias: nn.Parameter | None,
        inputs: torch.Tensor | None,
        grad_output: torch.Tensor,
        sequence_sharded: bool = False,
    ) -> None:
        """Queue the weight (and bias) gradient of one linear layer (``weight`` None: the bias
        gradient only, of a bias added after a reduction). ``sequence_sharded``: ``inputs`` is
        this rank's sequence chunk, all-gathered over the tensor-parallel group when W runs
        (the queue keeps ``[s/T, b, h]``, as the forward saved it)."""
        self._pending.append((weight, bias, inputs, grad_output, sequence_sharded))

    def __len__(self) -> int:
        return len(self._pending)

    def flush(self) -> None:
        """Compute every queued weight/bias gradient, accumulate it into ``main_grad`` (or
        ``.grad``), free inputs."""
        for _ in self.pieces():
            pass

    def pieces(self) -> Iterator[None]:
        """:meth:`flush` one entry per step (a W half of a paired action, ``pipeline/overlap.py``:
        one entry per all-to-all of its partner)."""
        for index in range(len(self._pending)):
            if index:
                yield
            with torch.no_grad():
                self._flush_entry(index)
        self._pending.clear()

    def _flush_entry(self, index: int) -> None:
        """Compute and accumulate the gradients of queued entry ``index``."""
        weight, bias, inputs, grad_output, sequence_sharded = self._pending[index]
        if weight is not None and sequence_sharded:
            inputs = gather_along_first_dim(inputs)
        if weight is not None and fuses_weight_grad(weight):
            accumulate_weight_grad_(weight, inputs, grad_output)
        elif weight is not None:
            _accumulate(weight, _weight_grad(inputs, grad_output))
        if bias is not None:
            _accumulate(bias, _bias_grad(grad_output))


def _weight_grad(inputs: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    flat_grad = grad_output.reshape(-1, grad_output.shape[-1])
    return flat_grad.t().matmul(inputs.reshape(-1, inputs.shape[-1]))


def _bias_grad(grad_output: torch.Tensor) -> torch.Tensor:
    return grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0)


@functools.cache
def apex_wgrad_kernel():
    """Apex's ``fused_weight_gradient_mlp_cuda`` extension, or None when it (or CUDA) is
    missing (the PyPI package called ``apex`` is an unrelated project and has no such module)."""
    if not torch.cuda.is_available():
        return None
    try:
        return importlib.import_module("fused_weight_gradient_mlp_cuda")
    except ImportError:
        return None


HALF_DTYPES = (torch.float16, torch.bfloat16)


def _gpu_kernels(device: torch.device) -> bool:
    """Whether ``device`` runs the fused GEMMs below (CUDA; one place, so a CPU test can stand
    in for it)."""
    return device.type == "cuda"


@functools.cache
def native_out_dtype_accumulation(device: torch.device) -> bool:
    """Whether this torch accumulates a half-precision product into an fp32 tensor in one GEMM
    on ``device``: ``torch.addmm(main_grad, a, b, out_dtype=torch.float32, out=main_grad)``
    (``aten::addmm.dtype_out``, a CUDA kernel of recent torch; absent on the CPU). Probed once
    per device on a tiny product, checked against the unfused sum, so a torch without the
    overload, without the kernel or with an ``out`` that may not alias ``self`` falls back."""
    if not _gpu_kernels(device) or not torch.cuda.is_available():
        return False
    try:
        mat1 = torch.arange(12, dtype=torch.bfloat16, device=device).reshape(3, 4) / 8
        mat2 = torch.arange(8, dtype=torch.bfloat16, device=device).reshape(4, 2) / 4
        acc = torch.ones(3, 2, dtype=torch.float32, device=device)
        expected = acc + mat1.float() @ mat2.float()
        torch.addmm(acc, mat1, mat2, out_dtype=torch.float32, out=acc)
        return bool(torch.allclose(acc, expected))
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def wgrad_accumulation_path(grad_dtype: torch.dtype, dtype: torch.dtype,
                            device: torch.device) -> str:
    """How :func:`accumulate_weight_grad_` adds ``grad_output^T @ inputs`` (``dtype`` on
    ``device``) into a ``main_grad`` of ``grad_dtype``:

    * ``"apex_fp32"`` / ``"apex_fp16"`` -- Apex's ``wgrad_gemm_accum_fp32`` for an fp32
      ``main_grad``, ``wgrad_gemm_accum_fp16`` for a 16-bit one (of the inputs' dtype): chosen by
      ``main_grad.dtype``, as Megatron does (fp16 inputs into fp32 gradients -- ``--fp16
      --accumulate-allreduce-grads-in-fp32`` -- take the fp32 kernel), half-precision CUDA
      inputs only;
    * ``"addmm"`` -- ``main_grad.addmm_`` when the dtypes agree (one GEMM with beta = 1);
    * ``"out_dtype"`` -- without Apex, half-precision inputs into an fp32 buffer through torch's
      ``addmm(..., out_dtype=torch.float32, out=main_grad)`` where it has that kernel
      (:func:`native_out_dtype_accumulation`);
    * ``"unfused"`` -- else the product, then the add."""
    if _gpu_kernels(device) and dtype in HALF_DTYPES and apex_wgrad_kernel() is not None:
        if grad_dtype == torch.float32:
            return "apex_fp32"
        if grad_dtype == dtype:
            return "apex_fp16"
    if grad_dtype == dtype:
        return "addmm"
    if (grad_dtype == torch.float32 and dtype in HALF_DTYPES
            and native_out_dtype_accumulation(device)):
        return "out_dtype"
    return "unfused"


def fusion_saves_work(device: torch.device, param_dtype: torch.dtype,
                      grad_dtype: torch.dtype) -> bool:
    """Whether gradient-accumulation fusion saves a kernel for parameters of ``param_dtype`` on
    ``device`` with a ``grad_dtype`` buffer: on CUDA, one ``addmm_`` into a ``main_grad`` of the
    parameters' dtype, or an fp32-accumulating GEMM for half-precision parameters into fp32
    gradients -- Apex's (as Megatron, whose fusion is that CUDA kernel) or torch's own
    ``out_dtype`` GEMM where it has one. Elsewhere -- the CPU, half precision without either --
    the fused backward would run the same product and add as the buffer's hook, only through a
    Python autograd function (host time at every linear)."""
    if not _gpu_kernels(device):
        return False
    if param_dtype == grad_dtype:
        return True
    return (grad_dtype == torch.float32 and param_dtype in HALF_DTYPES
            and (apex_wgrad_kernel() is not None or native_out_dtype_accumulation(device)))


def fuses_weight_grad(weight: nn.Parameter) -> bool:
    """True when ``weight``'s gradient is accumulated straight into its ``main_grad``."""
    return (getattr(weight, "fuse_wgrad_accumulation", False)
            and getattr(weight, "main_grad", None) is not None)


def accumulate_weight_grad_(weight: nn.Parameter, inputs: torch.Tensor,
                            grad_output: torch.Tensor) -> None:
    """``weight.main_grad += grad_output^T @ inputs`` without a separate gradient tensor where a
    kernel allows (:func:`wgrad_accumulation_path`)."""
    main_grad = weight.main_grad
    flat_in = inputs.reshape(-1, inputs.shape[-1])
    flat_grad = grad_output.reshape(-1, grad_output.shape[-1])
    path = wgrad_accumulation_path(main_grad.dtype, flat_in.dtype, flat_in.device)
    if path == "addmm":
        main_grad.addmm_(flat_grad.t(), flat_in)
    elif path == "out_dtype":
        torch.addmm(main_grad, flat_grad.t(), flat_in, out_dtype=torch.float32, out=main_grad)
    elif path == "unfused":
        main_grad.add_(flat_grad.t().matmul(flat_in))
    else:
        kernel = apex_wgrad_kernel()
        fused = (kernel.wgrad_gemm_accum_fp32 if path == "apex_fp32"
                 else kernel.wgrad_gemm_accum_fp16)
        fused(flat_in.contiguous(), flat_grad.contiguous(), main_grad)


def _accumulate(param: nn.Parameter, grad: torch.Tensor) -> None:
    """Add ``grad`` into the parameter's gradient buffer (``main_grad``, see
    :mod:`megatron_chimera.distributed.grad_buffer`) when it has one, else into ``.grad``."""
    main_grad = getattr(param, "main_grad", None)
    if main_grad is not None:
        main_grad.add_(grad)
        return
    grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


def _weight_grad_or_placeholder(weight: nn.Parameter, inputs: torch.Tensor,
                                grad_output: torch.Tensor) -> torch.Tensor:
    """The weight gradient for autograd, or -- with gradient-accumulation fusion -- the gradient
    already added to ``main_grad`` and a placeholder that the buffer's hook discards
    (``grad_added_to_main_grad``): uninitialised memory (no memset per parameter and
    micro-batch) when the weight has no ``.grad`` -- autograd then only stores it in ``.grad``
    and the hook drops it unread -- and zeros when it has one (a ``.grad`` an fp32 optimizer left
    aliasing ``main_grad``, which autograd adds the placeholder into)."""
    if not fuses_weight_grad(weight):
        return _weight_grad(inputs, grad_output)
    accumulate_weight_grad_(weight, inputs, grad_output)
    weight.grad_added_to_main_grad = True
    if weight.grad is None:
        return torch.empty_like(weight)
    return torch.zeros_like(weight)


class LinearWithDeferrableWeightGrad(torch.autograd.Function):
    """y = x W^T + b, with a backward that can hand the weight gradient to a WeightGradStore."""

    @staticmethod
    def forward(ctx, inputs, weight, bias, module, dgrad_group=None,  # type: ignore[override]
                sequence_parallel=False):
        # sequence parallel: the sequence chunks of the ranks gathered into the full input, of
        # which only this rank's chunk is kept for the backward (Megatron: it is gathered again
        # there, so the saved activation is [s/T, b, h], not [s, b, h])
        total = gather_along_first_dim(inputs) if sequence_parallel else inputs
        ctx.save_for_backward(inputs, weight)
        ctx.has_bias = bias is not None
        ctx.module = module
        ctx.dgrad_group = dgrad_group
        ctx.sequence_parallel = sequence_parallel
        return torch.nn.functional.linear(total, weight, bias)  # one addmm with a bias

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        inputs, weight = ctx.saved_tensors
        store: WeightGradStore | None = ctx.module.weight_grad_store
        wgrad_now = store is None and ctx.needs_input_grad[1]
        gathering = None
        if ctx.sequence_parallel and wgrad_now:
            # the full input again for the weight gradient, gathered while the input gradient
            # is computed (a deferred W gathers it itself, when it runs)
            inputs, gathering = gather_along_first_dim(inputs, async_op=True)
        grad_input = grad_output.matmul(weight) if ctx.needs_input_grad[0] else None
        if gathering is not None:
            gathering.wait()
        reducing = None
        if grad_input is not None and ctx.sequence_parallel:
            # sequence parallel: the input gradient is reduce-scattered back to this rank's
            # chunk while this rank computes (or queues) the weight gradient
            grad_input, reducing = reduce_scatter_along_first_dim(grad_input)
        elif grad_input is not None and ctx.dgrad_group is not None:
            # Megatron's async all-reduce: the input gradient travels over the tensor-parallel
            # group while this rank computes (or queues) the weight gradient
            reducing = dist.all_reduce(grad_input, group=ctx.dgrad_group, async_op=True)
        bias = ctx.module.bias if ctx.has_bias else None
        grad_weight = grad_bias = None
        if store is not None:
            store.put(ctx.module.weight, bias, inputs, grad_output,
                      sequence_sharded=ctx.sequence_parallel)
        else:
            if wgrad_now:
                grad_weight = _weight_grad_or_placeholder(ctx.module.weight, inputs,
                                                          grad_output)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                grad_bias = _bias_grad(grad_output)
        if reducing is not None:
            reducing.wait()
        return grad_input, grad_weight, grad_bias, None, None, None


class BiasAddWithDeferrableGrad(torch.autograd.Function):
    """y = x + b for a bias added after a tensor-parallel reduction (row-parallel layers): its
    gradient is deferred to the module's WeightGradStore like the weight's."""

    @staticmethod
    def forward(ctx, inputs, bias, module):  # type: ignore[override]
        ctx.module = module
        return inputs + bias

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        store: WeightGradStore | None = ctx.module.weight_grad_store
        if store is not None:
            store.put(None, ctx.module.bias, None, grad_output)
            return grad_output, None, None
        grad_bias = _bias_grad(grad_output) if ctx.needs_input_grad[1] else None
        return grad_output, grad_bias, None


def needs_deferrable_function(module: nn.Module) -> bool:
    """Whether ``module``'s forward must go through our autograd functions: its weight gradient
    may be deferred (a split-backward schedule, ``module.weight_grad_deferrable``) or is fused
    into ``main_grad`` -- and autograd is recording. Otherwise torch's own ``F.linear`` and ``+``
    give the same result at a fraction of the host cost (no Python in the backward)."""
    return _needs_function(module, module.weight)


def _needs_function(module: nn.Module, weight: nn.Parameter) -> bool:
    # (the common case, a layer that neither defers nor fuses, decided by the first operand)
    return (module.weight_grad_deferrable or fuses_weight_grad(weight)) and (
        torch.is_grad_enabled())


def bias_add_with_deferrable_grad(inputs: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """``inputs + module.bias`` with the bias gradient deferrable (split backward)."""
    if not needs_deferrable_function(module):
        return inputs + module.bias
    return BiasAddWithDeferrableGrad.apply(inputs, module.bias, module)


def linear_with_deferrable_weight_grad(inputs: torch.Tensor, module: nn.Module,
                                       bias: torch.Tensor | None,
                                       dgrad_group: dist.ProcessGroup | None = None,
                                       sequence_parallel: bool = False) -> torch.Tensor:
    """``inputs @ module.weight^T (+ bias)`` through :class:`LinearWithDeferrableWeightGrad`;
    ``bias`` must be ``module.bias`` or None (then the caller adds it). ``dgrad_group``: sum the
    input gradient over this group, asynchronously, overlapped with the weight gradient (a
    column-parallel layer's replicated input). ``sequence_parallel``: ``inputs`` is this
    rank's sequence chunk, all-gathered over the tensor-parallel group here; its gradient is
    reduce-scattered back, overlapped with the weight gradient the same way. Plain
    ``F.linear`` when none of that is needed (:func:`needs_deferrable_function`)."""
    weight = module.weight
    if sequence_parallel:
        return LinearWithDeferrableWeightGrad.apply(inputs, weight, bias, module, None, True)
    if dgrad_group is None and not _needs_function(module, weight):
        return torch.nn.functional.linear(inputs, weight, bias)
    return LinearWithDeferrableWeightGrad.apply(inputs, weight, bias, module, dgrad_group)


def set_weight_grad_deferral(modules: Sequence[nn.Module], deferrable: bool) -> None:
    """Whether the forwards of ``modules`` (:func:`deferrable_modules`) keep their weight
    gradients deferrable: on for a split-backward schedule, off (torch's native linear) for the
    others. New layers are deferrable, so a backward under :func:`defer_weight_grad` never
    meets a forward that cannot defer."""
    for module in modules:
        module.weight_grad_deferrable = deferrable


def deferrable_modules(module: nn.Module) -> list[nn.Module]:
    """The sub-modules of ``module`` whose weight gradient can be deferred (they own a
    ``weight_grad_store`` slot)."""
    return [m for m in module.modules() if hasattr(m, "weight_grad_store")]


@contextlib.contextmanager
def defer_weight_grad(module: nn.Module | Sequence[nn.Module],
                      store: WeightGradStore) -> Iterator[WeightGradStore]:
    """Within the block, backwards through ``module``'s deferrable linear layers (``Linear`` and
    the tensor-parallel linears) queue their weight gradients in ``store`` instead of computing
    them; run ``store.flush()`` later (the W action). A list of layers
    (:func:`deferrable_modules`, kept by a caller that defers every iteration) saves walking the
    module each time."""
    linears = deferrable_modules(module) if isinstance(module, nn.Module) else module
    refused = [type(m).__name__ for m in linears if not m.weight_grad_deferrable]
    if refused:
        raise RuntimeError(
            f"defer_weight_grad: {len(refused)} layer(s) ({refused[0]}, ...) ran their forward "
            "with deferral off (set_weight_grad_deferral(..., False)): their weight gradients "
            "are computed in the backward and cannot be deferred")
    for linear in linears:
        linear.weight_grad_store = store
    try:
        yield store
    finally:
        for linear in linears:
            linear.weight_grad_store = None
