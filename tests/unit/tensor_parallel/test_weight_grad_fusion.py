"""Gradient-accumulation fusion: which kernel adds the weight gradient into ``main_grad``.

Apex's kernel is chosen by ``main_grad``'s dtype (Megatron's rule: fp32 buffer ->
``wgrad_gemm_accum_fp32``, 16-bit -> ``wgrad_gemm_accum_fp16``), checked on the CPU with a stand-in
extension that records the call and does the math; torch's native ``out_dtype`` GEMM is a CUDA
kernel, so its numerics against the unfused product-then-add run where CUDA is present.
"""

import types

import pytest
import torch
from torch import nn

from megatron_chimera.tensor_parallel import weight_grad
from megatron_chimera.tensor_parallel.weight_grad import (
    accumulate_weight_grad_,
    fusion_saves_work,
    wgrad_accumulation_path,
)


@pytest.fixture
def stand_in_apex(monkeypatch):
    """A fake ``fused_weight_gradient_mlp_cuda`` (fp32 math, recording the kernel's name) and
    CPU tensors treated as the GPU's, so the CPU walks the CUDA selection."""
    calls: list[str] = []

    def kernel(name):
        def run(inputs, grad_output, main_grad):
            calls.append(name)
            main_grad.add_((grad_output.t().float() @ inputs.float()).to(main_grad.dtype))
        return run

    fake = types.SimpleNamespace(wgrad_gemm_accum_fp32=kernel("fp32"),
                                 wgrad_gemm_accum_fp16=kernel("fp16"))
    monkeypatch.setattr(weight_grad, "apex_wgrad_kernel", lambda: fake)
    monkeypatch.setattr(weight_grad, "_gpu_kernels", lambda device: True)
    monkeypatch.setattr(weight_grad, "native_out_dtype_accumulation", lambda device: False)
    return calls


def _weight(dtype, grad_dtype):
    weight = nn.Parameter(torch.zeros(6, 4, dtype=dtype))
    weight.main_grad = torch.zeros(6, 4, dtype=grad_dtype)
    weight.fuse_wgrad_accumulation = True
    return weight


@pytest.mark.parametrize("dtype,grad_dtype,kernel", [
    (torch.float16, torch.float32, "fp32"),  # --fp16 --accumulate-allreduce-grads-in-fp32
    (torch.bfloat16, torch.float32, "fp32"),
    (torch.float16, torch.float16, "fp16"),
    (torch.bfloat16, torch.bfloat16, "fp16"),
])
def test_apex_kernel_is_chosen_by_the_main_grad_dtype(stand_in_apex, dtype, grad_dtype, kernel):
    weight = _weight(dtype, grad_dtype)
    torch.manual_seed(0)
    inputs, grad_output = torch.randn(3, 5, 4).to(dtype), torch.randn(3, 5, 6).to(dtype)
    accumulate_weight_grad_(weight, inputs, grad_output)
    assert stand_in_apex == [kernel]
    expected = grad_output.reshape(-1, 6).t().float() @ inputs.reshape(-1, 4).float()
    torch.testing.assert_close(weight.main_grad.float(), expected,
                               rtol=0, atol=0 if grad_dtype == torch.float32 else 0.1)


def test_selection_without_apex(monkeypatch):
    monkeypatch.setattr(weight_grad, "apex_wgrad_kernel", lambda: None)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(weight_grad, "native_out_dtype_accumulation", lambda device: True)
    assert wgrad_accumulation_path(torch.float32, torch.bfloat16, cuda) == "out_dtype"
    assert wgrad_accumulation_path(torch.bfloat16, torch.bfloat16, cuda) == "addmm"
    assert fusion_saves_work(cuda, torch.bfloat16, torch.float32)
    monkeypatch.setattr(weight_grad, "native_out_dtype_accumulation", lambda device: False)
    assert wgrad_accumulation_path(torch.float32, torch.bfloat16, cuda) == "unfused"
    assert not fusion_saves_work(cuda, torch.bfloat16, torch.float32)
    assert wgrad_accumulation_path(torch.float32, torch.float32, cpu) == "addmm"
    assert not fusion_saves_work(cpu, torch.float32, torch.float32)


def test_the_cpu_has_no_native_out_dtype_accumulation():
    # torch's addmm.dtype_out is a CUDA kernel: the probe must say no rather than fail later
    weight_grad.native_out_dtype_accumulation.cache_clear()
    assert not weight_grad.native_out_dtype_accumulation(torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's out_dtype GEMM is CUDA's")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_native_out_dtype_path_matches_the_unfused_sum(dtype):
    if not weight_grad.native_out_dtype_accumulation(torch.device("cuda")):
        pytest.skip("this torch has no addmm(out_dtype=float32) on CUDA")
    torch.manual_seed(0)
    weight = nn.Parameter(torch.zeros(64, 128, dtype=dtype, device="cuda"))
    weight.main_grad = torch.randn(64, 128, device="cuda")
    inputs = torch.randn(256, 128, device="cuda").to(dtype)
    grad_output = torch.randn(256, 64, device="cuda").to(dtype)
    expected = weight.main_grad + grad_output.t().float() @ inputs.float()
    assert wgrad_accumulation_path(torch.float32, dtype, inputs.device) == "out_dtype"
    accumulate_weight_grad_(weight, inputs, grad_output)
    # both accumulate the 256-term products in fp32 (the unfused one from 16-bit operands cast
    # exactly to fp32): only summation order differs, ~sqrt(256) * 2^-24 * |terms| ~ 1e-5 of 16
    torch.testing.assert_close(weight.main_grad, expected, rtol=1e-4, atol=1e-3)


def test_placeholder_is_uninitialised_only_when_nothing_reads_it():
    weight = _weight(torch.float32, torch.float32)
    inputs, grad_output = torch.randn(5, 4), torch.randn(5, 6)
    first = weight_grad._weight_grad_or_placeholder(weight, inputs, grad_output)
    assert weight.grad_added_to_main_grad
    weight.grad = weight.main_grad  # an fp32 optimizer's aliasing .grad: autograd adds into it
    second = weight_grad._weight_grad_or_placeholder(weight, inputs, grad_output)
    assert first.shape == second.shape == weight.shape
    assert torch.count_nonzero(second) == 0
    torch.testing.assert_close(weight.main_grad, 2 * grad_output.t() @ inputs)
