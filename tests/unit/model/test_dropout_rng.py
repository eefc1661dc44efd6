"""Keyed dropout: masks depend on (seed, sample, layer) only, not on order, rank or draws."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_chimera.config import ModelConfig
from megatron_chimera.data.samplers import build_data_iterator, microbatch_first_samples
from megatron_chimera.model.dropout_rng import (
    KeyedMicrobatch,
    dropout_stream,
    keyed_forward_step,
    microbatch_key,
)
from megatron_chimera.model.gpt2 import GPTModel, build_gpt_stage
from tests.helpers.models import SEQ, VOCAB, small_config

BATCH = 2


def config(**overrides) -> ModelConfig:
    """The shared small model with dropout 0.1 (attention and hidden)."""
    return small_config(**{"hidden_dropout": 0.1, "attention_dropout": 0.1, **overrides})


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return tokens, torch.arange(SEQ).expand(BATCH, SEQ), torch.randint(0, VOCAB, (BATCH, SEQ),
                                                                         generator=g)


def test_stage_slices_in_pipeline_order_see_the_whole_models_masks():
    # Whole model: mb0 then mb1. Two stages in a pipeline's order: s0(mb0) s0(mb1) s1(mb0) s1(mb1).
    # With one global stream the masks would differ; keyed, they are the same.
    cfg = config()
    whole = GPTModel(cfg)
    stages = [build_gpt_stage(cfg, [(0, 2), (2, 4)], s) for s in (0, 1)]
    keys = [microbatch_key(1234, first) for first in (0, BATCH)]
    want = []
    for m in range(2):
        tokens, positions, labels = batch(m)
        with dropout_stream(keys[m]):
            want.append(whole(tokens, positions, labels=labels))
    torch.manual_seed(99)  # the rank's own stream differs: irrelevant to the masks
    hidden = []
    for m in range(2):
        tokens, positions, _ = batch(m)
        with dropout_stream(keys[m]):
            hidden.append(stages[0](tokens, positions))
    for m in range(2):
        stages[1].set_input_tensor(hidden[m])
        with dropout_stream(keys[m]):
            got = stages[1](None, None, labels=batch(m)[2])
        assert torch.equal(got, want[m])
    # and dropout is on: another key gives other masks
    with dropout_stream(microbatch_key(1234, 7)):
        other = whole(*batch(0)[:2], labels=batch(0)[2])
    assert not torch.equal(other, want[0])


def test_stream_leaves_the_global_rng_untouched():
    torch.manual_seed(5)
    before = torch.get_rng_state()
    with dropout_stream(microbatch_key(1, 0)):
        GPTModel(config())(*batch(0)[:2], labels=batch(0)[2])
    assert torch.equal(torch.get_rng_state(), before)


def test_full_recomputation_replays_the_keyed_masks():
    grads = []
    for recompute in ({}, dict(recompute_granularity="full", recompute_method="uniform",
                               recompute_num_layers=2)):
        model = GPTModel(config(**recompute))
        step = keyed_forward_step(lambda b, m: m(b[0], b[1], labels=b[2]))
        loss = step(KeyedMicrobatch(microbatch_key(3, 0), batch(0)), model)
        loss.sum().backward()  # recomputation runs here, outside the stream
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_creating_a_data_iterator_draws_nothing_from_the_global_rng():
    dataset = [{"text": np.arange(5)} for _ in range(16)]
    torch.manual_seed(0)
    before = torch.get_rng_state()
    build_data_iterator(dataset, 4, 2, 0, 1, num_workers=0)
    assert torch.equal(torch.get_rng_state(), before)


def test_first_samples_do_not_depend_on_the_data_parallel_size():
    # B=2, G=8: W=1 has N=4 micro-batches, W=2 has N=2 per replica; same sample starts overall
    one = microbatch_first_samples(16, 4, 2, 0, 1)
    two = [s for r in (0, 1) for s in microbatch_first_samples(16, 2, 2, r, 2)]
    assert sorted(one) == sorted(two) == [16, 18, 20, 22]


@pytest.fixture
def seeded_tracker():
    """The tensor-parallel RNG tracker seeded as training seeds it (reset afterwards)."""
    from megatron_chimera.tensor_parallel import (
        get_cuda_rng_tracker,
        model_parallel_cuda_manual_seed,
    )

    model_parallel_cuda_manual_seed(1234)
    yield get_cuda_rng_tracker()
    get_cuda_rng_tracker().reset()


def test_tensor_parallel_dropout_is_keyed_in_a_stream(seeded_tracker):
    # Attention-probability dropout draws per tensor rank. In a keyed stream its masks must still
    # depend only on (micro-batch, layer): not on how far the tracker's stream has advanced
    # (which depends on the schedule and on what ran before a resume).
    model = GPTModel(config())
    key = microbatch_key(1234, 0)
    outputs = []
    for advance in (0, 3):
        for _ in range(advance):
            with seeded_tracker.fork():
                torch.rand(10)
        with dropout_stream(key):
            outputs.append(model(*batch(0)[:2], labels=batch(0)[2]))
    assert torch.equal(outputs[0], outputs[1])
    # outside a stream the tracker's stream is used (and advances): other masks
    free = [model(*batch(0)[:2], labels=batch(0)[2]) for _ in range(2)]
    assert not torch.equal(free[0], free[1])


def test_selective_recomputation_replays_the_keyed_attention_masks(seeded_tracker):
    grads = []
    for recompute in ({}, dict(recompute_granularity="selective")):
        model = GPTModel(config(hidden_dropout=0.0, **recompute))
        step = keyed_forward_step(lambda b, m: m(b[0], b[1], labels=b[2]))
        loss = step(KeyedMicrobatch(microbatch_key(3, 0), batch(0)), model)
        loss.sum().backward()  # the core attention is recomputed here, outside the stream
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
