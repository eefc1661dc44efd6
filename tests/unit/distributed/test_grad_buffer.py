"""Gradient buffers: layout, buckets, shards, ``main_grad`` accumulation and its precision."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron_chimera.distributed.grad_buffer import (
    SHARD_ALIGNMENT,
    GradBuffer,
    ShardGroup,
    build_grad_buffers,
    plan_layout,
)
from megatron_chimera.optimizer.distributed_optimizer import _fragments_of


@pytest.mark.parametrize("bucket_size", [None, 1, 50, 120, 10_000])
@pytest.mark.parametrize("shard_count", [1, 2, 3, 8])
def test_layout_covers_every_parameter_once_in_reverse_order(bucket_size, shard_count):
    numels = [64, 8, 64, 8, 100, 3]
    layout = plan_layout(numels, bucket_size, shard_count)
    # reverse registration order: the last parameter first (backward finalises it first)
    starts = [layout.ranges[i][0] for i in reversed(range(len(numels)))]
    assert starts == sorted(starts)
    for i, (lo, hi) in enumerate(layout.ranges):
        assert hi - lo == numels[i]
        assert sum(i in b.param_indices for b in layout.buckets) == 1
        bucket = layout.bucket_of(i)
        assert bucket.start <= lo and hi <= bucket.end
    # buckets tile the buffer; each is padded for the shards (aligned), unpadded otherwise
    assert layout.buckets[0].start == 0 and layout.buckets[-1].end == layout.numel
    for before, after in zip(layout.buckets, layout.buckets[1:]):
        assert before.end == after.start
    for bucket in layout.buckets:
        held = sum(numels[i] for i in bucket.param_indices)
        if shard_count == 1:
            assert bucket.numel == held
        else:
            assert bucket.numel % (shard_count * SHARD_ALIGNMENT) == 0
            assert held <= bucket.numel < held + shard_count * SHARD_ALIGNMENT
        if bucket_size is not None:  # closed as soon as it reaches the size
            assert held - numels[bucket.param_indices[-1]] < bucket_size
    if bucket_size is None:
        assert len(layout.buckets) == 1


def test_shards_partition_each_bucket():
    layout = plan_layout([300, 5, 70], 100, shard_count=4)
    for bucket in layout.buckets:
        pieces = [bucket.shard(4, r) for r in range(4)]
        assert pieces[0][0] == bucket.start and pieces[-1][1] == bucket.end
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
        assert len({hi - lo for lo, hi in pieces}) == 1


def test_fragments_of_all_shard_ranks_cover_each_parameter_exactly_once():
    params = [nn.Parameter(torch.randn(n)) for n in (300, 5, 70, 1)]
    buffer = GradBuffer(params, torch.float32, bucket_size=100, shard_count=3)
    covered = {i: torch.zeros(p.numel(), dtype=torch.int32) for i, p in enumerate(params)}
    for rank in range(3):
        for param, lo, hi, offset in _fragments_of(buffer, ShardGroup(None, 3, rank)):
            assert buffer.range_of(param)[0] + offset == lo
            covered[buffer.index_of(param)][offset:offset + hi - lo] += 1
    assert all(bool((c == 1).all()) for c in covered.values())


def test_param_buffer_keeps_values_and_aliases_parameters():
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(5))]
    values = [p.detach().clone() for p in params]
    buffer = GradBuffer(params, torch.float32, shard_count=2, param_buffer=True)
    for p, v in zip(params, values):
        assert torch.equal(p, v)
        lo, hi = buffer.range_of(p)
        assert p.data_ptr() == buffer.param_data[lo:hi].data_ptr()
        assert p.main_grad.data_ptr() == buffer.grad_data[lo:hi].data_ptr()
    buffer.param_data.fill_(2.0)
    assert all(bool((p == 2.0).all()) for p in params)


class _Tied(nn.Module):
    """Two stages' worth of a tied embedding: a stage module exposing its shared weight."""

    def __init__(self, shared: nn.Parameter | None) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.word = shared if shared is not None else nn.Parameter(torch.randn(7, 3))

    def shared_embedding_or_output_weight(self) -> nn.Parameter:
        return self.word


def _no_second_copy(param: nn.Parameter) -> bool:
    """``.grad`` freed, or pointing at ``main_grad`` (autograd then adds into the buffer)."""
    return param.grad is None or param.grad.data_ptr() == param.main_grad.data_ptr()


def test_hooks_accumulate_into_main_grad_and_free_grad():
    first, last = _Tied(None), _Tied(None)  # two distinct copies on one rank
    buffers = build_grad_buffers({0: first, 3: last}, grad_reduce_in_fp32=True)
    assert buffers.tied_stages == {0, 3}
    assert first.word.main_grad.data_ptr() == last.word.main_grad.data_ptr()
    x = torch.randn(2, 3)
    for _ in range(3):
        (first.linear(x).sum() + (first.word * 2).sum() + (last.word * 3).sum()).backward()
    assert _no_second_copy(first.linear.weight) and _no_second_copy(first.word)
    assert torch.allclose(first.linear.bias.main_grad, torch.full((3,), 6.0))
    # both copies' gradients land in the one shared buffer: 3 x (2 + 3)
    assert torch.allclose(first.word.main_grad, torch.full((7, 3), 15.0))
    buffers.zero_()
    assert float(first.word.main_grad.abs().sum()) == 0.0
    buffers.remove_hooks()


@pytest.mark.parametrize("microbatches", [32])
def test_fp32_buffers_sum_bf16_gradients_exactly_where_bf16_accumulation_drifts(microbatches):
    """Megatron's reason for fp32 accumulation with --bf16: N per-micro-batch bf16 gradients
    summed in a bf16 buffer lose ~6e-3 (relative L2 at N=32) against an fp64 sum of the same
    gradients; an fp32 buffer stays within 1e-6."""
    torch.manual_seed(0)
    grads = [torch.randn(4096).to(torch.bfloat16) for _ in range(microbatches)]
    exact = torch.stack([g.double() for g in grads]).sum(0)

    def accumulate(grad_reduce_in_fp32: bool) -> torch.Tensor:
        param = nn.Parameter(torch.zeros(4096, dtype=torch.bfloat16))
        module = nn.Module()
        module.param = param
        buffers = build_grad_buffers({0: module}, grad_reduce_in_fp32)
        for grad in grads:
            (param * grad).sum().backward()  # d/dparam = grad, exactly
        buffers.remove_hooks()
        return param.main_grad.double()

    def relative(result: torch.Tensor) -> float:
        return float((result - exact).norm() / exact.norm())

    fp32_error, bf16_error = relative(accumulate(True)), relative(accumulate(False))
    assert fp32_error <= 1e-6, fp32_error
    assert bf16_error > 1e-3, bf16_error  # the measurement can tell them apart
    print(f"N={microbatches}: fp32 buffer {fp32_error:.1e}, bf16 buffer {bf16_error:.1e}")


@pytest.mark.parametrize("dtype,flag,expected", [
    (torch.float32, False, torch.float32), (torch.float32, True, torch.float32),
    (torch.bfloat16, False, torch.bfloat16), (torch.bfloat16, True, torch.float32),
    (torch.float16, True, torch.float32),
])
def test_buffer_dtype_follows_the_fp32_flag_for_16_bit_models_only(dtype, flag, expected):
    module = nn.Linear(3, 3, dtype=dtype)
    buffers = build_grad_buffers({0: module}, grad_reduce_in_fp32=flag)
    assert buffers.stages[0][0].grad_data.dtype == expected
    assert module.weight.main_grad.dtype == expected
    buffers.remove_hooks()


def test_a_grad_left_pointing_at_the_buffer_is_not_counted_twice():
    """fp32 optimizers hand ``main_grad`` to ``param.grad``; if it is still set at the next
    backward, autograd adds into the buffer in place and the hook must not add it again."""
    module = nn.Linear(2, 2)
    buffers = build_grad_buffers({0: module}, grad_reduce_in_fp32=True)
    x = torch.ones(1, 2)
    module(x).sum().backward()
    module.weight.grad = module.weight.main_grad  # as FP32Optimizer leaves it
    module(x).sum().backward()
    assert torch.equal(module.weight.main_grad, torch.full((2, 2), 2.0))
    assert _no_second_copy(module.weight)
    buffers.remove_hooks()


def test_a_16_bit_parameter_into_fp32_gradients_drops_its_grad_each_time():
    """Only a buffer of the parameter's own dtype can be autograd's accumulation target."""
    module = nn.Linear(2, 2).to(torch.bfloat16)
    buffers = build_grad_buffers({0: module}, grad_reduce_in_fp32=True)
    x = torch.ones(1, 2, dtype=torch.bfloat16)
    for step in range(3):
        module(x).sum().backward()
        assert module.weight.grad is None
        assert torch.equal(module.weight.main_grad, torch.full((2, 2), float(step + 1)))
    buffers.remove_hooks()


def test_micro_batches_accumulate_in_place_into_the_buffer():
    """After the first micro-batch ``.grad`` is ``main_grad`` itself: autograd adds the next ones
    there (the hook adds nothing more), and clearing ``.grad`` (``zero_grad``) starts over."""
    module = nn.Linear(2, 2)
    buffers = build_grad_buffers({0: module}, grad_reduce_in_fp32=False)
    x = torch.ones(1, 2)
    for step in range(3):
        module(x).sum().backward()
        assert module.weight.grad.data_ptr() == module.weight.main_grad.data_ptr()
        assert torch.equal(module.weight.main_grad, torch.full((2, 2), float(step + 1)))
    module.weight.grad = None
    buffers.zero_()
    module(x).sum().backward()
    assert torch.equal(module.weight.main_grad, torch.ones(2, 2))
    buffers.remove_hooks()


class _TwoLinears(nn.Module):
    """Two deferrable linears (the project's ``Linear`` and a T = 1 column-parallel one)."""

    def __init__(self, dtype: torch.dtype) -> None:
        from megatron_chimera.model.linear import Linear
        from megatron_chimera.tensor_parallel import ColumnParallelLinear

        super().__init__()
        torch.manual_seed(0)
        self.first = Linear(6, 8, dtype=dtype)
        self.second = ColumnParallelLinear(8, 5, dtype=dtype)
        with torch.no_grad():
            self.second.weight.copy_(torch.randn(5, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))[0]


def _accumulated_grads(dtype: torch.dtype, fused: bool, deferred: bool,
                       optimizer_alias: bool = False) -> dict[str, torch.Tensor]:
    from megatron_chimera.tensor_parallel.weight_grad import WeightGradStore, defer_weight_grad

    module = _TwoLinears(dtype)
    buffers = build_grad_buffers({0: module}, grad_reduce_in_fp32=True,
                                 fuse_wgrad_accumulation=fused)
    for step in range(3):
        x = torch.randn(4, 2, 6, generator=torch.Generator().manual_seed(step)).to(dtype)
        if optimizer_alias:  # as FP32Optimizer leaves it between iterations
            for p in module.parameters():
                p.grad = p.main_grad
        if deferred:
            store = WeightGradStore()
            with defer_weight_grad(module, store):
                module(x).float().square().sum().backward()
            store.flush()
        else:
            module(x).float().square().sum().backward()
    buffers.remove_hooks()
    return {name: p.main_grad.clone() for name, p in module.named_parameters()}


@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradient_accumulation_fusion_equals_the_hook_path(dtype, deferred):
    """Weight gradients computed straight into ``main_grad`` (``addmm_``, or product + add for
    bf16 into an fp32 buffer without Apex) equal the hook's materialise-then-add, over three
    accumulated micro-batches, for the immediate backward and the deferred W. fp32: one
    rounding order apart (rtol 1e-5); bf16: identical arithmetic on the CPU path."""
    fused = _accumulated_grads(dtype, fused=True, deferred=deferred)
    reference = _accumulated_grads(dtype, fused=False, deferred=deferred)
    assert fused.keys() == reference.keys()
    for name in reference:
        assert reference[name].abs().sum() > 0, name
        torch.testing.assert_close(fused[name], reference[name], rtol=1e-5, atol=1e-6, msg=name)


def test_gradient_accumulation_fusion_marks_weights_and_skips_the_hook_add():
    """The buffer marks its parameters, the backward sets ``grad_added_to_main_grad`` and the
    hook resets it without adding the placeholder; a ``.grad`` left aliasing ``main_grad`` (the
    fp32 optimizer's) is not counted twice."""
    module = _TwoLinears(torch.float32)
    buffers = build_grad_buffers({0: module}, grad_reduce_in_fp32=False,
                                 fuse_wgrad_accumulation=True)
    assert module.first.weight.fuse_wgrad_accumulation
    module(torch.randn(3, 6)).sum().backward()
    assert module.first.weight.grad is None
    assert not module.first.weight.grad_added_to_main_grad
    buffers.remove_hooks()
    aliased = _accumulated_grads(torch.float32, fused=True, deferred=False, optimizer_alias=True)
    plain = _accumulated_grads(torch.float32, fused=False, deferred=False)
    for name in plain:
        torch.testing.assert_close(aliased[name], plain[name], rtol=1e-5, atol=1e-6, msg=name)


def test_gradient_accumulation_fusion_is_used_where_it_saves_a_kernel():
    """CUDA with the parameters' dtype (one addmm_) or an fp32-accumulating GEMM (Apex's, or
    torch's ``out_dtype`` one); not the CPU, nor half precision without either (the same
    product and add as the hook, with a Python autograd function's host cost at every
    linear)."""
    from megatron_chimera.tensor_parallel import weight_grad

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert weight_grad.fusion_saves_work(cuda, torch.float32, torch.float32)
    assert weight_grad.fusion_saves_work(cuda, torch.bfloat16, torch.bfloat16)
    assert not weight_grad.fusion_saves_work(cpu, torch.float32, torch.float32)
    if (weight_grad.apex_wgrad_kernel() is None
            and not weight_grad.native_out_dtype_accumulation(cuda)):
        assert not weight_grad.fusion_saves_work(cuda, torch.bfloat16, torch.float32)
    from megatron_chimera.config import DDPConfig
    from megatron_chimera.distributed import data_parallel

    modules = {0: nn.Linear(3, 3)}  # CPU parameters: the flag's default leaves them unmarked
    assert not data_parallel._fuses_weight_grads(DDPConfig(), modules)
    assert not data_parallel._fuses_weight_grads(
        DDPConfig(gradient_accumulation_fusion=False), modules)
