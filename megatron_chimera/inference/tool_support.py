"""What the checkpoint tools share: their checkpoint/tokenizer flags, loading, errors, JSON out."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch

from megatron_chimera.atomic import atomic_write
from megatron_chimera.checkpoint.tokenizer_record import TokenizerSettings
from megatron_chimera.config import TOKENIZER_TYPES, ConfigError
from megatron_chimera.data.tokenizers import MegatronTokenizer, NullTokenizer
from megatron_chimera.errors import UserError, run_tool
from megatron_chimera.inference.loader import LoadedModel, load_model, load_tokenizer
from megatron_chimera.model.family import GPT2


def add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    """``--load``, ``--device``, ``--params-dtype`` and the tokenizer overrides."""
    parser.add_argument("--load", required=True, help="checkpoint directory (any layout)")
    parser.add_argument("--device", default=None,
                        help="cpu, cuda or cuda:N (default: cuda when available)")
    parser.add_argument("--params-dtype", choices=("fp32", "fp16", "bf16"), default=None,
                        help="default: fp32 on the CPU, the checkpoint's dtype on a GPU")
    g = parser.add_argument_group("tokenizer (default: the one recorded in the checkpoint)")
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-model", default=None)


def load_gpt(args: argparse.Namespace, tool: str) -> tuple[LoadedModel, MegatronTokenizer]:
    """The GPT model and tokenizer named by the flags; ConfigError for a BERT checkpoint."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: CUDA is not available")
    dtype = args.params_dtype or ("fp32" if torch.device(device).type == "cpu" else None)
    loaded = load_model(args.load, device, params_dtype=dtype)
    if loaded.family is not GPT2:
        raise ConfigError(f"--load {args.load}: a {loaded.family.upper()} checkpoint; {tool} "
                          "needs a GPT (left-to-right) model")
    override = None
    if args.tokenizer_type is not None:
        override = TokenizerSettings(args.tokenizer_type, args.vocab_file, args.merge_file,
                                     args.tokenizer_model)
    else:
        for flag in ("vocab_file", "merge_file", "tokenizer_model"):
            if getattr(args, flag) is not None:
                raise ConfigError(f"--{flag.replace('_', '-')} needs --tokenizer-type")
    return loaded, load_tokenizer(loaded, override, args.tokenizer_model)


def prompt_token_ids(tokenizer: MegatronTokenizer, prompt: str, load: str) -> list[int]:
    """The token ids of ``prompt`` (the end-of-document token for an empty one); a text prompt
    for a checkpoint without a tokenizer is a ConfigError saying what to pass instead."""
    try:
        return tokenizer.tokenize(prompt) or [tokenizer.eod]
    except ValueError:
        if not isinstance(tokenizer, NullTokenizer):
            raise
        raise ConfigError(
            f"--prompt {prompt[:40]!r}: the checkpoint {load} has no tokenizer (it was trained "
            "with --mock-data or NullTokenizer), so a prompt must be token ids separated by "
            "spaces (e.g. --prompt \"12 7 431\"); or pass the tokenizer to use, e.g. "
            "--tokenizer-type GPT2BPETokenizer --vocab-file VOCAB --merge-file MERGES") from None


def write_json(path: str, obj: Any) -> None:
    """``obj`` as indented JSON at ``path``, written atomically."""
    data = (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()
    atomic_write(path, lambda handle: handle.write(data))


def run_cli(main: Callable[[], None]) -> None:
    """Run a checkpoint tool's ``main`` through :func:`~megatron_chimera.errors.run_tool` (one
    ``error:`` line, Ctrl-C, ``--debug-tracebacks``); a user error -- the tool's input: a
    configuration, a checkpoint, a Hugging Face directory -- exits with code 2."""

    def checked() -> None:
        try:
            main()
        except UserError as exc:
            exc.exit_code = 2  # the tools' contract: a bad --load / --hf-dir is a usage error
            raise

    run_tool(checked)
