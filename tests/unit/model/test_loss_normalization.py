"""The loss divisor: pretraining's per-sequence token mean unchanged; per-token loss over the
global batch independent of the micro-batch split and the data-parallel layout."""

import pytest
import torch

from megatron_chimera.model.loss_normalization import (
    count_trained_tokens,
    loss_divisor,
    microbatch_units,
)


def _micro_batches(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    losses = torch.rand(6, 10, generator=gen, dtype=torch.float64)
    masks = (torch.rand(6, 10, generator=gen) > 0.4).to(torch.float64)
    masks[0, 0] = 1.0
    return losses, masks


def test_pretraining_divisor_is_the_sequence_tokens():
    losses, masks = _micro_batches()
    for loss, mask in zip(losses, masks):
        got = torch.sum(loss * mask) / loss_divisor(mask.sum())
        assert torch.equal(got, (loss * mask).sum() / mask.sum())


@pytest.mark.parametrize("split", [[6], [3, 3], [2, 2, 2], [1] * 6])
def test_per_token_loss_is_the_global_token_mean_for_every_split(split):
    """Each group of ``split`` is one data-parallel rank's micro-batches; the executor divides
    every micro-batch loss by units = micro-batches per rank x ranks, gradients are summed."""
    losses, masks = _micro_batches()
    reference = (losses * masks).sum() / masks.sum()  # independent: one mean over every token
    per_rank = len(split)
    global_tokens = count_trained_tokens(list(masks))
    units = split[0] * per_rank
    assert len(set(split)) == 1
    total = sum(torch.sum(loss * mask) / loss_divisor(mask.sum(), global_tokens, units) / units
                for loss, mask in zip(losses, masks))
    assert torch.allclose(total, reference, rtol=1e-14, atol=0)
    # the default divisor would weigh sequences, not tokens: a test that can fail
    default = sum(torch.sum(loss * mask) / loss_divisor(mask.sum()) / 6
                  for loss, mask in zip(losses, masks))
    assert not torch.allclose(default, reference, rtol=1e-6, atol=0)


def test_count_refuses_an_empty_global_batch_and_bad_units():
    with pytest.raises(ValueError, match="no trained token"):
        count_trained_tokens([torch.zeros(4), torch.zeros(3)])
    with pytest.raises(ValueError, match="units must be positive"):
        loss_divisor(torch.tensor(3.0), torch.tensor(5.0), 0)


def test_count_sums_every_micro_batch():
    assert count_trained_tokens([torch.ones(2, 3), torch.tensor([1.0, 0.0])]).item() == 7.0


def test_microbatch_units_is_sequences_times_data_parallel_ranks():
    assert microbatch_units(4, 2) == 8
    with pytest.raises(ValueError, match="must be positive"):
        microbatch_units(0, 2)
