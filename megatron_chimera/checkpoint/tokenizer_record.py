"""The tokenizer a checkpoint records: its ``--tokenizer-type`` and files, and where those files
are when the checkpoint has moved (``<checkpoint>/tokenizer/`` keeps copies of them)."""

from __future__ import annotations

import os
from dataclasses import dataclass

TOKENIZER_DIR = "tokenizer"  # under a checkpoint root: copies of the tokenizer's files


@dataclass(frozen=True)
class TokenizerSettings:
    """The ``--tokenizer-type`` / ``--vocab-file`` / ``--merge-file`` / ``--tokenizer-model`` a
    checkpoint records."""

    tokenizer_type: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None


def resolve_file(path: str | None, ckpt_root: str) -> str | None:
    """A recorded tokenizer path (a file, or a Hugging Face tokenizer's directory), or its copy
    in ``<ckpt_root>/tokenizer/`` when the checkpoint was moved (None when neither exists)."""
    if path is None:
        return None
    if os.path.exists(path):
        return path
    moved = os.path.join(ckpt_root, TOKENIZER_DIR, os.path.basename(os.path.normpath(path)))
    return moved if os.path.exists(moved) else None
