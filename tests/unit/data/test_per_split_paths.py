"""--train-data-path / --valid-data-path / --test-data-path: each split from its own files (a
prefix or a weighted blend), the same datasets --data-path would build from that file alone;
exclusive with --data-path and --split; a missing file is one error naming the flag."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_chimera.config import ConfigError
from megatron_chimera.data import bert_dataset, gpt_dataset
from megatron_chimera.data.blended_dataset import BlendedDataset
from megatron_chimera.training.arguments import parse_args

from .test_bert_dataset import CLS, MASK, PAD, SEP, VOCAB, _sentence_corpus
from .test_gpt_dataset import _corpus

pytestmark = pytest.mark.timeout(120)


def texts(dataset) -> list[list[int]]:
    return [dataset[k]["text"].tolist() for k in range(len(dataset))]


def test_gpt_splits_come_from_their_own_files(tmp_path):
    a, _ = _corpus(tmp_path, [10 + i % 7 for i in range(40)], "a", start=0)
    b, _ = _corpus(tmp_path, [12] * 30, "b", start=10_000)
    c, _ = _corpus(tmp_path, [9] * 30, "c", start=20_000)
    cache = str(tmp_path / "cache")
    train, valid, test = gpt_dataset.build_train_valid_test_datasets(
        None, "unused", [30, 6, 8], seq_length=8, seed=3, cache_dir=cache,
        split_paths=([a], [b], ["1", b, "3", c]))
    # train: every document of a -- the dataset --data-path a --split 1,0,0 gives
    alone, _, _ = gpt_dataset.build_train_valid_test_datasets(
        [a], "1,0,0", [30, 0, 0], seq_length=8, seed=3, cache_dir=cache)
    assert texts(train) == texts(alone)
    # valid: every document of b under the name valid (--data-path b --split 0,1,0)
    _, b_valid, _ = gpt_dataset.build_train_valid_test_datasets(
        [b], "0,1,0", [0, 6, 0], seq_length=8, seed=3, cache_dir=cache)
    assert texts(valid) == texts(b_valid) and all(10_000 <= t[0] < 20_000 for t in texts(valid))
    # test: a 1:3 blend of b and c
    assert isinstance(test, BlendedDataset) and len(test) == 8
    assert sum(t[0] >= 20_000 for t in texts(test)) == 6
    # a split without a path, or without samples, is None
    none = gpt_dataset.build_train_valid_test_datasets(
        None, "unused", [30, 0, 8], seq_length=8, seed=3, cache_dir=cache,
        split_paths=([a], [b], None))
    assert none[1] is None and none[2] is None and texts(none[0]) == texts(alone)


def test_bert_splits_come_from_their_own_files(tmp_path):
    prefix, _, _ = _sentence_corpus(tmp_path, num_docs=60)
    common = dict(seq_length=24, seed=2, tokens=bert_dataset.BertTokens(VOCAB, CLS, SEP, MASK, PAD),
                  cache_dir=str(tmp_path))
    train, valid, test = bert_dataset.build_train_valid_test_datasets(
        None, "unused", [20, 5, 0], split_paths=([prefix], [prefix], None), **common)
    alone, _, _ = bert_dataset.build_train_valid_test_datasets([prefix], "1,0,0", [20, 0, 0],
                                                               **common)
    assert test is None and len(valid) >= 5
    assert np.array_equal(train.samples_mapping, alone.samples_mapping)


BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 1 --lr 1e-3 --train-iters 2 --tokenizer-type NullTokenizer "
        "--vocab-size 100").split()


def test_flags(tmp_path):
    a, _ = _corpus(tmp_path, [10] * 5, "a")
    b, _ = _corpus(tmp_path, [10] * 5, "b")
    config = parse_args([*BASE, "--train-data-path", a, "--valid-data-path", "2", a, "1", b],
                        world_size=1)
    assert config.data.split_data_paths == ((a,), ("2", a, "1", b), None)
    assert config.data.data_path is None
    assert parse_args([*BASE, "--data-path", a], world_size=1).data.split_data_paths is None


@pytest.mark.parametrize("extra,message", [
    (["--train-data-path", "{a}", "--data-path", "{a}"],
     "--train-data-path and --data-path are mutually exclusive"),
    (["--valid-data-path", "{a}", "--split", "1,0,0"], "--split applies to --data-path"),
    (["--train-data-path", "{a}", "--test-data-path", "{missing}"],
     "--test-data-path: {missing}.bin does not exist"),
    (["--valid-data-path", "1", "{a}", "1", "{missing}"],
     "--valid-data-path: {missing}.bin does not exist"),
    (["--train-data-path", "x", "{a}"], "--train-data-path: weight 'x'"),
    (["--train-data-path", "1", "{a}", "2"], "--train-data-path takes one prefix"),
    (["--train-data-path"], "--train-data-path is empty"),
])
def test_errors_name_the_flag(tmp_path, extra, message):
    a, _ = _corpus(tmp_path, [10] * 5, "a")
    names = {"a": a, "missing": str(tmp_path / "missing")}
    with pytest.raises(ConfigError) as info:
        parse_args([*BASE, *(e.format(**names) for e in extra)], world_size=1)
    assert message.format(**names) in str(info.value) and "\n" not in str(info.value)
