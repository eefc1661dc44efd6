"""The deferrable Linear: same results as nn.Linear; deferred W equals immediate grads."""

import pytest
import torch
from torch import nn

from megatron_chimera.model.linear import Linear, WeightGradStore, defer_weight_grad
from megatron_chimera.tensor_parallel.weight_grad import set_weight_grad_deferral


def _pair(seed: int = 0) -> tuple[nn.Sequential, nn.Sequential]:
    torch.manual_seed(seed)
    ref = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    ours = nn.Sequential(Linear(8, 16), nn.GELU(), Linear(16, 4, bias=False))
    with torch.no_grad():
        ours[0].weight.copy_(ref[0].weight)
        ours[0].bias.copy_(ref[0].bias)
        ours[2].weight.copy_(ref[2].weight)
        ref[2].bias.zero_()
    return ref, ours


def test_matches_nn_linear_forward_and_backward():
    ref, ours = _pair()
    x = torch.randn(5, 3, 8, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    ref(x).square().sum().backward()
    ours(x2).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ref[0].weight.grad, ours[0].weight.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ref[0].bias.grad, ours[0].bias.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ref[2].weight.grad, ours[2].weight.grad, rtol=1e-6, atol=1e-6)


def test_deferred_weight_grad_equals_immediate_and_accumulates():
    _, immediate = _pair(1)
    _, deferred = _pair(1)
    inputs = [torch.randn(4, 2, 8) for _ in range(3)]
    for x in inputs:
        immediate(x).square().sum().backward()
    stores = []
    for x in inputs:
        x = x.clone().requires_grad_()
        store = WeightGradStore()
        with defer_weight_grad(deferred, store):
            deferred(x).square().sum().backward()
        # B computed the input gradient but left the weight gradients for W
        assert x.grad is not None and len(store) == 2
        assert deferred[0].weight.grad is None or len(stores) > 0
        stores.append(store)
    assert deferred[2].weight.grad is None
    for store in reversed(stores):  # W may run in any order
        store.flush()
        assert len(store) == 0
    for a, b in zip(immediate.parameters(), deferred.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
    # outside the context the store is detached again
    assert all(m.weight_grad_store is None for m in deferred.modules() if isinstance(m, Linear))


def test_a_layer_that_neither_defers_nor_fuses_runs_torchs_own_linear():
    """Deferral off and no fusion: the forward is plain ``F.linear`` (torch's own backward node,
    no Python in the backward), with the same output and gradients as the deferrable path."""
    _, deferrable = _pair(2)
    _, native = _pair(2)
    set_weight_grad_deferral([native[0], native[2]], False)
    x = torch.randn(4, 2, 8)
    outputs = [model(x) for model in (deferrable, native)]
    assert type(deferrable[0](x).grad_fn).__name__ == "LinearWithDeferrableWeightGradBackward"
    node = native[0](x).grad_fn  # torch's: a view of one addmm with the bias inside
    assert [type(n).__name__ for n in (node, node.next_functions[0][0])] == [
        "ViewBackward0", "AddmmBackward0"]
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)
    for output in outputs:
        output.square().sum().backward()
    for a, b in zip(deferrable.parameters(), native.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)
    # a weight marked for gradient-accumulation fusion still takes our function
    native[0].weight.main_grad = torch.zeros_like(native[0].weight)
    native[0].weight.fuse_wgrad_accumulation = True
    assert type(native[0](x).grad_fn).__name__ == "LinearWithDeferrableWeightGradBackward"


def test_defer_weight_grad_refuses_layers_whose_forward_cannot_defer():
    """A backward cannot defer what a native forward computes in the backward: said, not run."""
    _, model = _pair(3)
    set_weight_grad_deferral([model[0]], False)
    with pytest.raises(RuntimeError, match="cannot be deferred"):
        with defer_weight_grad(model, WeightGradStore()):
            pass
    assert all(m.weight_grad_store is None for m in model.modules() if isinstance(m, Linear))
