"""--sft samples: whole conversations packed into --seq-length, each one's inputs, labels, loss
mask and positions exactly those of the conversation alone; overlong conversations refused,
truncated or skipped and counted; the flag checks' one-line errors."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_chimera.config import ConfigError
from megatron_chimera.data.indexed_dataset import MMapIndexedDataset
from megatron_chimera.data.packed_dataset import PackedDataset
from megatron_chimera.data.samplers import batch_tokens
from megatron_chimera.data.sft_dataset import build_sft_datasets, check_sft_data
from megatron_chimera.training.arguments import parse_args
from megatron_chimera.training.sft_reference import write_sft_dataset
from megatron_chimera.training.training import build_tokenizer_for
from megatron_chimera.training.varlen import packed_datasets

SEQ, EOD = 24, 99


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    return write_sft_dataset(str(tmp_path_factory.mktemp("sft") / "chat"), 30, 90, (2, 20))


def test_every_packed_conversation_equals_it_alone(data_path, capsys):
    train, valid, _ = build_sft_datasets(data_path, "80,20,0", [40, 3, 0], SEQ, 5, EOD)
    text = MMapIndexedDataset(data_path)
    masks = MMapIndexedDataset(data_path.replace("_text_", "_loss_mask_"))
    assert len(train) == 40 and len(valid) == 3
    seen = set()
    for i in range(len(train)):
        sample, (docs, lengths) = train[i], train.samples[i]
        assert sample["text"].shape == (SEQ + 1,) and sample["loss_mask"].shape == (SEQ,)
        assert len(set(docs)) == len(docs) and all(d < 24 for d in docs)  # the train split
        seen.update(docs)
        start = 0
        for k, (doc, n) in enumerate(zip(docs, lengths)):
            ids, mask = text[doc], masks[doc]
            assert n == len(ids)  # whole
            end = start + n
            assert np.array_equal(sample["text"][start:end], ids)
            assert np.array_equal(sample["loss_mask"][start:end - 1], mask[1:])
            assert sample["loss_mask"][end - 1] == 0  # never predicts the next conversation
            assert np.array_equal(sample["position_ids"][start:end], np.arange(n))
            assert (sample["document_ids"][start:end] == k).all()
            start = end
        assert (sample["loss_mask"][start:] == 0).all()  # padding
        assert (sample["text"][start:] == EOD).all()
        assert (sample["document_ids"][start:] == len(docs)).all()
    assert seen == set(range(24))  # every training conversation is used
    # tokens per second counts the conversations' positions, not the padding
    assert batch_tokens(train, 0, 40) == sum(sum(n) for _, n in train.samples) < 40 * SEQ
    assert "truncated" not in capsys.readouterr().out


def test_overlong_conversations_error_truncate_or_skip(data_path, capsys):
    with pytest.raises(ConfigError, match=r"--sft train split: conversation \d+ has \d+ tokens, "
                                          r"more than --seq-length 8 \(--sft-overlong"):
        build_sft_datasets(data_path, "100,0,0", [4, 0, 0], 8, 5, EOD)
    lengths = MMapIndexedDataset(data_path).sequence_lengths
    over = int((lengths > 8).sum())
    skip = build_sft_datasets(data_path, "100,0,0", [4, 0, 0], 8, 5, EOD, "skip")[0]
    assert f"--sft train: 0 of 30 conversations truncated, {over} skipped" in \
        capsys.readouterr().out
    assert all(lengths[d] <= 8 for docs, _ in skip.samples for d in docs)
    cut = build_sft_datasets(data_path, "100,0,0", [60, 0, 0], 8, 5, EOD, "truncate")[0]
    assert f"{over} of 30 conversations truncated, 0 skipped" in capsys.readouterr().out
    assert max(n for _, ns in cut.samples for n in ns) == 8


def test_sft_flag_checks(data_path, tmp_path):
    base = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
            "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
            "--lr", "1e-3", "--train-iters", "1", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "90", "--sft"]
    config = parse_args([*base, "--data-path", data_path], world_size=1)
    assert config.data.reset_attention_mask and config.data.reset_position_ids
    assert config.training.calculate_per_token_loss
    with pytest.raises(ConfigError, match="--mock-data has no loss masks"):
        parse_args([*base, "--mock-data"], world_size=1)
    with pytest.raises(ConfigError, match="blends are not supported"):
        check_sft_data(["1", data_path, "1", data_path], [], False)
    with pytest.raises(ConfigError, match="is not a preprocess_data.py --sft output"):
        check_sft_data([str(tmp_path / "plain_document")], [], False)
    lone = tmp_path / "lone_text_document"
    for suffix in (".bin", ".idx"):  # a text dataset without its loss mask
        (tmp_path / f"lone_text_document{suffix}").write_bytes(
            open(data_path + suffix, "rb").read())
    with pytest.raises(ConfigError, match=r"no loss mask dataset .*lone_loss_mask_document"):
        check_sft_data([str(lone)], [], False)


def test_packed_variable_length_sft_carries_each_conversations_loss_mask(data_path):
    """--sft --variable-seq-lengths: conversations packed whole, in stream order, into
    micro-batches of at most --micro-batch-tokens inputs; every label trained exactly where the
    conversation's own mask says; the packed token count leaves the row padding out."""
    flags = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
             "--seq-length", "24", "--max-position-embeddings", "24", "--micro-batch-size", "1",
             "--lr", "1e-3", "--train-iters", "1", "--tokenizer-type", "NullTokenizer",
             "--vocab-size", "90", "--sft", "--data-path", data_path, "--split", "100,0,0",
             "--variable-seq-lengths", "--micro-batch-tokens", "20"]
    tokenizer, config = build_tokenizer_for(parse_args(flags, world_size=1))
    dataset = packed_datasets(config, tokenizer, [12, 0, 0], log=False)[0]
    text = MMapIndexedDataset(data_path)
    masks = MMapIndexedDataset(data_path.replace("_text_", "_loss_mask_"))
    plan = dataset.plan.micro_batches
    assert [d for mb in plan for d in mb.documents] == list(range(30))  # stream order, whole
    for index in range(12):
        sample, mb = dataset[index], plan[index % len(plan)]
        assert len(sample["tokens"]) == mb.tokens <= 20
        start = 0
        for doc, n in zip(mb.documents, mb.lengths):
            assert n == len(text[doc]) - 1
            assert np.array_equal(sample["labels"][start:start + n], text[doc][1:])
            assert np.array_equal(sample["loss_mask"][start:start + n], masks[doc][1:])
            start += n
    assert 0 < sum(dataset[i]["loss_mask"].sum() for i in range(12)) < sum(
        dataset.tokens(i) for i in range(12))  # the prompts are not trained
    padded = PackedDataset(dataset.documents, 20, 12, pad_multiple=8,
                           loss_masks=dataset.loss_masks)  # (--sequence-parallel, T = 8)
    assert batch_tokens(padded, 2, 5) == batch_tokens(dataset, 2, 5) == sum(
        plan[i].tokens for i in range(2, 7)) < sum(padded.tokens(i) for i in range(2, 7))
    with pytest.raises(ConfigError, match="does not run with --sft-overlong truncate"):
        parse_args([*flags, "--sft-overlong", "truncate"], world_size=1)
