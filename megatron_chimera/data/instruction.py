"""Instruction (SFT) records as token ids plus a per-token loss mask (1: trained).

A record is a JSONL object with ``messages`` (``[{"role", "content"}, ...]``, the common chat
format) or a ``prompt``/``response`` pair (one user turn, one assistant turn). Only assistant
tokens are trained; system and user tokens are context. The text comes from a ``render``
function (the HF tokenizer's chat template, :func:`hf_chat_renderer`) or, without one, the plain
template: every message is ``"<|ROLE|>\\n" + content + "\\n"``, concatenated. Masks are found
by rendering growing prefixes of the conversation, so a template's own markup around an
assistant turn is trained exactly when the template puts it after the previous turn's text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

Render = Callable[[Sequence[dict]], str]
OVERLONG = ("error", "truncate", "skip")


def plain_template(messages: Sequence[dict]) -> str:
    """The documented plain template: ``"<|ROLE|>\\n" + content + "\\n"`` per message."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)


def hf_chat_renderer(tokenizer) -> Render:
    """The HF tokenizer's chat template as a :data:`Render`; a tokenizer without one is refused."""
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
        raise ValueError(f"tokenizer {name!r} has no chat template "
                         "(use the plain template: drop --chat-template)")
    return lambda messages: tokenizer.apply_chat_template(list(messages), tokenize=False)


def record_messages(record: dict, where: str) -> list[dict]:
    """The record's messages (``messages``, or ``prompt``/``response`` as two turns)."""
    if isinstance(record, dict) and "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and {"role", "content"} <= m.keys() for m in messages):
            raise ValueError(f"{where}: 'messages' must be a list of {{role, content}} objects")
        return messages
    if isinstance(record, dict) and {"prompt", "response"} <= record.keys():
        return [{"role": "user", "content": record["prompt"]},
                {"role": "assistant", "content": record["response"]}]
    raise ValueError(f"{where}: JSONL line has no 'messages' (nor a 'prompt'/'response' pair)")


@dataclass(frozen=True)
class Encoded:
    """One record's ``ids`` (int64) and ``mask`` (uint8, 1 where the token is trained)."""

    ids: np.ndarray
    mask: np.ndarray
    truncated: bool = False


def encode_conversation(messages: Sequence[dict], encode: Callable[[str], list[int]],
                        render: Render = plain_template, eod: int | None = None,
                        max_tokens: int | None = None, overlong: str = "error",
                        where: str = "record") -> Encoded | None:
    """``messages`` as ids and loss mask (assistant turns trained, ``eod`` appended and trained
    after a final assistant turn). Past ``max_tokens``: ``overlong`` error (one line naming
    ``where``), truncate (``truncated`` set) or skip (None)."""
    if overlong not in OVERLONG:
        raise ValueError(f"overlong must be one of {OVERLONG}, got {overlong!r}")
    ids: list[int] = []
    mask: list[int] = []
    for i, message in enumerate(messages):
        full = list(encode(render(messages[:i + 1])))
        if full[:len(ids)] != ids:
            raise ValueError(f"{where}: the template's text of turn {i} does not extend the "
                             "previous turns' tokens (a template that rewrites earlier turns)")
        trained = 1 if message["role"] == "assistant" else 0
        mask.extend([trained] * (len(full) - len(ids)))
        ids = full
    if eod is not None:
        ids.append(eod)
        mask.append(1 if messages and messages[-1]["role"] == "assistant" else 0)
    truncated = max_tokens is not None and len(ids) > max_tokens
    if truncated:
        if overlong == "error":
            raise ValueError(f"{where}: conversation of {len(ids)} tokens is longer than the "
                             f"token budget {max_tokens} (--overlong truncate or skip)")
        if overlong == "skip":
            return None
        ids, mask = ids[:max_tokens], mask[:max_tokens]
    return Encoded(np.asarray(ids, np.int64), np.asarray(mask, np.uint8), truncated)
