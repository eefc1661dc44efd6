"""tools/preprocess_data.py --sft: instruction records to ids + loss-mask datasets equal to
data/instruction.py's encoding of each record; overlong records counted; bad lines named."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_chimera.data.indexed_dataset import MMapIndexedDataset
from megatron_chimera.data.instruction import encode_conversation, record_messages
from megatron_chimera.errors import InputFileError
from tests.helpers.tokenizer_files import write_gpt2_files

from .test_preprocess_data import _load_tool

pytestmark = pytest.mark.timeout(120)

RECORDS = [
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Name a colour."},
                  {"role": "assistant", "content": "Blue."}]},
    {"prompt": "Two and two?", "response": "Four."},
    {"messages": [{"role": "user", "content": "long " * 60},
                  {"role": "assistant", "content": "ok"}]},
]


def _args(tmp_path, input_path, *extra):
    vocab, merges, _ = write_gpt2_files(str(tmp_path))
    return ["--input", str(input_path), "--output-prefix", str(tmp_path / "sft"),
            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file",
            merges, "--workers", "1", "--append-eod", "--sft", *extra]


def test_sft_datasets_equal_the_instruction_encoding(tmp_path, capsys):
    tool = _load_tool()
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    args = _args(tmp_path, data, "--max-tokens", "100", "--overlong", "skip")
    tool.main(args)
    assert "0 conversations truncated, 1 skipped" in capsys.readouterr().err
    tokenizer = tool.Encoder(tool.get_args(args)).tokenizer
    texts = MMapIndexedDataset(str(tmp_path / "sft_text_document"))
    masks = MMapIndexedDataset(str(tmp_path / "sft_loss_mask_document"))
    assert len(texts) == len(masks) == 2
    for i, record in enumerate(RECORDS[:2]):
        want = encode_conversation(record_messages(record, "r"), tokenizer.tokenize,
                                   eod=tokenizer.eod)
        assert np.array_equal(texts[i], want.ids) and np.array_equal(masks[i], want.mask)
        assert 0 < masks[i].sum() < len(masks[i])


def test_sft_bad_lines_are_named(tmp_path):
    tool = _load_tool()
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps(RECORDS[0]) + "\n" + json.dumps({"text": "x"}) + "\n")
    with pytest.raises(InputFileError, match=r"bad.jsonl:2: JSONL line has no 'messages'"):
        tool.main(_args(tmp_path, data))
    data.write_text(json.dumps(RECORDS[2]) + "\n")
    with pytest.raises(InputFileError, match="longer than the token budget 40"):
        tool.main(_args(tmp_path, data, "--max-tokens", "40"))
    with pytest.raises(InputFileError, match="--chat-template: tokenizer .* has no chat template"):
        tool.main(_args(tmp_path, data, "--chat-template"))


def test_sft_truncation_is_counted_and_cuts_to_the_budget(tmp_path, capsys):
    tool = _load_tool()
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    tool.main(_args(tmp_path, data, "--max-tokens", "50", "--overlong", "truncate"))
    assert "2 conversations truncated, 0 skipped" in capsys.readouterr().err
    texts = MMapIndexedDataset(str(tmp_path / "sft_text_document"))
    assert [len(texts[i]) for i in range(3)] == [50, 43, 50]
