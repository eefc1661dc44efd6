"""tools/preprocess_data.py end to end with every tokenizer type; workers and partitions agree."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_chimera.data.indexed_dataset import MMapIndexedDataset
from megatron_chimera.data.sentence_splitter import split_sentences
from megatron_chimera.data.tokenizers import build_tokenizer
from megatron_chimera.errors import UsageError
from tests.helpers import REPO_ROOT
from tests.helpers.tokenizer_files import (
    TEXTS,
    train_sentencepiece,
    write_gpt2_files,
    write_wordpiece_vocab,
)

pytestmark = pytest.mark.timeout(120)

ROOT = str(REPO_ROOT)
TOOL = os.path.join(ROOT, "tools", "preprocess_data.py")


def _load_tool():
    spec = importlib.util.spec_from_file_location("preprocess_data_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # the worker pool pickles functions by module name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tool():
    return _load_tool()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    vocab, merges, _ = write_gpt2_files(str(d))
    docs = TEXTS * 3 + ["", "Trailing doc. Two sentences here!"]
    corpus = d / "corpus.jsonl"
    with open(corpus, "w") as f:
        for i, text in enumerate(docs):
            f.write(json.dumps({"text": text, "title": f"doc {i}"}) + "\n")
    numbers = d / "numbers.jsonl"
    with open(numbers, "w") as f:
        for i in range(len(docs)):
            f.write(json.dumps({"text": " ".join(str((i * 7 + j) % 50) for j in range(i % 9)),
                                "title": str(i)}) + "\n")
    spm = train_sentencepiece(str(d))
    return {
        "corpus": str(corpus), "numbers": str(numbers), "docs": docs,
        "GPT2BPETokenizer": ["--vocab-file", vocab, "--merge-file", merges],
        "BertWordPieceLowerCase": ["--vocab-file", write_wordpiece_vocab(str(d))],
        "BertWordPieceCase": ["--vocab-file", write_wordpiece_vocab(str(d))],
        "SentencePieceTokenizer": ["--tokenizer-model", spm],
        "GPTSentencePieceTokenizer": ["--tokenizer-model", spm],
        "NullTokenizer": ["--vocab-size", "50"],
    }


def _tokenizer(files, kind):
    opts = dict(zip(files[kind][0::2], files[kind][1::2]))
    return build_tokenizer(kind, tokenizer_model=opts.get("--tokenizer-model"),
                           vocab_file=opts.get("--vocab-file"),
                           merge_file=opts.get("--merge-file"),
                           vocab_size=int(opts["--vocab-size"]) if "--vocab-size" in opts else None)


def _read(prefix):
    ds = MMapIndexedDataset(prefix)
    return ds, open(prefix + ".bin", "rb").read(), open(prefix + ".idx", "rb").read()


KINDS = ["GPT2BPETokenizer", "BertWordPieceLowerCase", "BertWordPieceCase",
         "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "NullTokenizer"]


@pytest.mark.parametrize("kind", KINDS)
def test_documents_match_the_tokenizer(tool, files, tmp_path, kind, capsys):
    source = files["numbers" if kind == "NullTokenizer" else "corpus"]
    out = str(tmp_path / "out")
    tool.main(["--input", source, "--output-prefix", out, "--tokenizer-type", kind,
               *files[kind], "--append-eod", "--workers", "1", "--log-interval", "5",
               "--json-keys", "text", "title"])
    assert "Processed 5 documents (" in capsys.readouterr().err
    tok = _tokenizer(files, kind)
    texts = [json.loads(line) for line in open(source)]
    for key in ("text", "title"):
        ds, _, _ = _read(f"{out}_{key}_document")
        assert ds.dtype == np.uint16
        docs = [ds.get_document(d) for d in range(ds.num_documents)]
        assert len(docs) == len(texts)
        for record, doc in zip(texts, docs):
            expected = tok.tokenize(record[key])
            if not expected:  # an empty document has no sequence (and no eod)
                assert doc == []
                continue
            assert len(doc) == 1 and doc[0].tolist() == expected + [tok.eod]


def test_sentence_split(tool, files, tmp_path):
    out = str(tmp_path / "ss")
    kind = "SentencePieceTokenizer"
    tool.main(["--input", files["corpus"], "--output-prefix", out, "--tokenizer-type", kind,
               *files[kind], "--split-sentences", "--workers", "1"])
    ds, _, _ = _read(f"{out}_text_sentence")
    tok = _tokenizer(files, kind)
    for d, text in enumerate(files["docs"]):
        expected = [tok.tokenize(s) for s in split_sentences(text)]
        assert [s.tolist() for s in ds.get_document(d)] == [e for e in expected if e]
    assert ds.num_documents == len(files["docs"])
    assert len(ds) > ds.num_documents  # sentences, not documents


@pytest.mark.parametrize("kind,extra", [
    ("GPT2BPETokenizer", ["--append-eod"]),
    ("BertWordPieceLowerCase", ["--split-sentences"]),
])
def test_workers_give_identical_output(tool, files, tmp_path, kind, extra, monkeypatch):
    monkeypatch.setattr(tool, "CHUNK_LINES", 2)  # many chunks, so both workers get some
    level = "sentence" if "--split-sentences" in extra else "document"
    outputs = []
    for workers in (1, 2):
        out = str(tmp_path / f"w{workers}")
        args = ["--input", files["corpus"], "--output-prefix", out, "--tokenizer-type", kind,
                *files[kind], *extra, "--workers", str(workers)]
        tool.main(args)  # workers=2 runs a real process pool
        outputs.append(_read(f"{out}_text_{level}")[1:])
    assert outputs[0] == outputs[1]


def test_partitions(tool, files, tmp_path):
    kind = "NullTokenizer"
    base = ["--input", files["numbers"], "--tokenizer-type", kind, *files[kind], "--workers", "1"]
    tool.main([*base, "--output-prefix", str(tmp_path / "one")])
    tool.main([*base, "--output-prefix", str(tmp_path / "seq"), "--partitions", "3",
               "--keep-sequential-samples"])
    tool.main([*base, "--output-prefix", str(tmp_path / "rr"), "--partitions", "3"])
    one = _read(str(tmp_path / "one_text_document"))
    assert _read(str(tmp_path / "seq_text_document"))[1:] == one[1:]
    rr = _read(str(tmp_path / "rr_text_document"))[0]
    n = one[0].num_documents
    order = [i for p in range(3) for i in range(p, n, 3)]  # round robin, then merged in order
    for d, original in enumerate(order):
        got = [s.tolist() for s in rr.get_document(d)]
        assert got == [s.tolist() for s in one[0].get_document(original)]
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".partitions")]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_bad_input_errors(tool, files, tmp_path, workers, monkeypatch):
    monkeypatch.setattr(tool, "CHUNK_LINES", 1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "1 2"}\n\n{"text": "1"}\n{"body": "3"}\n{"text": "4"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:4: json key 'text'"):
        tool.main(["--input", str(bad), "--output-prefix", str(tmp_path / "x"),
                   "--tokenizer-type", "NullTokenizer", "--vocab-size", "9", "--workers", workers])
    assert not [f for f in os.listdir(tmp_path) if f.startswith("x_")]
    with pytest.raises(ValueError, match=r"corpus\.jsonl:1: json key 'text' cannot be tokenized"):
        tool.main(["--input", files["corpus"], "--output-prefix", str(tmp_path / "y"),
                   "--tokenizer-type", "NullTokenizer", "--vocab-size", "9", "--workers", workers])
    with pytest.raises(UsageError, match="no such file"):  # one line via run_tool
        tool.main(["--input", str(tmp_path / "none.jsonl"), "--output-prefix", "x",
                   "--tokenizer-type", "NullTokenizer", "--vocab-size", "9", "--workers", "1"])


def test_merge_datasets_tool(tool, files, tmp_path):
    kind = "NullTokenizer"
    for name in ("a", "b"):
        tool.main(["--input", files["numbers"], "--output-prefix", str(tmp_path / name),
                   "--tokenizer-type", kind, *files[kind], "--workers", "1"])
    merged = str(tmp_path / "merged")
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "merge_datasets.py"),
                    "--input", str(tmp_path), "--output-prefix", merged], check=True,
                   capture_output=True, timeout=60)
    ds = MMapIndexedDataset(merged)
    a = MMapIndexedDataset(str(tmp_path / "a_text_document"))
    assert ds.num_documents == 2 * a.num_documents
    assert [x.tolist() for x in ds[: len(a)]] == [x.tolist() for x in a[:]]


def test_sentence_splitter_rules():
    text = ('Mr. Smith met Dr. J. Watson at 5 p.m. on Baker St. yesterday. "Really?" she asked! '
            "It rained.\nThen it stopped.\n\nnew paragraph without capitals\nand more")
    assert split_sentences(text) == [
        "Mr. Smith met Dr. J. Watson at 5 p.m. on Baker St. yesterday.",
        '"Really?" she asked!',
        "It rained.",
        "Then it stopped.",
        "new paragraph without capitals and more",
    ]
    kept = split_sentences("One here.\nTwo there.\n\nThree", keep_newlines=True)
    assert kept == ["One here.\n", "Two there.\n\n", "Three"]
    assert split_sentences("   \n\n ") == []


def test_a_failed_run_in_process_gives_ctrl_c_back(tool, tmp_path):
    """An error with a worker pool must not leave SIGINT ignored in the calling process (its
    later children would inherit SIG_IGN and never see a Ctrl-C)."""
    import signal

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "1 2"}\n{not json\n')
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(Exception):  # noqa: B017 - the one-line error type is tested elsewhere
        tool.main(["--input", str(bad), "--output-prefix", str(tmp_path / "x"),
                   "--tokenizer-type", "NullTokenizer", "--vocab-size", "9", "--workers", "2"])
    assert signal.getsignal(signal.SIGINT) is before
