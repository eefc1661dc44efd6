"""Tokenizer files between a Hugging Face directory and a checkpoint.

Import copies GPT-2 BPE (``vocab.json`` + ``merges.txt``) or WordPiece (``vocab.txt``) files into
``<checkpoint>/tokenizer/`` (a Llama / Mistral / Qwen2 fast tokenizer's files into
``<checkpoint>/tokenizer/huggingface/``, as ``HuggingFaceTokenizer``) and records the matching
``--tokenizer-type`` in the checkpoint's arguments; export writes the files of a GPT-2 BPE or
WordPiece tokenizer with a ``tokenizer_config.json`` that ``AutoTokenizer.from_pretrained`` reads.
Other tokenizers (SentencePiece, NullTokenizer) have no Hugging Face GPT-2 / BERT form and are not
exported.
"""

from __future__ import annotations

import json
import os

from megatron_chimera.atomic import atomic_write
from megatron_chimera.checkpoint.tokenizer_record import (
    TOKENIZER_DIR,
    TokenizerSettings,
    resolve_file,
)
from megatron_chimera.config import DataConfig
from megatron_chimera.hf.common import HFError
from megatron_chimera.model.family import BERT, GPT2, ModelFamily

GPT2_FILES = ("vocab.json", "merges.txt")
WORDPIECE_FILE = "vocab.txt"
EOT = "<|endoftext|>"
FAST_TOKENIZER_FILE = "tokenizer.json"
# the files of a transformers tokenizer directory that travel with a checkpoint
HF_TOKENIZER_FILES = (FAST_TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json",
                      "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")
HF_TOKENIZER_DIR = "huggingface"  # under <checkpoint>/tokenizer/


def _copy(src: str, dst_dir: str) -> str:
    os.makedirs(dst_dir, exist_ok=True)
    dst = os.path.join(dst_dir, os.path.basename(src))
    with open(src, "rb") as handle:
        data = handle.read()
    atomic_write(dst, lambda out: out.write(data))
    return os.path.abspath(dst)


def _lower_case(hf_dir: str) -> bool:
    """``do_lower_case`` of ``tokenizer_config.json`` (BertTokenizer's default: true)."""
    path = os.path.join(hf_dir, "tokenizer_config.json")
    if not os.path.isfile(path):
        return True
    try:
        with open(path, encoding="utf-8") as handle:
            return bool(json.load(handle).get("do_lower_case", True))
    except (ValueError, UnicodeDecodeError) as exc:
        raise HFError(f"{path}: not valid JSON ({exc})") from None


def import_tokenizer(hf_dir: str, save_root: str, family: ModelFamily,
                     prefer_fast: bool = False) -> TokenizerSettings:
    """Copy the family's tokenizer files (if ``hf_dir`` has them) into the checkpoint;
    ``prefer_fast`` (Llama, Mistral, Qwen2): a fast tokenizer's files first, as
    ``HuggingFaceTokenizer`` in ``<checkpoint>/tokenizer/huggingface/``."""
    target = os.path.join(save_root, TOKENIZER_DIR)
    if prefer_fast and os.path.isfile(os.path.join(hf_dir, FAST_TOKENIZER_FILE)):
        directory = os.path.join(target, HF_TOKENIZER_DIR)
        for name in HF_TOKENIZER_FILES:
            if os.path.isfile(os.path.join(hf_dir, name)):
                _copy(os.path.join(hf_dir, name), directory)
        return TokenizerSettings("HuggingFaceTokenizer",
                                 tokenizer_model=os.path.abspath(directory))
    if family is GPT2 and all(os.path.isfile(os.path.join(hf_dir, f)) for f in GPT2_FILES):
        vocab, merges = (_copy(os.path.join(hf_dir, f), target) for f in GPT2_FILES)
        return TokenizerSettings("GPT2BPETokenizer", vocab, merges)
    if family is BERT and os.path.isfile(os.path.join(hf_dir, WORDPIECE_FILE)):
        kind = "BertWordPieceLowerCase" if _lower_case(hf_dir) else "BertWordPieceCase"
        return TokenizerSettings(kind, _copy(os.path.join(hf_dir, WORDPIECE_FILE), target))
    return TokenizerSettings()


def export_tokenizer(data: DataConfig, ckpt_root: str,
                     max_length: int) -> tuple[dict[str, bytes], str | None]:
    """Hugging Face tokenizer files for the checkpoint's tokenizer, and a note when there are
    none (another tokenizer type, or its files are gone)."""
    kind = data.tokenizer_type
    if kind == "HuggingFaceTokenizer":
        directory = resolve_file(data.tokenizer_model, ckpt_root)
        if directory is None or not os.path.isdir(directory):
            return {}, f"tokenizer directory {data.tokenizer_model} not found"
        return {name: _read(os.path.join(directory, name)) for name in HF_TOKENIZER_FILES
                if os.path.isfile(os.path.join(directory, name))}, None
    vocab = resolve_file(data.vocab_file, ckpt_root)
    if kind == "GPT2BPETokenizer":
        merges = resolve_file(data.merge_file, ckpt_root)
        if vocab is None or merges is None:
            return {}, f"tokenizer files {data.vocab_file}, {data.merge_file} not found"
        config = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": max_length,
                  "bos_token": EOT, "eos_token": EOT, "unk_token": EOT,
                  "add_prefix_space": False}
        return {"vocab.json": _read(vocab), "merges.txt": _read(merges),
                "tokenizer_config.json": _json_bytes(config)}, None
    if kind in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        if vocab is None:
            return {}, f"tokenizer file {data.vocab_file} not found"
        config = {"tokenizer_class": "BertTokenizer", "model_max_length": max_length,
                  "do_lower_case": kind == "BertWordPieceLowerCase"}
        return {WORDPIECE_FILE: _read(vocab), "tokenizer_config.json": _json_bytes(config)}, None
    if kind is None and data.vocab_size is None:
        return {}, "the checkpoint records no tokenizer; no tokenizer files written"
    return {}, (f"tokenizer {kind or 'NullTokenizer'} has no Hugging Face GPT-2 BPE / WordPiece "
                "form; no tokenizer files written")


def _read(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


def _json_bytes(obj: object) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()
