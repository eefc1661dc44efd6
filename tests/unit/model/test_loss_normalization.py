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


def test_add_token_mean_reaches_every_unit_and_sliced_losses_sum_to_the_mean():
    """The training loop's wiring: every pipeline unit (keyed, sequence slices) gets one
    TokenMean of the read micro-batches; the slices' losses, divided by the executor's units,
    sum to the global-token mean (the reported losses average to it too)."""
    from megatron_chimera.model.dropout_rng import KeyedMicrobatch
    from megatron_chimera.model.loss_normalization import TOKEN_MEAN, add_token_mean
    from megatron_chimera.model.sequence_slices import SLICE, split_into_slices

    losses, masks = _micro_batches()
    read = [KeyedMicrobatch(i, {"text": torch.zeros(1, 11, dtype=torch.long),
                                "loss_mask": mask[None]}) for i, mask in enumerate(masks)]
    units = [KeyedMicrobatch(b.key, part) for b in read for part in split_into_slices(b.batch, 2)]
    mean = add_token_mean(units, read, group=None)
    assert mean.units == 6 and mean.global_tokens.item() == masks.sum().item()
    assert all(u.batch[TOKEN_MEAN] is mean for u in units)
    total, reported = 0.0, []
    for unit, loss in zip(units, [loss for loss in losses for _ in range(2)]):
        piece = unit.batch[SLICE]
        value, shown = piece.loss(loss[piece.start:piece.end], unit.batch["loss_mask"], mean)
        total = total + value / mean.units
        reported.append(shown)
    want = (losses * masks).sum() / masks.sum()
    # (a slice's sequence tokens are counted in float32: the divisor rounds to ~6e-8)
    assert torch.allclose(total, want, rtol=1e-6, atol=0)
    assert torch.allclose(torch.stack(reported).mean(), want, rtol=1e-6, atol=0)
    wrong = sum(p.batch[SLICE].loss(loss[:5], p.batch["loss_mask"])[0] / 6
                for p, loss in zip(units[0::2], losses))  # without the mean: sequence means
    assert not torch.allclose(wrong, want, rtol=1e-3, atol=0)


def test_microbatch_units_is_sequences_times_data_parallel_ranks():
    assert microbatch_units(4, 2) == 8
    with pytest.raises(ValueError, match="must be positive"):
        microbatch_units(0, 2)
