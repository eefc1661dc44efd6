"""The variable-length packer against literal next-fit/first-fit references; THD fields; resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_chimera.data.packing import (
    PackedMicroBatch,
    input_lengths,
    pack_documents,
    packed_fields,
)
from megatron_chimera.model.document_attention import DocumentMask

pytestmark = pytest.mark.timeout(60)


def _next_fit(lengths, budget):
    """Next-fit written out: start a new micro-batch whenever the document does not fit."""
    bins, current, used = [], [], 0
    for i, n in enumerate(lengths):
        if current and used + n > budget:
            bins.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        bins.append(current)
    return bins


def _first_fit(lengths, budget):
    """Classic first-fit over every bin ever opened."""
    bins, room = [], []
    for i, n in enumerate(lengths):
        for k in range(len(bins)):
            if room[k] >= n:
                bins[k].append(i)
                room[k] -= n
                break
        else:
            bins.append([i])
            room.append(budget - n)
    return bins


def _lognormal_lengths(seed, count=300, budget=512):
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(60), 1.0, count).astype(np.int64), 1, budget)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_next_fit_and_first_fit_match_the_references(seed):
    lengths = _lognormal_lengths(seed)
    plan = pack_documents(lengths, 512, open_bins=1)
    assert [list(mb.documents) for mb in plan.micro_batches] == _next_fit(lengths.tolist(), 512)
    plan = pack_documents(lengths, 512, open_bins=len(lengths))
    assert [list(mb.documents) for mb in plan.micro_batches] == _first_fit(lengths.tolist(), 512)


@pytest.mark.parametrize("open_bins", [1, 4])
def test_every_document_whole_once_in_stream_order_within_budget(open_bins):
    lengths = _lognormal_lengths(3)
    plan = pack_documents(lengths, 512, open_bins=open_bins)
    seen = [d for mb in plan.micro_batches for d in mb.documents]
    assert sorted(seen) == list(range(len(lengths)))
    for mb in plan.micro_batches:
        assert 0 < mb.tokens <= 512
        assert list(mb.documents) == sorted(mb.documents)
        assert list(mb.lengths) == [int(lengths[d]) for d in mb.documents]
    # a window of open micro-batches packs tighter than next-fit on this mix
    if open_bins > 1:
        assert len(plan.micro_batches) < len(pack_documents(lengths, 512).micro_batches)


def test_overlong_documents_error_truncate_or_skip():
    lengths = [5, 12, 3, 0, 9]
    with pytest.raises(ValueError, match=r"document 1 has 12 input tokens, more than the "
                                         r"micro-batch token budget 10"):
        pack_documents(lengths, 10)
    plan = pack_documents(lengths, 10, overlong="truncate")
    assert plan.truncated == (1,) and plan.skipped == (3,)
    assert [mb.lengths for mb in plan.micro_batches] == [(5,), (10,), (3,), (9,)]
    plan = pack_documents(lengths, 10, overlong="skip")
    assert plan.truncated == () and plan.skipped == (1, 3)
    assert [mb.documents for mb in plan.micro_batches] == [(0, 2), (4,)]
    with pytest.raises(ValueError, match="overlong must be one of"):
        pack_documents(lengths, 10, overlong="split")
    with pytest.raises(ValueError, match="budget must be positive"):
        pack_documents(lengths, 0)


def test_input_lengths_count_predictions():
    assert input_lengths([1, 2, 7, 0]).tolist() == [0, 1, 6, 0]


def test_positions_restart_and_cu_seqlens_match_the_document_mask():
    mb = PackedMicroBatch(documents=(4, 7, 9), lengths=(3, 1, 4))
    assert mb.cu_seqlens().tolist() == [0, 3, 4, 8]
    assert mb.position_ids().tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    assert mb.document_ids().tolist() == [0, 0, 0, 1, 2, 2, 2, 2]
    # the model's document attention sees the same documents the packer made
    mask = DocumentMask(torch.from_numpy(mb.document_ids())[None])
    assert mask.cu_seqlens(torch.device("cpu")).tolist() == mb.cu_seqlens().tolist()


def test_packed_fields_never_predict_across_documents():
    documents = [np.arange(100, 106), np.arange(200, 203), np.arange(300, 320)]
    masks = [np.array([0, 0, 1, 1, 1, 1]), np.array([0, 1, 1]), np.ones(20)]
    plan = pack_documents(input_lengths([len(d) for d in documents]), 8, overlong="truncate")
    assert plan.truncated == (2,)
    first = packed_fields(plan.micro_batches[0], documents, masks)
    # documents 0 and 1 together (5 + 2 positions); each label is its own document's next token
    assert first["tokens"].tolist() == [100, 101, 102, 103, 104, 200, 201]
    assert first["labels"].tolist() == [101, 102, 103, 104, 105, 201, 202]
    assert first["loss_mask"].tolist() == [0, 1, 1, 1, 1, 1, 1]
    assert first["position_ids"].tolist() == [0, 1, 2, 3, 4, 0, 1]
    assert first["cu_seqlens"].tolist() == [0, 5, 7]
    second = packed_fields(plan.micro_batches[1], documents)
    assert second["tokens"].tolist() == list(range(300, 308))
    assert second["labels"].tolist() == list(range(301, 309))
    assert second["loss_mask"].tolist() == [1.0] * 8
    with pytest.raises(ValueError, match="loss mask has 3 entries for 6 token ids"):
        packed_fields(plan.micro_batches[0], documents, [masks[1]] * 3)


def test_packing_is_deterministic_and_resume_refuses_another_plan():
    lengths = _lognormal_lengths(4)
    plan = pack_documents(lengths, 512, open_bins=4)
    again = pack_documents(lengths.copy(), 512, open_bins=4)
    assert again == plan and again.fingerprint() == plan.fingerprint()
    state = plan.state_dict(consumed=5)
    assert again.resume(state) == plan.micro_batches[5:]
    other = pack_documents(lengths, 256, overlong="truncate", open_bins=4)
    with pytest.raises(ValueError, match="budget 512 then, 256 now"):
        other.resume(state)
    reordered = pack_documents(lengths[::-1], 512, open_bins=4)
    with pytest.raises(ValueError, match="resuming would train different data"):
        reordered.resume(state)
    with pytest.raises(ValueError, match="outside the plan"):
        plan.state_dict(consumed=len(plan.micro_batches) + 1)


def test_iterations_split_the_plan_over_data_parallel_ranks_without_overlap():
    plan = pack_documents(_lognormal_lengths(5), 512, open_bins=2)
    n, dp = 3, 2
    iterations = len(plan.micro_batches) // (n * dp)
    taken = [mb for i in range(iterations) for r in range(dp)
             for mb in plan.iteration(i, n, dp, r)]
    assert taken == list(plan.micro_batches[:iterations * n * dp])
    assert plan.iteration(1, n, dp, 1) == plan.micro_batches[9:12]
    assert [mb.tokens for mb in plan.iteration(0, n)] == [mb.tokens
                                                          for mb in plan.micro_batches[:3]]
    with pytest.raises(ValueError, match=f"cover {iterations} iterations"):
        plan.iteration(iterations, n, dp, 0)
    with pytest.raises(ValueError, match="data-parallel rank 2 of 2"):
        plan.iteration(0, n, dp, 2)
