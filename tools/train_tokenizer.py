#!/usr/bin/env python
"""Train a SentencePiece model (BPE or unigram) from jsonl or plain-text files.

Example::

    python tools/train_tokenizer.py --input data/shakespeare.jsonl --model-prefix data/spm \\
        --vocab-size 8000 --model-type bpe

writes ``data/spm.model`` and ``data/spm.vocab``, for ``--tokenizer-type SentencePieceTokenizer
--tokenizer-model data/spm.model``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
from collections.abc import Iterator

from megatron_chimera.atomic import atomic_write
from megatron_chimera.data.text_files import read_lines
from megatron_chimera.errors import InputFileError, ToolArgumentParser, run_tool


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    parser = ToolArgumentParser(description="Train a SentencePiece tokenizer.")
    parser.add_argument("--input", nargs="+", required=True, help="jsonl or text files")
    parser.add_argument("--input-format", choices=["auto", "jsonl", "text"], default="auto",
                        help="auto: jsonl for *.jsonl/*.json, text otherwise")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="keys of jsonl records")
    parser.add_argument("--model-prefix", required=True, help="writes PREFIX.model, PREFIX.vocab")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    parser.add_argument("--character-coverage", type=float, default=1.0)
    parser.add_argument("--input-sentence-size", type=int, default=0,
                        help="sample this many lines for training (0: use all)")
    parser.add_argument("--max-sentence-length", type=int, default=16384,
                        help="longer lines are skipped (bytes)")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the line sampling")
    args = parser.parse_args(argv)
    for path in args.input:
        if not os.path.isfile(path):
            parser.error(f"--input {path}: no such file")
    if args.vocab_size < 8:
        parser.error("--vocab-size must be at least 8")
    return args


def iter_lines(paths: list[str], input_format: str, json_keys: list[str]) -> Iterator[str]:
    """Non-empty text lines of the inputs (jsonl values are split at newlines)."""
    for path in paths:
        is_json = input_format == "jsonl" or (
            input_format == "auto" and path.endswith((".jsonl", ".json"))
        )
        for number, line in read_lines(path):
            if not line.strip():
                continue
            if not is_json:
                yield line.rstrip("\n")
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputFileError(f"{path}:{number}: not valid JSON ({e})") from None
            for key in json_keys:
                if key not in record:
                    raise InputFileError(f"{path}:{number}: json key {key!r} is missing")
                yield from (s for s in str(record[key]).split("\n") if s.strip())


def _train(sentencepiece, args: argparse.Namespace, sentences: Iterator[str],
           model: io.BytesIO) -> None:
    """SentencePiece's trainer over ``sentences``, the model written to ``model``."""
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=sentences,
        model_writer=model,
        vocab_size=args.vocab_size,
        model_type=args.model_type,
        character_coverage=args.character_coverage,
        input_sentence_size=args.input_sentence_size,
        shuffle_input_sentence=args.input_sentence_size > 0,
        max_sentence_length=args.max_sentence_length,
        num_threads=1,
        minloglevel=2,
    )


def main(argv: list[str] | None = None) -> None:
    """Train and write the model atomically."""
    import sentencepiece

    args = get_args(argv)
    sentencepiece.SetRandomGeneratorSeed(args.seed)
    model = io.BytesIO()
    input_errors: list[InputFileError] = []

    def lines() -> Iterator[str]:
        try:
            yield from iter_lines(args.input, args.input_format, args.json_keys)
        except InputFileError as exc:  # SentencePiece would wrap it in a RuntimeError
            input_errors.append(exc)
            raise
    try:
        _train(sentencepiece, args, lines(), model)
    except RuntimeError:
        if input_errors:
            raise input_errors[0] from None
        raise
    out_dir = os.path.dirname(os.path.abspath(args.model_prefix))
    os.makedirs(out_dir, exist_ok=True)
    model_path = args.model_prefix + ".model"
    atomic_write(model_path, lambda f: f.write(model.getvalue()))
    sp = sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())
    vocab_path = args.model_prefix + ".vocab"
    atomic_write(vocab_path, lambda f: f.write("".join(
        f"{sp.id_to_piece(i)}\t{sp.get_score(i)}\n" for i in range(sp.get_piece_size()))),
        mode="w")
    print(f"wrote {model_path} ({sp.get_piece_size()} pieces, {args.model_type})")


if __name__ == "__main__":
    run_tool(main)
