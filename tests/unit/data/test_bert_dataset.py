"""BERT dataset: samples mapping, masking proportions within statistical bounds, SOP pairs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron_chimera.data.bert_dataset import (
    BertDataset,
    BertTokens,
    MockBertDataset,
    build_samples_mapping,
    build_train_valid_test_datasets,
    get_bert_batch,
)
from megatron_chimera.data.indexed_dataset import IndexedDatasetBuilder, MMapIndexedDataset

pytestmark = pytest.mark.timeout(120)

PAD, UNK, CLS, SEP, MASK = 0, 1, 2, 3, 4
VOCAB = 100


def _sentence_corpus(tmp_path, num_docs=300, seed=0):
    """Documents of 2-5 sentences of 2-6 tokens drawn from the ordinary ids 5..VOCAB-1."""
    rng = np.random.default_rng(seed)
    prefix = str(tmp_path / "sent")
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    docs = []
    for _ in range(num_docs):
        doc = [rng.integers(5, VOCAB, size=rng.integers(2, 7)) for _ in range(rng.integers(2, 6))]
        for sentence in doc:
            builder.add_item(sentence)
        builder.end_document()
        docs.append(doc)
    builder.finalize(prefix + ".idx")
    return prefix, MMapIndexedDataset(prefix), docs


def test_samples_mapping_covers_documents(tmp_path):
    _, indexed, docs = _sentence_corpus(tmp_path, num_docs=50)
    mapping = build_samples_mapping(indexed.sequence_lengths, indexed.document_indices,
                                    range(50), num_samples=60, max_num_tokens=8,
                                    short_seq_prob=0.2, seed=3, binary_head=True)
    assert len(mapping) >= 60
    starts = indexed.document_indices
    doc_of = np.searchsorted(starts, mapping[:, 0], side="right") - 1
    assert np.all(mapping[:, 1] <= starts[doc_of + 1])  # a span never crosses documents
    assert np.all(mapping[:, 1] - mapping[:, 0] >= 2)  # two sentences at least (binary head)
    assert np.all((mapping[:, 2] >= 2) & (mapping[:, 2] <= 8))
    # each epoch's spans tile every document exactly
    per_doc: dict[int, list[tuple[int, int]]] = {}
    for (s, e, _), d in zip(mapping.tolist(), doc_of.tolist()):
        per_doc.setdefault(d, []).append((s, e))
    for d, spans in per_doc.items():
        covered = np.zeros(starts[d + 1] - starts[d], dtype=int)
        for s, e in spans:
            covered[s - starts[d] : e - starts[d]] += 1
        assert len(set(covered.tolist())) == 1  # every sentence used the same number of times
    again = build_samples_mapping(indexed.sequence_lengths, indexed.document_indices, range(50),
                                  60, 8, 0.2, 3, True)
    np.testing.assert_array_equal(mapping, again)


def _restore(sample):
    """The tokens before masking: masked positions take their label back."""
    text = sample["text"].copy()
    masked = sample["loss_mask"] == 1
    text[masked] = sample["labels"][masked]
    return text


def test_masking_and_sentence_order(tmp_path):
    prefix, indexed, _ = _sentence_corpus(tmp_path, num_docs=1000)
    seq_length = 40  # > the longest document + 3: no truncation
    ds = BertDataset("train", prefix, indexed, range(1000), 1000, seq_length, seed=11,
                     vocab_size=VOCAB, cls_id=CLS, sep_id=SEP, mask_id=MASK, pad_id=PAD,
                     short_seq_prob=0.0, cache_dir=str(tmp_path))
    shown = {"mask": 0, "kept": 0, "other": 0}
    n_tokens = n_masked = n_random = 0
    for k in range(len(ds)):
        s = ds[k]
        start, end, _ = ds.samples_mapping[k]
        sentences = [indexed[i].tolist() for i in range(start, end)]
        n = int(s["padding_mask"].sum())
        original = _restore(s)[:n].tolist()
        # [CLS] A [SEP] B [SEP], types 0 then 1, padding after
        assert original[0] == CLS and original[-1] == SEP and original.count(SEP) == 2
        first_sep = original.index(SEP)
        a, b = original[1:first_sep], original[first_sep + 1 : -1]
        assert a and b
        assert s["types"][:n].tolist() == [0] * (first_sep + 1) + [1] * (len(b) + 1)
        assert np.all(s["text"][n:] == PAD) and np.all(s["padding_mask"][n:] == 0)
        flat = [t for sent in sentences for t in sent]
        cuts = np.cumsum([len(x) for x in sentences])[:-1].tolist()
        if s["is_random"]:
            assert b + a == flat and len(b) in cuts  # swapped at a sentence boundary
        else:
            assert a + b == flat and len(a) in cuts
        n_random += s["is_random"]
        # labels: -1 exactly where not masked; no special token is ever masked
        masked = s["loss_mask"] == 1
        assert np.all(s["labels"][~masked] == -1) and np.all(s["labels"][masked] >= 5)
        n_tokens += n
        n_masked += int(masked.sum())
        for pos in np.flatnonzero(masked):
            if s["text"][pos] == MASK:
                shown["mask"] += 1
            elif s["text"][pos] == s["labels"][pos]:
                shown["kept"] += 1
            else:
                shown["other"] += 1
    total = len(ds)

    def within(count, n, p, sigmas=5.0):
        return abs(count - n * p) <= sigmas * math.sqrt(n * p * (1 - p)) + 1

    assert within(n_random, total, 0.5)
    # 15% of the tokens ([CLS]/[SEP] included, as Megatron counts), rounded per sample (<= 0.5);
    # an n-gram that does not fit can leave a sample short (test_data_bert_masking.py)
    assert abs(n_masked - 0.15 * n_tokens) <= 0.5 * total
    # a random replacement can draw [MASK] or the original id (1/VOCAB each)
    assert within(shown["mask"], n_masked, 0.8 + 0.1 / VOCAB)
    assert within(shown["kept"], n_masked, 0.1 + 0.1 / VOCAB)
    assert within(shown["other"], n_masked, 0.1 * (VOCAB - 2) / VOCAB)
    # deterministic: the same index gives the same sample
    np.testing.assert_array_equal(ds[5]["text"], ds[5]["text"])


def test_truncation_respects_seq_length(tmp_path):
    prefix, indexed, _ = _sentence_corpus(tmp_path, num_docs=60)
    ds = BertDataset("train", prefix, indexed, range(60), 100, 12, seed=1, vocab_size=VOCAB,
                     cls_id=CLS, sep_id=SEP, mask_id=MASK, pad_id=PAD, cache_dir=str(tmp_path))
    truncated = 0
    for k in range(len(ds)):
        s = ds[k]
        assert all(s[f].shape == (12,) for f in ("text", "types", "labels", "loss_mask",
                                                 "padding_mask"))
        assert int(s["padding_mask"].sum()) <= 12
        truncated += s["truncated"]
    assert truncated > 0


def test_splits_and_batch(tmp_path):
    prefix, _, _ = _sentence_corpus(tmp_path, num_docs=100)
    train, valid, test = build_train_valid_test_datasets(
        [prefix], "80,20,0", [50, 10, 0], seq_length=24, seed=2,
        tokens=BertTokens(VOCAB, CLS, SEP, MASK, PAD), cache_dir=str(tmp_path))
    assert test is None and len(train) >= 50 and len(valid) >= 10
    assert np.all(train.samples_mapping[:, 0] < 100 * 5)
    from megatron_chimera.data.samplers import collate_samples

    batch = collate_samples([train[0], train[1]])
    tokens, types, order, loss_mask, labels, padding = get_bert_batch(batch)
    assert tokens.shape == (2, 24) and order.shape == (2,) and loss_mask.dtype == torch.float32


def test_mock_bert():
    ds = MockBertDataset("train", 20, 16, VOCAB, CLS, SEP, MASK, PAD, seed=4)
    a, b = ds[3], MockBertDataset("train", 20, 16, VOCAB, CLS, SEP, MASK, PAD, seed=4)[3]
    for key in ("text", "types", "labels", "loss_mask", "padding_mask"):
        np.testing.assert_array_equal(a[key], b[key])
        assert a[key].shape == (16,)
    assert a["loss_mask"].sum() >= 1 and a["text"][0] == CLS


def test_no_usable_documents_is_a_clear_error(tmp_path):
    prefix = str(tmp_path / "single")
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for _ in range(5):  # one sentence per document: nothing to pair
        builder.add_item(np.arange(5, 12))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    with pytest.raises(ValueError, match=r"single \(train split\).*documents \[0, 5\).*--split"):
        BertDataset("train", prefix, MMapIndexedDataset(prefix), range(5), 10, 16, seed=0,
                    vocab_size=VOCAB, cls_id=CLS, sep_id=SEP, mask_id=MASK, pad_id=PAD,
                    cache_dir=str(tmp_path))


def test_documents_without_sentence_splits_are_a_one_line_user_error():
    """One sentence per document (a corpus preprocessed without --split-sentences) cannot give
    BERT's sentence pairs: a UserError (one line, no traceback), naming the fix."""
    import numpy as np

    from megatron_chimera.errors import UserError

    sizes = np.full(4, 20, dtype=np.int32)  # 4 documents of one 20-token sentence each
    document_indices = np.arange(5, dtype=np.int64)
    with pytest.raises(UserError, match="--split-sentences"):
        build_samples_mapping(sizes, document_indices, range(4), 10, 30, 0.1, 1234, True)
