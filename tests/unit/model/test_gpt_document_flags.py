"""--eod-mask-loss, --reset-position-ids, --reset-attention-mask against independent references.

References: Megatron's dense loop (masks built position by position, as its
``get_ltor_masks_and_position_ids``), documents run through the model one by one, and a model
split into pipeline stages. Tolerances: fp64 attention agrees to 1e-12 (summation order only);
the fp32 model to 2e-5 relative (two attention paths / shorter sequences reorder float sums).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_chimera.config import ConfigError, ModelConfig
from megatron_chimera.data.gpt_dataset import MockGPTDataset, get_batch
from megatron_chimera.data.gpt_sample_fields import (
    GPTSampleDataset,
    LtorOptions,
    ltor_sample_fields,
)
from megatron_chimera.data.samplers import build_pretraining_data_loader
from megatron_chimera.model.document_attention import DocumentMask, document_attention
from megatron_chimera.model.fused import attention
from megatron_chimera.model.gpt2 import GPTModel, build_gpt_stage
from tests.helpers.models import small_config

EOD = 0


def megatron_reference(tokens: np.ndarray, reset_position_ids: bool, reset_attention_mask: bool,
                       eod_mask_loss: bool):
    """Megatron's loop: (allowed [s, s] bool, loss mask, position ids) of one sample's tokens."""
    seq = len(tokens)
    allowed = np.tril(np.ones((seq, seq), dtype=bool))
    loss_mask = np.ones(seq)
    if eod_mask_loss:
        loss_mask[tokens == EOD] = 0.0
    positions = np.arange(seq)
    previous = 0
    for i in np.flatnonzero(tokens == EOD):
        if reset_attention_mask:
            allowed[i + 1:, : i + 1] = False
        if reset_position_ids:
            positions[i + 1:] -= i + 1 - previous
            previous = i + 1
    return allowed, loss_mask, positions


def random_text(rng: np.random.Generator, length: int) -> np.ndarray:
    text = rng.integers(1, 50, size=length)
    text[rng.random(length) < 0.15] = EOD
    return text


@pytest.mark.parametrize("flags", [(False, False, False), (True, False, False),
                                   (False, True, False), (False, False, True),
                                   (True, True, True)])
def test_sample_fields_match_megatron(flags):
    reset_pos, reset_att, eod_mask = flags
    options = LtorOptions(EOD, reset_pos, reset_att, eod_mask)
    rng = np.random.default_rng(0)
    samples = [random_text(rng, 33) for _ in range(40)]
    samples += [np.array([EOD] * 9), np.array([3, EOD, EOD, 4, 5, 6, EOD, 7, EOD])]
    for text in samples:
        fields = ltor_sample_fields(text, options)
        allowed, loss_mask, positions = megatron_reference(text[:-1], *flags)
        np.testing.assert_array_equal(fields["loss_mask"], loss_mask)
        np.testing.assert_array_equal(fields["position_ids"], positions)
        assert ("document_ids" in fields) == reset_att
        if reset_att:
            ids = fields["document_ids"]
            mine = (ids[:, None] == ids[None, :]) & np.tril(np.ones((len(ids),) * 2, dtype=bool))
            np.testing.assert_array_equal(mine, allowed)


def test_fields_come_from_the_data_workers():
    """The fields are part of each sample (computed in ``__getitem__``, i.e. in the DataLoader
    worker processes) and collate to fixed-shape tensors."""
    options = LtorOptions(EOD, True, True, True)
    dataset = GPTSampleDataset(MockGPTDataset("train", 8, 16, 50, EOD, seed=3), options)
    loader = build_pretraining_data_loader(dataset, 0, 4, 0, 1, num_workers=1)
    batch = next(iter(loader))
    assert set(batch) == {"text", "loss_mask", "position_ids", "document_ids"}
    assert batch["document_ids"].shape == (4, 16) and batch["loss_mask"].dtype == torch.float32
    for row, text in enumerate(batch["text"].numpy()):
        expected = ltor_sample_fields(text, options)
        for key, value in expected.items():
            np.testing.assert_array_equal(batch[key][row].numpy(), value)
    assert get_batch(batch).document_ids is batch["document_ids"]


# ----------------------------------------------------------------------------- attention kernels
def _qkv(b=2, heads=3, s=14, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, heads, s, d, generator=g, dtype=dtype, requires_grad=True)
            for _ in range(3)]


DOCS = torch.tensor([[0] * 4 + [1] * 7 + [2] * 3, [0] * 14])


def test_document_kernels_agree_with_the_dense_mask():
    """loop (per-document SDPA), flex_attention and the unfused softmax against the
    block-diagonal mask through SDPA, values and gradients."""
    mask = DocumentMask(DOCS)
    q, k, v = _qkv()
    reference = document_attention(q, k, v, mask, 0.0, False, implementation="mask")
    grad = torch.randn_like(reference)
    ref_grads = torch.autograd.grad(reference, (q, k, v), grad)
    for impl, fused in (("loop", True), ("mask", False), ("auto", True)):
        out = document_attention(q, k, v, mask, 0.0, False, implementation=impl, fused=fused)
        torch.testing.assert_close(out, reference, rtol=1e-12, atol=1e-12)
        for mine, ref in zip(torch.autograd.grad(out, (q, k, v), grad), ref_grads):
            torch.testing.assert_close(mine, ref, rtol=1e-12, atol=1e-12)
    # each document alone, plain causal attention: the independent reference
    for i, start, end in mask.segments:
        alone = attention(*(t[i:i + 1, :, start:end] for t in (q, k, v)), None, True, 0.0, False)
        torch.testing.assert_close(reference[i:i + 1, :, start:end], alone, rtol=1e-12,
                                   atol=1e-12)
    with torch.no_grad():  # flex_attention has no CPU backward in torch 2.13: forward only
        flex = document_attention(*(t.float() for t in (q, k, v)), mask, 0.0, False,
                                  implementation="flex")
    torch.testing.assert_close(flex.double(), reference, rtol=1e-5, atol=1e-5)


def test_document_kernel_choice_and_errors():
    q, k, v = _qkv(dtype=torch.float32)
    mask = DocumentMask(DOCS)
    with pytest.raises(ConfigError, match="--document-attention flex.*loop"):
        document_attention(q, k, v, mask, 0.0, False, implementation="flex")
    with pytest.raises(ConfigError, match="--document-attention varlen needs CUDA"):
        document_attention(q, k, v, mask, 0.0, False, implementation="varlen")
    with pytest.raises(ConfigError, match="attention dropout"):
        with torch.no_grad():
            document_attention(q, k, v, mask, 0.1, True, implementation="flex")
    # loop supports attention dropout: probabilities are dropped per document
    torch.manual_seed(0)
    out = document_attention(q, k, v, mask, 0.5, True, implementation="loop")
    assert out.shape == q.shape and torch.isfinite(out).all()


# ----------------------------------------------------------------------------- the model
def _config(**overrides) -> ModelConfig:
    return small_config(**{"num_layers": 3, "seq_length": 24, "vocab_size": 60, **overrides})


def _packed_sample(len_a: int = 9, len_b: int = 14, seed: int = 4) -> tuple[np.ndarray, int]:
    """Document A (ending with EOD) followed by document B: ``len_a + len_b + 1`` tokens."""
    rng = np.random.default_rng(seed)
    doc_a = np.append(rng.integers(1, 60, size=len_a - 1), EOD)
    doc_b = rng.integers(1, 60, size=len_b + 1)
    return np.concatenate([doc_a, doc_b]), len_a


def _losses(model: GPTModel, text: np.ndarray, options: LtorOptions,
            first_position: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token losses and loss mask of one sample, as ``pretrain_gpt2.forward_step`` runs it."""
    sample = {key: torch.from_numpy(np.asarray(value))[None]
              for key, value in {"text": text, **ltor_sample_fields(text, options)}.items()}
    tokens, labels, loss_mask, document_ids, positions = get_batch(sample)
    mask = None if document_ids is None else DocumentMask(document_ids)
    return model(tokens, positions + first_position, mask, labels)[0], loss_mask[0]


@pytest.mark.parametrize("impl", ["loop", "mask"])
def test_packed_documents_equal_separate_documents(impl):
    """--reset-attention-mask --reset-position-ids --eod-mask-loss: the loss of a packed
    two-document sample is the token-weighted loss of the two documents run separately."""
    model = GPTModel(_config(document_attention=impl), seed=5)
    text, len_a = _packed_sample()
    packed, loss_mask = _losses(model, text, LtorOptions(EOD, True, True, True))
    alone_a, _ = _losses(model, text[: len_a + 1], LtorOptions(EOD))  # A, its EOD -> B[0]
    alone_b, _ = _losses(model, text[len_a:], LtorOptions(EOD))
    assert loss_mask.tolist() == [1.0] * (len_a - 1) + [0.0] + [1.0] * len(alone_b)
    torch.testing.assert_close(packed, torch.cat([alone_a, alone_b]), rtol=2e-5, atol=2e-5)
    mean = (packed * loss_mask).sum() / loss_mask.sum()  # pretrain_gpt2.loss_func
    expected = (alone_a[:-1].sum() + alone_b.sum()) / (len(alone_a) - 1 + len(alone_b))
    torch.testing.assert_close(mean, expected, rtol=2e-5, atol=2e-5)


def test_reset_attention_mask_without_reset_position_ids():
    """Attention is cut at the EOD but positions keep counting: document B alone with its
    positions offset is the reference; without the document mask the losses differ."""
    model = GPTModel(_config(), seed=6)
    text, len_a = _packed_sample(seed=7)
    packed, loss_mask = _losses(model, text, LtorOptions(EOD, reset_attention_mask=True))
    assert loss_mask.min() == 1.0  # no --eod-mask-loss
    alone_b, _ = _losses(model, text[len_a:], LtorOptions(EOD), first_position=len_a)
    torch.testing.assert_close(packed[len_a:], alone_b, rtol=2e-5, atol=2e-5)
    crossing, _ = _losses(model, text, LtorOptions(EOD))  # attention crosses the boundary
    torch.testing.assert_close(crossing[:len_a], packed[:len_a], rtol=2e-5, atol=2e-5)
    assert not torch.allclose(crossing[len_a:], packed[len_a:], rtol=1e-3, atol=1e-3)


def test_every_pipeline_stage_needs_the_document_mask():
    """Stage slices given the mask reproduce the whole model; a later stage without it does
    not (why --reset-attention-mask sends the batch to every stage)."""
    config = _config()
    whole = GPTModel(config, seed=8)
    partition = [(0, 1), (1, 3)]
    stages = [build_gpt_stage(config, partition, s, seed=8) for s in range(2)]
    text, _ = _packed_sample(seed=9)
    options = LtorOptions(EOD, True, True, True)
    sample = {key: torch.from_numpy(np.asarray(v))[None]
              for key, v in {"text": text, **ltor_sample_fields(text, options)}.items()}
    tokens, labels, _, document_ids, positions = get_batch(sample)
    mask = DocumentMask(document_ids)
    expected = whole(tokens, positions, mask, labels)
    hidden = stages[0](tokens, positions, mask)
    for last_mask, same in ((mask, True), (None, False)):
        stages[1].set_input_tensor(hidden)
        out = stages[1](None, None, last_mask, labels)
        assert torch.allclose(out, expected, rtol=1e-5, atol=1e-6) == same
