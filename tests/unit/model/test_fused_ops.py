"""Fused-kernel dispatch (Apex vs torch-native) and numeric agreement of fused and unfused ops."""

from __future__ import annotations

import logging
import math
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from megatron_chimera.config import ConfigError
from megatron_chimera.model import fused
from megatron_chimera.model.fused import FusedBackend, LayerNorm, get_fused_backend
from megatron_chimera.optimizer import kernels


@pytest.fixture(autouse=True)
def fresh_backend_cache():
    get_fused_backend.cache_clear()
    yield
    get_fused_backend.cache_clear()


@pytest.fixture
def stand_in_apex(monkeypatch):
    """Inject a stand-in for NVIDIA Apex (its module names, recording calls) and pretend CUDA."""
    calls: list[str] = []

    def fused_layer_norm_affine(x, weight, bias, normalized_shape, eps):
        calls.append("layer_norm")
        return F.layer_norm(x, normalized_shape, weight, bias, eps)

    class FusedAdam(torch.optim.AdamW):
        def __init__(self, params, lr, betas, eps, weight_decay, adam_w_mode):
            assert adam_w_mode is True
            calls.append("adam")
            super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    def multi_tensor_applier(op, noop_flag, tensor_lists, *args):
        return op(4096, noop_flag, tensor_lists, *args)

    def multi_tensor_l2norm(chunk, flag, lists, per_tensor):
        calls.append("l2norm")
        norm = torch.linalg.vector_norm(torch.cat([t.float().flatten() for t in lists[0]]))
        return norm.reshape(1), None

    def multi_tensor_scale(chunk, flag, lists, scale):
        calls.append("scale")
        for src, dst in zip(*lists):
            dst.copy_(src * scale)

    modules = {
        "apex": types.ModuleType("apex"),
        "apex.normalization": types.ModuleType("apex.normalization"),
        "apex.normalization.fused_layer_norm": types.ModuleType("fused_layer_norm"),
        "apex.optimizers": types.ModuleType("apex.optimizers"),
        "apex.multi_tensor_apply": types.ModuleType("apex.multi_tensor_apply"),
        "amp_C": types.ModuleType("amp_C"),
    }
    modules["apex.normalization.fused_layer_norm"].fused_layer_norm_affine = fused_layer_norm_affine
    modules["apex.optimizers"].FusedAdam = FusedAdam
    modules["apex.multi_tensor_apply"].multi_tensor_applier = multi_tensor_applier
    modules["amp_C"].multi_tensor_l2norm = multi_tensor_l2norm
    modules["amp_C"].multi_tensor_scale = multi_tensor_scale
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return calls


def test_native_path_without_apex(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "amp_C", None)  # importing it raises ImportError
    with caplog.at_level(logging.INFO, logger="megatron_chimera.model.fused"):
        backend = get_fused_backend(None)
        assert get_fused_backend(None) is backend
    assert backend == FusedBackend(apex=False)
    assert [r.getMessage() for r in caplog.records] == [
        "fused kernels: native (NVIDIA Apex not importable)"]


def test_use_apex_true_without_apex_is_an_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "amp_C", None)
    with pytest.raises(ConfigError, match="--use-apex"):
        get_fused_backend(True)


def test_apex_path_with_stand_in(stand_in_apex, caplog):
    with caplog.at_level(logging.INFO, logger="megatron_chimera.model.fused"):
        backend = get_fused_backend(None)
    assert backend.apex and "NVIDIA Apex found" in caplog.text
    norm = LayerNorm(8, 1e-5, backend)
    x = torch.randn(3, 8)
    torch.testing.assert_close(norm(x), F.layer_norm(x, (8,), eps=1e-5))
    param = torch.nn.Parameter(torch.ones(4))
    adam = kernels.build_adam([{"params": [param]}], 1e-3, (0.9, 0.999), 1e-8, 0.0, backend)
    assert type(adam).__name__ == "FusedAdam"
    tensors = [torch.full((3,), 2.0), torch.full((1,), 2.0)]
    assert kernels.multi_tensor_l2norm(tensors, backend).item() == pytest.approx(4.0)
    targets = [torch.zeros(3), torch.zeros(1)]
    kernels.multi_tensor_scale_(tensors, targets, 0.5, backend)
    assert all(torch.all(t == 1.0) for t in targets)
    assert stand_in_apex == ["layer_norm", "adam", "l2norm", "scale"]


def test_no_apex_flag_overrides_detection(stand_in_apex):
    backend = get_fused_backend(False)
    assert not backend.apex
    LayerNorm(8, 1e-5, backend)(torch.randn(2, 8))
    assert stand_in_apex == []


def test_native_multi_tensor_ops_and_adam():
    backend = FusedBackend(apex=False)
    tensors = [torch.tensor([3.0, 0.0]), torch.tensor([4.0])]
    assert kernels.multi_tensor_l2norm(tensors, backend).item() == pytest.approx(5.0)
    targets = [torch.zeros(2, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.bfloat16)]
    kernels.multi_tensor_scale_(tensors, targets, 2.0, backend)
    assert targets[1].item() == 8.0 and targets[1].dtype == torch.bfloat16
    adam = kernels.build_adam([{"params": [torch.nn.Parameter(torch.ones(2))]}], 1e-3,
                            (0.9, 0.999), 1e-8, 0.1, backend)
    assert isinstance(adam, torch.optim.AdamW) and adam.defaults["foreach"]


# ----------------------------------------------------------------------------- numerics
def naive_attention(q, k, v, forbidden):
    """Textbook softmax(QK^T / sqrt(d)) V with -inf masking."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(forbidden, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("fused_path", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_matches_textbook(fused_path, causal):
    g = torch.Generator().manual_seed(0)
    b, heads, s, d = 2, 3, 7, 8
    q, k, v = (torch.randn(b, heads, s, d, generator=g, dtype=torch.float64) for _ in range(3))
    padding = torch.zeros(b, 1, 1, s, dtype=torch.bool)
    padding[1, ..., 5:] = True  # the second sample's last two keys are padding
    forbidden = padding | (torch.ones(s, s).triu(1).bool() if causal else False)
    out = fused.attention(q, k, v, padding, causal, 0.0, training=False, fused=fused_path)
    torch.testing.assert_close(out, naive_attention(q, k, v, forbidden), rtol=1e-10, atol=1e-10)


def test_query_key_layer_scaling_is_a_numerical_no_op():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 5, 4, generator=g) for _ in range(3))
    plain = fused.attention(q, k, v, None, True, 0.0, False, fused=False)
    scaled = fused.attention(q, k, v, None, True, 0.0, False, fused=False,
                             softmax_in_fp32=True, layer_scale=7.0)
    torch.testing.assert_close(plain, scaled, rtol=1e-6, atol=1e-6)


def test_gelu_fused_and_unfused_agree_with_erf_gelu():
    x = torch.linspace(-6, 6, 1001, dtype=torch.float64, requires_grad=True)
    fused_out = fused.gelu(x, fused=True)
    unfused_out = fused.gelu(x, fused=False)
    torch.testing.assert_close(fused_out, unfused_out, rtol=1e-12, atol=1e-12)
    # the tanh approximation stays within 1e-3 of the exact (erf) GeLU
    assert (fused_out - F.gelu(x)).abs().max().item() < 1e-3
    (g_fused,) = torch.autograd.grad(fused_out.sum(), x)
    (g_unfused,) = torch.autograd.grad(unfused_out.sum(), x)
    torch.testing.assert_close(g_fused, g_unfused, rtol=1e-10, atol=1e-10)


def test_bias_dropout_add():
    x, bias, residual = torch.randn(4, 6), torch.randn(6), torch.randn(4, 6)
    torch.testing.assert_close(fused.bias_dropout_add(x, bias, residual, 0.5, training=False),
                               residual + x + bias)
    torch.manual_seed(0)
    out = fused.bias_dropout_add(x, None, residual, 0.5, training=True)
    kept = (out - residual) != 0
    torch.testing.assert_close((out - residual)[kept], (2 * x)[kept])
    assert 0 < kept.float().mean().item() < 1


def test_layer_norm_matches_formula():
    norm = LayerNorm(16, 1e-5, FusedBackend(apex=False))
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-1, 1)
    x = torch.randn(5, 16)
    mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    expected = (x - mean) / torch.sqrt(var + 1e-5) * norm.weight + norm.bias
    torch.testing.assert_close(norm(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_bias", [False, True])
def test_compiled_bias_dropout_add_is_the_eager_one_traced_whole(with_bias):
    """The closure ``torch.compile`` fuses on CUDA (``--bias-dropout-fusion``) traces without a
    graph break (``fullgraph``) to the same graph: run by ``aot_eager`` on the CPU -- eager
    kernels, so the same generator draws the same mask -- output and gradients are bitwise the
    eager function's (inductor's CUDA kernel then differs only in its random stream)."""
    compiled = fused.compiled_bias_dropout_add("aot_eager")
    g = torch.Generator().manual_seed(1)
    x, residual = (torch.randn(4, 3, 6, generator=g, requires_grad=True) for _ in range(2))
    bias = torch.randn(6, generator=g, requires_grad=True) if with_bias else None
    outputs = []
    for function in (compiled, lambda *a: fused.bias_dropout_add(*a, training=True)):
        torch.manual_seed(5)
        outputs.append(function(x, bias, residual, 0.3))
    assert torch.equal(outputs[0], outputs[1])
    assert 0 < (outputs[0] == residual).float().mean().item() < 1  # dropout did drop
    inputs = [t for t in (x, residual, bias) if t is not None]
    grads = [torch.autograd.grad(out.square().sum(), inputs) for out in outputs]
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def _failing_compiler(gm, example_inputs):  # noqa: ARG001 - a torch.compile backend
    raise RuntimeError("Cannot find a working triton installation (simulated)")


def _failing_backward_compiler():
    """A backend whose forward compiles and whose backward (compiled lazily, at the first
    backward) fails: only a probe that runs a backward sees it."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    return aot_autograd(fw_compiler=lambda gm, _inputs: make_boxed_func(gm.forward),
                        bw_compiler=_failing_compiler)


@pytest.fixture
def fresh_compiler_state(monkeypatch):
    """No compiler verdicts or notices from earlier tests."""
    monkeypatch.setattr(fused, "_COMPILER_FAILED", set())
    monkeypatch.setattr(fused, "_PROBED", {})
    monkeypatch.setattr(fused, "_NOTICES", set())


def _bias_dropout_add_twice(fused_on: bool):
    """Two training calls (seed 5 before each), their outputs and input gradients."""
    g = torch.Generator().manual_seed(1)
    x, residual = (torch.randn(4, 3, 6, generator=g, requires_grad=True) for _ in range(2))
    bias = torch.randn(6, generator=g, requires_grad=True)
    results = []
    for _ in range(2):
        torch.manual_seed(5)
        out = fused.bias_dropout_add(x, bias, residual, 0.3, training=True, fused=fused_on)
        results.append((out, torch.autograd.grad(out.square().sum(), (x, residual, bias))))
    return results


@pytest.mark.parametrize("broken", ["forward", "backward"])
def test_bias_dropout_fusion_falls_back_to_eager_with_one_warning(broken, monkeypatch, caplog,
                                                                  fresh_compiler_state):
    """Where the compiler cannot run (simulated: a backend that raises as inductor does without
    Triton, in the forward compile or in the lazily compiled backward), the fused path runs the
    eager ops -- the same outputs and gradients as the unfused call, the probe drawing nothing
    from the generator -- after exactly one warning naming the way out."""
    backend = _failing_compiler if broken == "forward" else _failing_backward_compiler()
    monkeypatch.setattr(fused, "BIAS_DROPOUT_ADD_BACKEND", backend)
    with caplog.at_level(logging.WARNING, logger=fused.__name__):
        fallback = _bias_dropout_add_twice(fused_on=True)
    eager = _bias_dropout_add_twice(fused_on=False)
    for (out, grads), (want, want_grads) in zip(fallback, eager):
        assert torch.equal(out, want)
        assert all(torch.equal(a, b) for a, b in zip(grads, want_grads))
    warnings_ = [r.getMessage() for r in caplog.records if "torch.compile" in r.getMessage()]
    assert len(warnings_) == 1, warnings_
    assert "cannot run on this node" in warnings_[0] and "--no-bias-dropout-fusion" in warnings_[0]
    assert "triton" in warnings_[0]


def test_bias_dropout_fusion_uses_the_compiler_where_it_runs(monkeypatch, caplog,
                                                             fresh_compiler_state):
    """A working backend (``aot_eager``: eager kernels, so the same mask) is probed once and
    used: no warning, and the probe leaves the generator as it was (same mask as eager)."""
    monkeypatch.setattr(fused, "BIAS_DROPOUT_ADD_BACKEND", "aot_eager")
    with caplog.at_level(logging.WARNING, logger=fused.__name__):
        compiled = _bias_dropout_add_twice(fused_on=True)
    assert fused._PROBED == {("aot_eager", "cpu", torch.float32): True}
    for (out, grads), (want, want_grads) in zip(compiled, _bias_dropout_add_twice(False)):
        assert torch.equal(out, want)
        assert all(torch.equal(a, b) for a, b in zip(grads, want_grads))
    assert not [r for r in caplog.records if "torch.compile" in r.getMessage()]


def test_no_bias_dropout_fusion_never_compiles(monkeypatch, fresh_compiler_state):
    """``--no-bias-dropout-fusion`` (``fused=False``; the layer passes its config's
    ``bias_dropout_fusion``) neither probes nor compiles."""
    monkeypatch.setattr(fused, "BIAS_DROPOUT_ADD_BACKEND", _failing_compiler)
    _bias_dropout_add_twice(fused_on=False)
    assert fused._PROBED == {} and fused._COMPILER_FAILED == set()
    from megatron_chimera.training.arguments import parse_args  # noqa: PLC0415

    base = ("--num-layers 2 --hidden-size 64 --num-attention-heads 8 --seq-length 16 "
            "--micro-batch-size 2 --lr 1e-3 --train-iters 2 --mock-data --vocab-size 100").split()
    assert parse_args(base, world_size=1).model.bias_dropout_fusion is True
    assert parse_args([*base, "--no-bias-dropout-fusion"],
                      world_size=1).model.bias_dropout_fusion is False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_function_is_autograds_composition_saving_its_input_only(dtype):
    """``fused.swiglu`` (eager) gives bitwise the output and input gradient autograd computes
    for ``silu(gate) * up``, and saves only ``[gate | up]`` (autograd's composition also keeps
    ``silu(gate)``: 1.5x the bytes)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 2, 16, generator=g).to(dtype).requires_grad_()
    grad = torch.randn(3, 2, 8, generator=g).to(dtype)

    def run(function):
        saved = {}  # storage -> bytes

        def pack(t):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = function(x)
        return out, torch.autograd.grad(out, x, grad)[0], sum(saved.values())

    def composition(t):
        gate, up = t.chunk(2, dim=-1)
        return F.silu(gate) * up

    out, dx, saved = run(fused.swiglu)
    want, want_dx, want_saved = run(composition)
    assert torch.equal(out, want) and torch.equal(dx, want_dx)
    assert saved == x.numel() * x.element_size() and want_saved == 1.5 * saved


def test_swiglu_and_rope_compiled_are_the_eager_kernels_traced_whole(monkeypatch,
                                                                     fresh_compiler_state):
    """The compiled element-wise path (CUDA with ``--bias-dropout-fusion``: inductor fuses each
    into one kernel) traces SwiGLU's forward and backward and RoPE's rotation without a graph
    break; run by ``aot_eager`` on the CPU (eager kernels) the results are bitwise the eager
    path's, and a compiler that fails falls back to them."""
    from megatron_chimera.model.rotary import RotaryTables, rotate_sequence_first

    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 2, 12, generator=g, requires_grad=True)
    qk = torch.randn(5, 2, 3, 2, 8, generator=g, requires_grad=True)  # [s, b, groups, q+k, d]
    angles = torch.randn(5, 4, generator=g).repeat(1, 2)
    sin = angles.sin()
    tables = RotaryTables(angles.cos(), sin, torch.cat((-sin[:, :4], sin[:, 4:]), -1))

    def results(fused_on):
        out = (fused.swiglu(x, fused=fused_on), rotate_sequence_first(qk, tables, fused_on))
        grads = torch.autograd.grad([o.square().sum() for o in out], (x, qk))
        return (*out, *grads)

    eager = results(False)
    for backend in ("aot_eager", _failing_compiler):
        monkeypatch.setattr(fused, "BIAS_DROPOUT_ADD_BACKEND", backend)
        fused._PROBED[(backend, "cpu", torch.float32)] = True  # (the probe is tested above)
        got = results(True)
        assert all(torch.equal(a, b) for a, b in zip(got, eager)), backend
    assert fused._COMPILER_FAILED == {_failing_compiler}  # eager from its first failure on
