"""The tensor-parallel layers on T = 2 gloo processes against their single-process counterparts:
column- and row-parallel linears (every option, sequence parallel, deferred weight gradients)
against ``nn.Linear``, the vocabulary-parallel embedding against ``nn.Embedding``, the
vocabulary-parallel cross-entropy against ``F.cross_entropy``, the mappings' forward and backward,
and GPT-2 / BERT with T = 2 (with and without sequence parallelism) against the whole model."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron_chimera import parallel_state
from megatron_chimera.config import ModelConfig
from megatron_chimera.model.bert import BertModel
from megatron_chimera.model.family import BERT, GPT2
from megatron_chimera.model.gpt2 import GPTModel
from megatron_chimera.model.partition import stage_parameters
from megatron_chimera.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    model_parallel_cuda_manual_seed,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
    vocab_parallel_cross_entropy,
)
from megatron_chimera.tensor_parallel.utils import shard_of_master
from megatron_chimera.tensor_parallel.weight_grad import WeightGradStore, defer_weight_grad
from tests.distributed.harness import spawn_world
from tests.helpers.models import small_config
from tests.helpers.tensor_parallel import full_state, full_tensor

pytestmark = pytest.mark.timeout(180)
T = 2
TOL = dict(rtol=1e-5, atol=1e-6)


def _init_tp(world_size: int) -> None:
    """One pipeline stage, T = world size (every rank one shard of the whole model)."""
    parallel_state.initialize_model_parallel(1, [[0]], 1, tensor_model_parallel_size=world_size,
                                             timeout=datetime.timedelta(seconds=60))


def _same_on_every_rank(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _load(layer: nn.Module, reference: nn.Linear) -> None:
    """Copy this rank's shards of ``reference``'s weight and bias into ``layer``."""
    with torch.no_grad():
        layer.weight.copy_(shard_of_master(layer.weight, reference.weight))
        if layer.bias is not None:
            layer.bias.copy_(shard_of_master(layer.bias, reference.bias))


def _linear_case(kind: str, options: dict, deferred: bool) -> None:
    s, b, h_in, h_out = 4, 3, 8, 6
    reference = nn.Linear(h_in, h_out)
    with torch.no_grad():
        reference.weight.copy_(_same_on_every_rank(1, h_out, h_in))
        reference.bias.copy_(_same_on_every_rank(2, h_out))
    x = _same_on_every_rank(3, s, b, h_in).requires_grad_()
    target = _same_on_every_rank(4, s, b, h_out)
    expected = reference(x)
    ((expected - target) ** 2).sum().backward()
    rank = parallel_state.get_tensor_model_parallel_rank()
    sequence_parallel = options.get("sequence_parallel", False)
    if kind == "column":
        layer = ColumnParallelLinear(h_in, h_out, **options)
    else:
        layer = RowParallelLinear(h_in, h_out, **options)
    _load(layer, reference)
    x_local = x.detach().clone()
    if kind == "row" and options.get("input_is_parallel"):
        x_local = x_local.chunk(T, dim=-1)[rank]
    if sequence_parallel and kind == "column":
        x_local = x_local.chunk(T, dim=0)[rank]
    x_local = x_local.clone().requires_grad_()
    store = WeightGradStore()
    context = defer_weight_grad(layer, store) if deferred else torch.enable_grad()
    with context:
        output, bias = layer(x_local)
        if bias is not None:
            output = output + bias
        want = expected.detach()
        if kind == "column" and not options.get("gather_output"):
            want = want.chunk(T, dim=-1)[rank]
        if kind == "row" and sequence_parallel:
            want = want.chunk(T, dim=0)[rank]
        torch.testing.assert_close(output, want, **TOL)
        goal = target
        if kind == "column" and not options.get("gather_output"):
            goal = goal.chunk(T, dim=-1)[rank]
        if kind == "row" and sequence_parallel:
            goal = goal.chunk(T, dim=0)[rank]
        ((output - goal) ** 2).sum().backward()
    if deferred:
        assert layer.weight.grad is None and len(store) > 0
        store.flush()
    want_input_grad = x.grad
    if kind == "row" and options.get("input_is_parallel"):
        want_input_grad = want_input_grad.chunk(T, dim=-1)[rank]
    if sequence_parallel and kind == "column":
        want_input_grad = want_input_grad.chunk(T, dim=0)[rank]
    torch.testing.assert_close(x_local.grad, want_input_grad, **TOL)
    torch.testing.assert_close(full_tensor(layer.weight, layer.weight.grad),
                               reference.weight.grad, **TOL)
    bias_grad = layer.bias.grad
    if kind == "row" and sequence_parallel:  # partial per rank: the sequence-parallel all-reduce
        bias_grad = reduce_from_tensor_model_parallel_region(bias_grad)
    torch.testing.assert_close(full_tensor(layer.bias, bias_grad), reference.bias.grad, **TOL)


LINEAR_CASES = [
    ("column", {"gather_output": True}), ("column", {"gather_output": False}),
    ("column", {"skip_bias_add": True}), ("column", {"async_allreduce": False}),
    ("column", {"sequence_parallel": True}),
    ("row", {"input_is_parallel": False}), ("row", {"input_is_parallel": True}),
    ("row", {"input_is_parallel": True, "skip_bias_add": True}),
    ("row", {"input_is_parallel": True, "sequence_parallel": True}),
]


def _embedding_and_loss_case() -> None:
    vocab, h = 12, 5
    reference = nn.Embedding(vocab, h)
    with torch.no_grad():
        reference.weight.copy_(_same_on_every_rank(5, vocab, h))
    ids = torch.randint(0, vocab, (3, 4), generator=torch.Generator().manual_seed(6))
    reference(ids).square().sum().backward()
    layer = VocabParallelEmbedding(vocab, h)
    with torch.no_grad():
        layer.weight.copy_(shard_of_master(layer.weight, reference.weight))
    out = layer(ids)
    torch.testing.assert_close(out, reference(ids).detach(), **TOL)
    out.square().sum().backward()
    torch.testing.assert_close(full_tensor(layer.weight, layer.weight.grad),
                               reference.weight.grad, **TOL)

    logits = _same_on_every_rank(7, 3, 4, vocab).requires_grad_()
    labels = torch.randint(0, vocab, (3, 4), generator=torch.Generator().manual_seed(8))
    loss = F.cross_entropy(logits.view(-1, vocab), labels.view(-1), reduction="none").view(3, 4)
    weights = _same_on_every_rank(9, 3, 4)
    (loss * weights).sum().backward()
    rank = parallel_state.get_tensor_model_parallel_rank()
    local = logits.detach().chunk(T, dim=-1)[rank].clone().requires_grad_()
    parallel = vocab_parallel_cross_entropy(local, labels)
    torch.testing.assert_close(parallel, loss.detach(), **TOL)
    (parallel * weights).sum().backward()
    torch.testing.assert_close(local.grad, logits.grad.chunk(T, dim=-1)[rank], **TOL)


def _per_rank(seed: int, shape: tuple[int, ...], rank: int) -> torch.Tensor:
    """A tensor that differs by rank, computable on every rank for any rank."""
    return _same_on_every_rank(seed, *shape) * (rank + 1) + rank


def _mappings_case() -> None:
    me = parallel_state.get_tensor_model_parallel_rank()
    shape, half_last, half_first = (4, 2, 6), (4, 2, 3), (2, 2, 6)
    double_last, double_first = (4, 2, 12), (8, 2, 6)
    xs = [_per_rank(10, shape, r) for r in range(T)]  # each rank's input
    same = _same_on_every_rank(12, *shape)  # an input equal on every rank

    def grads(out_shape):
        return [_per_rank(11, out_shape, r) for r in range(T)]

    cases = {  # name: (function, input, expected output, grads by rank, expected input grad)
        "copy": (copy_to_tensor_model_parallel_region, xs[me], xs[me], grads(shape),
                 sum(grads(shape))),
        "reduce": (reduce_from_tensor_model_parallel_region, xs[me], sum(xs), grads(shape),
                   grads(shape)[me]),
        "scatter": (scatter_to_tensor_model_parallel_region, same, same.chunk(T, -1)[me],
                    grads(half_last), torch.cat(grads(half_last), -1)),
        "gather": (gather_from_tensor_model_parallel_region, xs[me], torch.cat(xs, -1),
                   grads(double_last), grads(double_last)[me].chunk(T, -1)[me]),
        "scatter sequence": (scatter_to_sequence_parallel_region, same, same.chunk(T, 0)[me],
                             grads(half_first), torch.cat(grads(half_first), 0)),
        "gather sequence": (gather_from_sequence_parallel_region, xs[me], torch.cat(xs, 0),
                            grads(double_first), sum(grads(double_first)).chunk(T, 0)[me]),
        "gather sequence, replicated gradient": (
            lambda v: gather_from_sequence_parallel_region(v, tensor_parallel_output_grad=False),
            xs[me], torch.cat(xs, 0), grads(double_first),
            grads(double_first)[me].chunk(T, 0)[me]),
        "reduce-scatter sequence": (reduce_scatter_to_sequence_parallel_region, xs[me],
                                    sum(xs).chunk(T, 0)[me], grads(half_first),
                                    torch.cat(grads(half_first), 0)),
    }
    for name, (fn, value, want, grad_outs, want_grad) in cases.items():
        value = value.clone().requires_grad_()
        out = fn(value)
        torch.testing.assert_close(out, want, **TOL, msg=name)
        out.backward(grad_outs[me])
        torch.testing.assert_close(value.grad, want_grad, **TOL, msg=name)


def _collectives_case() -> None:
    """Both torch spellings of the single-tensor collectives give the same result (the older
    ones are what a torch before 2.13 offers)."""
    import torch.distributed as dist

    from megatron_chimera.tensor_parallel import collectives

    me, group = parallel_state.get_tensor_model_parallel_rank(), \
        parallel_state.get_tensor_model_parallel_group()
    xs = [_per_rank(20, (4, 3), r) for r in range(T)]
    # the spellings this torch has (2.11 and 2.12: only the older ones)
    spellings = lambda *names: [getattr(dist, n) for n in names if hasattr(dist, n)]  # noqa: E731
    for gather in spellings("all_gather_single", "all_gather_into_tensor"):
        out = torch.empty(4 * T, 3)
        collectives.all_gather_single(out, xs[me], group=group, impl=gather)
        torch.testing.assert_close(out, torch.cat(xs), **TOL, msg=gather.__name__)
    for scatter in spellings("reduce_scatter_single", "reduce_scatter_tensor"):
        out = torch.empty(4 // T, 3)
        collectives.reduce_scatter_single(out, xs[me], group=group, impl=scatter)
        torch.testing.assert_close(out, sum(xs).chunk(T)[me], **TOL, msg=scatter.__name__)


def run_layers(rank: int, world_size: int) -> None:
    _init_tp(world_size)
    try:
        _mappings_case()
        _collectives_case()
        for kind, options in LINEAR_CASES:
            for deferred in (False, True):
                try:
                    _linear_case(kind, options, deferred)
                except AssertionError as exc:
                    raise AssertionError(f"{kind} {options} deferred={deferred}: {exc}") from exc
        _embedding_and_loss_case()
    finally:
        parallel_state.destroy_model_parallel()


def test_layers_match_their_single_process_counterparts():
    spawn_world(run_layers, T, timeout_s=150)


def test_mappings_add_no_autograd_node_with_one_tensor_rank():
    """With T = 1 every mapping hands back its input itself: no autograd Function, no host
    cost per layer (issue 32's host-overhead budget)."""
    x = torch.randn(4, 2, 6, requires_grad=True)
    for fn in (copy_to_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region,
               scatter_to_tensor_model_parallel_region, gather_from_tensor_model_parallel_region,
               scatter_to_sequence_parallel_region, gather_from_sequence_parallel_region,
               reduce_scatter_to_sequence_parallel_region):
        assert fn(x) is x, fn.__name__


# ----------------------------------------------------------------------------- whole models
def _config(**overrides) -> ModelConfig:
    return small_config(**{"num_layers": 2, "seq_length": 8, "vocab_size": 50,
                           "make_vocab_size_divisible_by": 16, **overrides})


def _gpt_loss(model: GPTModel) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 50, (2, 8), generator=g)
    labels = torch.randint(0, 50, (2, 8), generator=g)
    positions = torch.arange(8).expand(2, 8)
    return model(tokens, positions, labels=labels).mean()


def _bert_loss(model: BertModel) -> torch.Tensor:
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, 50, (2, 8), generator=g)
    labels = torch.randint(0, 50, (2, 8), generator=g)
    types = torch.randint(0, 2, (2, 8), generator=g)
    padding = torch.ones(2, 8)
    padding[1, 6:] = 0
    lm_loss, sop_logits = model(tokens, padding, tokentype_ids=types, lm_labels=labels)
    return lm_loss.mean() + F.cross_entropy(sop_logits, torch.tensor([0, 1]))


MODELS = {"gpt2": (GPTModel, _gpt_loss), "bert": (BertModel, _bert_loss)}
FAMILY_OF = {"gpt2": GPT2, "bert": BERT}


def run_models(rank: int, world_size: int, family: str, sequence_parallel: bool,
               untied: bool) -> None:
    cls, loss_of = MODELS[family]
    config = _config(sequence_parallel=sequence_parallel,
                     untie_embeddings_and_output_weights=untied)
    reference = cls(config, seed=7)  # before the groups: the whole model
    ref_loss = loss_of(reference)
    ref_loss.backward()
    _init_tp(world_size)
    model_parallel_cuda_manual_seed(1234)
    try:
        model = cls(config, seed=7)
        per_rank = stage_parameters(config, FAMILY_OF[family], [(0, config.num_layers)],
                                    world_size)[0]
        assert sum(p.numel() for p in model.parameters()) == per_rank  # the analytic count
        for name, value in full_state(model).items():  # layout-independent initialisation
            assert torch.equal(value, dict(reference.named_parameters())[name]), name
        loss = loss_of(model)
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=0)
        loss.backward()
        if sequence_parallel:
            from megatron_chimera.tensor_parallel import (
                allreduce_sequence_parallel_grads,
                sequence_parallel_params,
            )
            params = sequence_parallel_params([model])
            assert params, "sequence parallelism marks the LayerNorms"
            allreduce_sequence_parallel_grads(
                params, parallel_state.get_tensor_model_parallel_group())
        want = {n: p.grad for n, p in reference.named_parameters()}
        for name, grad in full_state(model, grads=True).items():
            torch.testing.assert_close(grad, want[name], rtol=1e-4, atol=1e-6, msg=name)
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("family,sequence_parallel,untied", [
    ("gpt2", False, False), ("gpt2", True, True), ("bert", False, False), ("bert", True, False)])
def test_models_with_two_tensor_parallel_ranks_equal_the_whole_model(family, sequence_parallel,
                                                                     untied):
    spawn_world(run_models, T, family, sequence_parallel, untied, timeout_s=150)
