"""Instruction records: ids and loss masks against hand-built references, bad input refused."""

import numpy as np
import pytest

from megatron_chimera.data.instruction import (
    encode_conversation,
    hf_chat_renderer,
    plain_template,
    record_messages,
)


def char_encode(text: str) -> list[int]:
    return [ord(c) for c in text]


MESSAGES = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"}]


def test_plain_template_trains_only_the_assistant_turn_and_eod():
    got = encode_conversation(MESSAGES, char_encode, eod=0)
    context = "<|system|>\nS\n<|user|>\nhi\n"
    answer = "<|assistant|>\nyo\n"
    assert got.ids.tolist() == char_encode(context + answer) + [0]
    assert got.mask.tolist() == [0] * len(context) + [1] * len(answer) + [1]
    assert plain_template(MESSAGES) == context + answer


def test_prompt_response_pair_equals_two_messages():
    pair = record_messages({"prompt": "hi", "response": "yo"}, "x")
    assert pair == MESSAGES[1:]


def test_overlong_error_truncate_skip():
    budget = 10
    with pytest.raises(ValueError, match="longer than the token budget 10"):
        encode_conversation(MESSAGES, char_encode, max_tokens=budget, where="f.jsonl:3")
    cut = encode_conversation(MESSAGES, char_encode, max_tokens=budget, overlong="truncate")
    assert cut.truncated and len(cut.ids) == budget and not cut.mask.any()
    assert encode_conversation(MESSAGES, char_encode, max_tokens=budget, overlong="skip") is None
    whole = encode_conversation(MESSAGES, char_encode, max_tokens=1000)
    assert not whole.truncated


def test_line_without_messages_is_named():
    with pytest.raises(ValueError, match="f.jsonl:7: JSONL line has no 'messages'"):
        record_messages({"text": "plain"}, "f.jsonl:7")
    with pytest.raises(ValueError, match="list of"):
        record_messages({"messages": [{"role": "user"}]}, "f.jsonl:8")


class _Tokenizer:
    name_or_path = "tiny"

    def __init__(self, template):
        self.chat_template = template

    def apply_chat_template(self, messages, tokenize=False):
        return "".join(f"[{m['role']}]{m['content']}" for m in messages)


def test_chat_template_used_and_missing_template_refused():
    render = hf_chat_renderer(_Tokenizer("{{ messages }}"))
    got = encode_conversation(MESSAGES, char_encode, render=render)
    context, answer = "[system]S[user]hi", "[assistant]yo"
    assert got.mask.tolist() == [0] * len(context) + [1] * len(answer)
    assert np.array_equal(got.ids, np.asarray(char_encode(context + answer)))
    with pytest.raises(ValueError, match="tokenizer 'tiny' has no chat template"):
        hf_chat_renderer(_Tokenizer(None))
