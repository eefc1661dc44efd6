"""A model run slice by slice with the keys/values of earlier slices cached (forwards in slice
order, backwards in reverse) gives the whole sequence's loss and gradients; a backward out of
slice order does not (the rule the sliced schedules keep)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_chimera.model.document_attention import DocumentMask
from megatron_chimera.model.gpt2 import GPTModel
from megatron_chimera.model.sequence_slices import SequenceCache, SliceTokens
from tests.helpers.models import VOCAB, small_config

LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
             num_query_groups=2, add_bias_linear=False)
SEQ = 24


def _batch(documents: bool):
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    loss_mask = (torch.rand(2, SEQ, generator=g) > 0.2).float()
    positions = torch.arange(SEQ).expand(2, SEQ).contiguous()
    docs = torch.cumsum((torch.rand(2, SEQ, generator=g) < 0.15).long(), 1) if documents else None
    return tokens, labels, loss_mask, positions, docs


def _whole(model, tokens, labels, loss_mask, positions, docs):
    mask = None if docs is None else DocumentMask(docs)
    losses = model(tokens, positions, attention_mask=mask, labels=labels)
    return (losses * loss_mask).sum() / loss_mask.sum()


def _sliced_losses(model, bounds, tokens, labels, loss_mask, positions, docs):
    """Each slice's share of the sequence's token-mean loss, forwards in slice order."""
    cache, total, losses = SequenceCache(), loss_mask.sum(), []
    for a, b in zip(bounds, bounds[1:]):
        part = slice(a, b)
        mask = SliceTokens(cache, positions[0, part], None if docs is None else docs[:, part])
        out = model(tokens[:, part], positions[:, part], attention_mask=mask,
                    labels=labels[:, part])
        losses.append((out * loss_mask[:, part]).sum() / total)
    return losses


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("llama,documents,bounds", [
    (True, True, (0, 6, 14, 24)), (False, False, (0, 12, 24)), (True, False, (0, 4, 8, 16, 24))])
def test_slices_in_order_equal_the_whole_sequence(llama, documents, bounds):
    config = small_config(seq_length=SEQ, **(LLAMA if llama else {}))
    batch = _batch(documents)
    model = GPTModel(config, seed=3)
    whole = _whole(model, *batch)
    whole.backward()
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    losses = _sliced_losses(model, bounds, *batch)
    for loss in reversed(losses):  # the slice-order rule: later slices' backwards first
        loss.backward()
    got = _grads(model)
    assert float(sum(losses).detach()) == pytest.approx(float(whole.detach()), rel=1e-6)
    for name, g in want.items():
        err = float((got[name] - g).abs().max() / g.abs().max().clamp_min(1e-30))
        assert err < 1e-5, f"{name}: {err:.1e}"


def test_a_backward_out_of_slice_order_misses_the_cached_gradient():
    config = small_config(seq_length=SEQ, **LLAMA)
    batch = _batch(False)
    model = GPTModel(config, seed=3)
    _whole(model, *batch).backward()
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    for loss in _sliced_losses(model, (0, 12, 24), *batch):  # slice 0's backward first: wrong
        loss.backward()
    got = _grads(model)
    name = "language_model.encoder.layers.0.self_attention.query_key_value.weight"
    assert not torch.allclose(got[name], want[name], rtol=1e-3)


@pytest.mark.parametrize("method,layers", [("uniform", 2), ("block", 3)])
def test_full_recomputation_replays_a_slice_on_its_cached_keys_values(method, layers):
    """--recompute-granularity full: each slice's forward runs without a graph and is replayed in
    its backward, which reuses the keys/values it cached (and the gradient the later slices left
    on them): loss and gradients equal the whole sequence without recomputation."""
    config = small_config(seq_length=SEQ, **LLAMA)
    batch = _batch(True)
    model = GPTModel(config, seed=3)
    whole = _whole(model, *batch)
    whole.backward()
    want = _grads(model)
    recomputed = GPTModel(dataclasses.replace(
        config, recompute_granularity="full", recompute_method=method,
        recompute_num_layers=layers), seed=3)
    losses = _sliced_losses(recomputed, (0, 6, 14, 24), *batch)
    for loss in reversed(losses):
        loss.backward()
    got = _grads(recomputed)
    assert float(sum(losses).detach()) == pytest.approx(float(whole.detach()), rel=1e-6)
    for name, g in want.items():
        err = float((got[name] - g).abs().max() / g.abs().max().clamp_min(1e-30))
        assert err < 1e-5, f"{name}: {err:.1e}"


def test_sliced_saved_activations_stay_near_the_unsliced_run():
    """k = 4 slices with grouped-query attention (16 heads, 4 groups): the bytes saved for the
    backward by the four slices' forwards together (the memory report's count, one per storage)
    are at most 1.2x the whole sequence's -- no concatenated or head-repeated keys/values
    (issue 49; the concatenating, head-repeating path saved 1.27x here)."""
    from megatron_chimera.training.memory_report import SavedActivations
    seq = 64
    config = small_config(seq_length=seq, num_layers=2, hidden_size=64, num_attention_heads=16,
                          **{**LLAMA, "num_query_groups": 4})
    model = GPTModel(config, seed=3)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, seq), generator=g)
    positions = torch.arange(seq).expand(2, seq).contiguous()
    with SavedActivations(model.parameters()) as whole:
        out = model(tokens, positions, attention_mask=None, labels=tokens)
    del out
    cache, outs = SequenceCache(), []
    with SavedActivations(model.parameters()) as sliced:
        for a in range(0, seq, seq // 4):
            part = slice(a, a + seq // 4)
            outs.append(model(tokens[:, part], positions[:, part],
                              attention_mask=SliceTokens(cache, positions[0, part]),
                              labels=tokens[:, part]))
    ratio = sliced.peak / whole.peak
    print(f"sliced / unsliced saved bytes {ratio:.3f}")
    assert ratio <= 1.2, f"sliced / unsliced saved bytes {ratio:.3f}"
