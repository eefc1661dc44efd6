"""--variable-seq-lengths: packed THD micro-batches through the GPT model equal each document run
alone; the dataset, the flags' refusals and the resume check (no processes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_chimera.config import ConfigError
from megatron_chimera.data.gpt_dataset import get_batch
from megatron_chimera.data.packed_dataset import MockDocuments, PackedDataset
from megatron_chimera.data.samplers import collate_samples
from megatron_chimera.model.document_attention import DocumentMask
from megatron_chimera.model.gpt2 import GPTModel
from megatron_chimera.training.arguments import parse_args
from megatron_chimera.training.data_order import check_data_order
from megatron_chimera.training.varlen import check_packing_resume, microbatch_tokens
from tests.helpers.models import small_config

pytestmark = pytest.mark.timeout(60)


def test_packed_dataset_samples_are_whole_documents_in_thd():
    docs = MockDocuments(40, 6, 21, 50, 0, seed=3)
    dataset = PackedDataset(docs, 20, num_samples=100)
    plan = dataset.plan
    assert len(dataset) == 100 and len(plan.micro_batches) < 40
    again = PackedDataset(MockDocuments(40, 6, 21, 50, 0, seed=3), 20, 100)
    assert again.plan.fingerprint() == plan.fingerprint()  # deterministic: resume is exact
    for index in (0, 5, len(plan.micro_batches) + 5):  # (the plan repeats past its end)
        mb = plan.micro_batches[index % len(plan.micro_batches)]
        sample = dataset[index]
        assert dataset.tokens(index) == mb.tokens <= 20
        for key in ("tokens", "labels", "loss_mask", "position_ids", "document_ids"):
            assert sample[key].shape == (mb.tokens,)
        start = 0
        for d, n in zip(mb.documents, mb.lengths):
            ids = docs[d]
            assert n == len(ids) - 1  # whole: every document fits the budget
            np.testing.assert_array_equal(sample["tokens"][start:start + n], ids[:-1])
            np.testing.assert_array_equal(sample["labels"][start:start + n], ids[1:])
            np.testing.assert_array_equal(sample["position_ids"][start:start + n], np.arange(n))
            start += n
    batch = collate_samples([dataset[1]])  # --micro-batch-size 1: one [1, T] row
    got = get_batch(batch)
    assert got.tokens.shape == (1, dataset.tokens(1)) and got.labels.dtype == torch.int64
    assert microbatch_tokens([batch, collate_samples([dataset[2]])]) == [dataset.tokens(1),
                                                                          dataset.tokens(2)]
    with pytest.raises(RuntimeError, match="micro-batch 1 was not read on this rank"):
        microbatch_tokens([batch, None])
    with pytest.raises(ConfigError, match="more than the micro-batch token budget 4"):
        PackedDataset(docs, 4, 10)
    assert PackedDataset(docs, 4, 10, overlong="truncate").plan.truncated
    padded = PackedDataset(docs, 20, 100, pad_multiple=4)  # (--sequence-parallel, T = 4)
    for index in range(6):
        sample, plain = padded[index], dataset[index]
        n, pad = len(plain["tokens"]), padded.tokens(index) - len(plain["tokens"])
        assert padded.tokens(index) % 4 == 0 and 0 <= pad < 4
        assert len(sample["tokens"]) == padded.tokens(index)
        for key in plain:
            np.testing.assert_array_equal(sample[key][:n], plain[key])
        assert not sample["loss_mask"][n:].any()  # never trained, a document of its own
        assert (sample["document_ids"][n:] == plain["document_ids"][-1] + 1).all()
    assert microbatch_tokens([collate_samples([padded[1]])], 4) == [padded.tokens(1) // 4]


def test_packed_documents_through_the_model_equal_each_document_alone():
    """One packed [1, T] row (per-document attention, restarting positions) gives every
    document's per-token losses and the summed gradients of running each document alone: no
    token attends or is positioned across a document boundary."""
    torch.manual_seed(0)
    config = small_config(seq_length=32, max_position_embeddings=32)
    model = GPTModel(config, seed=5)
    lengths = (7, 12, 1, 9)
    docs = [torch.randint(1, 100, (n + 1,)) for n in lengths]
    tokens = torch.cat([d[:-1] for d in docs])[None]
    labels = torch.cat([d[1:] for d in docs])[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    packed = model(tokens, positions, attention_mask=DocumentMask(ids), labels=labels)
    packed.sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    alone = [model(d[:-1][None], torch.arange(len(d) - 1)[None], labels=d[1:][None])
             for d in docs]
    torch.testing.assert_close(packed, torch.cat(alone, dim=1), rtol=1e-5, atol=1e-6)
    sum(a.sum() for a in alone).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)


FLAGS = ("--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 16 "
         "--max-position-embeddings 16 --train-iters 10 --lr 1e-3 --mock-data --vocab-size 64 "
         "--global-batch-size 4 ")


@pytest.mark.parametrize("extra,message", [
    ("--micro-batch-size 2", "does not run with --micro-batch-size 2"),
    ("--micro-batch-size 1 --micro-batch-tokens 32",
     "--micro-batch-tokens 32 exceeds the 16 learned positions"),
])
def test_flags_the_packed_micro_batches_do_not_run_with_are_refused(extra, message):
    with pytest.raises(ConfigError, match=message):
        parse_args((FLAGS + "--variable-seq-lengths " + extra).split(), world_size=2)
    with pytest.raises(ConfigError, match="need --variable-seq-lengths"):
        parse_args((FLAGS + "--micro-batch-size 1 --micro-batch-tokens 8").split(),
                   world_size=1)


def test_resuming_with_another_packing_is_refused():
    config = parse_args((FLAGS + "--micro-batch-size 1 --variable-seq-lengths "
                                 "--micro-batch-tokens 12").split(), world_size=1)
    same = {"data": {"variable_seq_lengths": True, "micro_batch_tokens": 12,
                     "overlong_documents": "error"}, "model": {"seq_length": 16},
            "training": {"global_batch_size": 4}}
    assert check_packing_resume(config, same, "ck") is None
    assert check_data_order(config, same, "ck") is None
    other = {**same, "data": {**same["data"], "micro_batch_tokens": None}}
    with pytest.raises(ConfigError, match=r"packed to 12 tokens, overlong documents: error, the "
                                          r"checkpoint's were packed to 16 tokens"):
        check_data_order(config, other, "ck")


NO_DROPOUT = "--hidden-dropout 0 --attention-dropout 0"


@pytest.mark.parametrize("extra,world,split,multiple", [
    ("", 1, 1, 1),
    ("--tensor-model-parallel-size 2 --sequence-parallel", 2, 2, 2),
    (f"{NO_DROPOUT} --context-parallel-size 2", 2, 2, 4),
    (f"{NO_DROPOUT} --context-parallel-size 2 --tensor-model-parallel-size 2 "
     "--sequence-parallel", 4, 4, 8),
])
def test_packed_rows_are_padded_for_the_sequence_and_context_splits(extra, world, split,
                                                                    multiple):
    """A packed row's message length is its tokens / (CP x T under SP); under CP the row is a
    multiple of 2 x CP (the per-document zigzag's chunks) times that."""
    from megatron_chimera.training.varlen import row_multiple, sequence_split

    config = parse_args((FLAGS + "--micro-batch-size 1 --variable-seq-lengths " + extra)
                        .split(), world_size=world)
    assert (sequence_split(config), row_multiple(config)) == (split, multiple)
