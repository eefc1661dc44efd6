"""Evaluate a GPT checkpoint on one process: perplexity, or LAMBADA last-word accuracy.

    python tools/evaluate.py --load CKPT_DIR (--data-path PREFIX | --text-file FILE |
        --lambada FILE) [--json OUT]

``--data-path``: a Megatron ``.bin/.idx`` dataset (its documents in order, as one token stream);
``--text-file``: a raw text file, tokenized with the checkpoint's tokenizer. Both give the
sliding-window perplexity (windows of ``--seq-length`` tokens, ``--stride`` apart: every token is
scored once with at least ``seq-length - stride`` tokens of context). ``--lambada``: a JSONL file
with a ``text`` field per line; accuracy of predicting the last word greedily (Megatron's strict
LAMBADA). The numbers are printed and, with ``--json``, written as JSON.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from megatron_chimera.config import ConfigError
from megatron_chimera.data.indexed_dataset import IndexedDatasetError, MMapIndexedDataset
from megatron_chimera.errors import ToolArgumentParser
from megatron_chimera.inference.evaluation import lambada_accuracy, lambada_example, perplexity
from megatron_chimera.inference.tool_support import (
    add_checkpoint_args,
    load_gpt,
    run_cli,
    write_json,
)


def build_parser() -> argparse.ArgumentParser:
    """The evaluation command line."""
    parser = ToolArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    add_checkpoint_args(parser)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--data-path", help="prefix of a .bin/.idx dataset")
    source.add_argument("--text-file", help="raw text file")
    source.add_argument("--lambada", help="JSONL file, one example per line")
    parser.add_argument("--json-key", default="text", help="field of --lambada lines")
    parser.add_argument("--seq-length", type=int, default=None,
                        help="window length (default: the model's positions)")
    parser.add_argument("--stride", type=int, default=None,
                        help="distance between window starts (default: seq-length / 2)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="evaluate only the first N tokens of --data-path / --text-file")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--json", default=None, metavar="OUT", help="write the results here")
    return parser


def dataset_tokens(prefix: str) -> np.ndarray:
    """All tokens of a ``.bin/.idx`` dataset, documents in order."""
    try:
        dataset = MMapIndexedDataset(prefix)
    except (IndexedDatasetError, OSError) as exc:
        raise ConfigError(f"--data-path {prefix}: {exc}") from None
    if len(dataset) == 0:
        raise ConfigError(f"--data-path {prefix}: the dataset is empty")
    return np.concatenate([np.asarray(dataset[i], dtype=np.int64) for i in range(len(dataset))])


def read_lambada(path: str, key: str) -> list[str]:
    """The ``key`` field of every non-empty line of a JSONL file."""
    texts = []
    try:
        with open(path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    texts.append(str(json.loads(line)[key]))
                except (ValueError, KeyError, TypeError):
                    raise ConfigError(f"--lambada {path}:{number}: not a JSON object with a "
                                      f"{key!r} field (--json-key)") from None
    except OSError as exc:
        raise ConfigError(f"--lambada {path}: {exc.strerror}") from None
    if not texts:
        raise ConfigError(f"--lambada {path}: no examples")
    return texts


def _stream(args: argparse.Namespace, tokenizer, vocab_size: int) -> np.ndarray:
    if args.data_path is not None:
        tokens = dataset_tokens(args.data_path)
    else:
        try:
            with open(args.text_file, encoding="utf-8") as handle:
                tokens = np.asarray(tokenizer.tokenize(handle.read()), dtype=np.int64)
        except OSError as exc:
            raise ConfigError(f"--text-file {args.text_file}: {exc.strerror}") from None
    if args.max_tokens is not None:
        if args.max_tokens < 2:
            raise ConfigError(f"--max-tokens must be >= 2, got {args.max_tokens}")
        tokens = tokens[:args.max_tokens]
    if tokens.size and int(tokens.max()) >= vocab_size:
        raise ConfigError(f"token id {int(tokens.max())} >= the model's vocabulary {vocab_size} "
                          "(was the data made with another tokenizer?)")
    return tokens


def check_flags(args: argparse.Namespace) -> None:
    """Reject flags that do not apply to the chosen evaluation."""
    if args.lambada is not None:
        for flag in ("stride", "max_tokens"):
            if getattr(args, flag) is not None:
                raise ConfigError(f"--{flag.replace('_', '-')} applies to perplexity "
                                  "(--data-path / --text-file), not --lambada")
    elif args.json_key != "text":
        raise ConfigError("--json-key applies to --lambada only")


def main(argv: list[str] | None = None) -> None:
    """Run the chosen evaluation, print it, and write ``--json``."""
    args = build_parser().parse_args(argv)
    check_flags(args)
    loaded, tokenizer = load_gpt(args, "evaluate.py")
    config = loaded.model_config
    window = args.seq_length or config.max_positions
    if not 2 <= window <= config.max_positions:
        raise ConfigError(f"--seq-length must be in [2, {config.max_positions}] (the model's "
                          f"positions), got {window}")
    result = {"checkpoint": loaded.root, "iteration": loaded.iteration}
    if args.lambada is not None:
        examples = [lambada_example(t, tokenizer.tokenize)
                    for t in read_lambada(args.lambada, args.json_key)]
        result.update(task="lambada", source=args.lambada,
                      **lambada_accuracy(loaded.model, examples, window, args.batch_size))
        print(f"LAMBADA {args.lambada}: accuracy {result['accuracy']:.4f} "
              f"({result['correct']}/{result['examples']}), target-token perplexity "
              f"{result['target_perplexity']:.3f}")
    else:
        stride = args.stride or max(window // 2, 1)
        tokens = _stream(args, tokenizer, config.vocab_size)
        result.update(task="perplexity", source=args.data_path or args.text_file,
                      **perplexity(loaded.model, tokens, window, stride, args.batch_size))
        print(f"perplexity {result['perplexity']:.4f} over {result['tokens_scored']} tokens of "
              f"{result['source']} (window {window}, stride {stride}; mean nll "
              f"{result['nll_mean']:.5f})")
    if args.json is not None:
        write_json(args.json, result)


if __name__ == "__main__":
    run_cli(main)
