#!/usr/bin/env python
"""Tokenize a jsonl corpus into Megatron's ``.bin``/``.idx`` datasets (Megatron's tool and flags).

One output dataset per json key: ``{output_prefix}_{key}_{document|sentence}.bin/.idx``.
With ``--sft`` each line is an instruction record (``messages`` or ``prompt``/``response``,
:mod:`megatron_chimera.data.instruction`) and the outputs are ``{output_prefix}_text_document``
(token ids) and ``{output_prefix}_loss_mask_document`` (1 where the token is trained).
Memory does not grow with the input: lines are read lazily, at most ``4 x workers`` chunks are in
flight, tokens go straight to the ``.bin`` and the index is kept in numpy arrays. The output
does not depend on ``--workers`` (chunks are written in input order).

Example::

    python tools/preprocess_data.py --input data/shakespeare.jsonl \\
        --output-prefix data/shakespeare \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model data/spm.model \\
        --append-eod --workers 2
"""

from __future__ import annotations

import argparse
import glob
import json
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from megatron_chimera.config import TOKENIZER_TYPES  # noqa: E402
from megatron_chimera.data.indexed_dataset import (
    IndexedDatasetBuilder,
    data_file_path,
    index_file_path,
    optimal_dtype,
)
from megatron_chimera.data.instruction import (
    OVERLONG,
    encode_conversation,
    hf_chat_renderer,
    plain_template,
    record_messages,
)
from megatron_chimera.data.sentence_splitter import split_sentences
from megatron_chimera.data.text_files import read_lines
from megatron_chimera.data.tokenizers import build_tokenizer
from megatron_chimera.errors import InputFileError, ToolArgumentParser, run_tool

CHUNK_LINES = 64  # lines per task sent to a worker

# One encoded document per key: (concatenated tokens, sequence lengths).
EncodedDoc = dict[str, tuple[np.ndarray, list[int]]]
SFT_KEYS = ["text", "loss_mask"]
SFT_STATUS = "_sft_status"  # not a dataset: "kept", "truncated" or "skipped" (counted in the log)


class Encoder:
    """Turns jsonl lines into token arrays (one instance per worker process)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.json_keys = args.json_keys
        self.split = args.split_sentences
        self.keep_newlines = args.keep_newlines
        self.append_eod = args.append_eod
        self.tokenizer = build_tokenizer(
            args.tokenizer_type, tokenizer_model=args.tokenizer_model,
            vocab_file=args.vocab_file, merge_file=args.merge_file, vocab_size=args.vocab_size,
        )
        self.sft = args.sft
        self.max_tokens, self.overlong = args.max_tokens, args.overlong
        self.render = plain_template
        if args.sft and args.chat_template:
            try:
                self.render = hf_chat_renderer(getattr(self.tokenizer, "_tokenizer", None))
            except ValueError as e:
                raise InputFileError(f"--chat-template: {e}") from None

    def encode_instruction(self, record: object, where: str) -> EncodedDoc:
        """One instruction record as ids and loss mask (one document each)."""
        try:
            encoded = encode_conversation(
                record_messages(record, where), self.tokenizer.tokenize, self.render,
                self.tokenizer.eod if self.append_eod else None, self.max_tokens,
                self.overlong, where)
        except ValueError as e:
            raise InputFileError(str(e)) from None
        empty = np.zeros(0, dtype=np.int64)
        if encoded is None:
            return {SFT_STATUS: (empty, ["skipped"])}
        status = "truncated" if encoded.truncated else "kept"
        return {"text": (encoded.ids, [len(encoded.ids)]),
                "loss_mask": (encoded.mask.astype(np.int64), [len(encoded.mask)]),
                SFT_STATUS: (empty, [status])}

    def encode(self, line: str, where: str) -> EncodedDoc:
        """Tokenize the keys of one json line."""
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputFileError(f"{where}: not valid JSON ({e})") from None
        if not isinstance(record, dict):
            raise InputFileError(f"{where}: not a JSON object")
        if self.sft:
            return self.encode_instruction(record, where)
        out: EncodedDoc = {}
        for key in self.json_keys:
            if key not in record:
                raise InputFileError(f"{where}: json key {key!r} (from --json-keys) is missing")
            text = record[key]
            if not isinstance(text, str):
                raise InputFileError(f"{where}: json key {key!r} is not a string")
            pieces = split_sentences(text, self.keep_newlines) if self.split else [text]
            try:
                sequences = [ids for ids in map(self.tokenizer.tokenize, pieces) if len(ids) > 0]
            except ValueError as e:
                raise InputFileError(f"{where}: json key {key!r} cannot be tokenized ({e})") \
                    from None
            if sequences and self.append_eod:
                sequences[-1] = list(sequences[-1]) + [self.tokenizer.eod]
            lengths = [len(s) for s in sequences]
            tokens = np.fromiter((t for s in sequences for t in s), dtype=np.int64,
                                 count=sum(lengths))
            out[key] = (tokens, lengths)
        return out

    def encode_chunk(self, chunk: tuple[str, int, list[str]]) -> tuple[list[EncodedDoc], int]:
        """Encode a chunk of lines; returns the documents and the number of input bytes."""
        path, first_line, lines = chunk
        docs = [self.encode(line, f"{path}:{first_line + i}") for i, line in enumerate(lines)]
        return docs, sum(len(line.encode("utf-8")) for line in lines)


class _Worker:
    """The ``Encoder`` of a pool worker process (Megatron's initializer pattern)."""

    encoder: Encoder | None = None

    @classmethod
    def initializer(cls, args: argparse.Namespace) -> None:
        # Ctrl-C is the main process's to handle: a worker interrupted inside the pool's queues
        # could leave them locked (and the shutdown hanging); the main process kills workers.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        cls.encoder = Encoder(args)

    @classmethod
    def encode_chunk(cls, chunk: tuple[str, int, list[str]]) -> tuple[list[EncodedDoc], int]:
        assert cls.encoder is not None
        return cls.encoder.encode_chunk(chunk)


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Megatron's ``tools/preprocess_data.py`` flags."""
    parser = ToolArgumentParser(description=__doc__.split("\n")[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", type=str, required=True,
                       help="jsonl file (or a glob of them) with one json object per line")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="keys to extract from each json object")
    group.add_argument("--split-sentences", action="store_true",
                       help="split documents into sentences (rule-based, offline)")
    group.add_argument("--keep-newlines", action="store_true",
                       help="keep newlines between sentences when splitting")
    group.add_argument("--lang", type=str, default="english",
                       help="language of the sentence splitter (only english)")
    group.add_argument("--sft", action="store_true",
                       help="instruction records (messages or prompt/response) -> ids + loss mask")
    group.add_argument("--chat-template", action="store_true",
                       help="--sft: render with the HF tokenizer's chat template (else plain)")
    group.add_argument("--max-tokens", type=int, default=None,
                       help="--sft: token budget of one conversation")
    group.add_argument("--overlong", choices=OVERLONG, default="error",
                       help="--sft: a conversation over --max-tokens is an error, truncated or "
                            "skipped")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", type=str, required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--tokenizer-model", type=str, default=None,
                       help="SentencePiece model, or HuggingFaceTokenizer's local directory")
    group.add_argument("--vocab-file", type=str, default=None)
    group.add_argument("--merge-file", type=str, default=None, help="BPE merges (GPT-2)")
    group.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer vocabulary")
    group.add_argument("--append-eod", action="store_true",
                       help="append an end-of-document token to every document")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", type=str, required=True)
    group.add_argument("--dataset-impl", type=str, default="mmap", choices=["mmap"],
                       help="only Megatron's mmap format is written")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, required=True, help="encoder processes")
    group.add_argument("--partitions", type=int, default=1,
                       help="split the input into this many partition files, encode each, merge")
    group.add_argument("--keep-sequential-samples", action="store_true",
                       help="with --partitions, partition contiguous line ranges (not round robin)")
    group.add_argument("--log-interval", type=int, default=1000,
                       help="documents between progress lines")
    args = parser.parse_args(argv)
    if args.lang != "english":
        parser.error("--lang: only 'english' is supported by the offline sentence splitter")
    if args.keep_newlines and not args.split_sentences:
        parser.error("--keep-newlines requires --split-sentences")
    for flag in ("workers", "partitions", "log_interval"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.sft:
        if args.split_sentences:
            parser.error("--sft and --split-sentences do not go together")
        if args.max_tokens is not None and args.max_tokens < 1:
            parser.error("--max-tokens must be at least 1")
        args.json_keys = list(SFT_KEYS)
    elif args.chat_template or args.max_tokens is not None:
        parser.error("--chat-template and --max-tokens need --sft")
    args.inputs = sorted(glob.glob(args.input))
    if not args.inputs:
        parser.error(f"--input {args.input}: no such file")
    return args


def _chunks(paths: list[str]) -> Iterator[tuple[str, int, list[str]]]:
    for path in paths:
        lines: list[str] = []
        first = 1
        for number, line in read_lines(path):
            if not line.strip():
                continue
            if not lines:
                first = number
            lines.append(line)
            if len(lines) == CHUNK_LINES:
                yield path, first, lines
                lines = []
        if lines:
            yield path, first, lines


def _output_prefix(output_prefix: str, key: str, level: str) -> str:
    return f"{output_prefix}_{key}_{level}"


def check_not_empty(args: argparse.Namespace, builders: dict[str, IndexedDatasetBuilder]) -> None:
    """An output dataset without a single sequence is an error naming the input and the key."""
    for key, builder in builders.items():
        if builder.sequence_count == 0:
            raise InputFileError(
                f"--input {args.input}: no text to write for json key {key!r} (the input is "
                "empty or every value is empty); nothing was written")


def _kill_workers(pool: ProcessPoolExecutor) -> None:
    """SIGKILL the pool's workers (no queue or lock is left for a shutdown to wait on)."""
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        process.kill()
    pool.shutdown(wait=False, cancel_futures=True)


class _FirstInterrupt:
    """SIGINT handler while the pool runs: the first Ctrl-C raises KeyboardInterrupt, later ones
    are ignored, so a quick second Ctrl-C cannot interrupt the clean-up that kills the workers
    (an interrupted clean-up would leave them holding the terminal's pipes)."""

    def __init__(self) -> None:
        self.seen = False

    def __call__(self, signum: int, frame: object) -> None:
        if not self.seen:
            self.seen = True
            raise KeyboardInterrupt


def _encode_in_pool(args: argparse.Namespace, paths: list[str], write) -> None:
    """Encode the chunks in ``--workers`` processes, at most ``4 x workers`` chunks in flight,
    writing the results in input order.

    On Ctrl-C (or any error) the workers are killed and the exception re-raised; Ctrl-C after the
    first is ignored until then (:class:`_FirstInterrupt`), so a double Ctrl-C can neither hang
    the pool's shutdown nor skip the clean-up.
    """
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, _FirstInterrupt()) if main_thread else None
    pool = None
    try:
        # fork where it is safe (Linux): workers inherit the imports instead of redoing them
        method = "fork" if sys.platform.startswith("linux") else "spawn"
        # (a worker that dies, e.g. killed for memory, raises BrokenProcessPool: no hang)
        pool = ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context(method),
                                   initializer=_Worker.initializer, initargs=(args,))
        pending: deque = deque()
        for chunk in _chunks(paths):
            pending.append(pool.submit(_Worker.encode_chunk, chunk))
            if len(pending) >= 4 * args.workers:
                write(pending.popleft().result())
        while pending:
            write(pending.popleft().result())
        pool.shutdown(wait=True)
    except BaseException as exc:
        if pool is not None:
            _kill_workers(pool)
        if isinstance(exc, KeyboardInterrupt) and previous is not None:
            previous = None  # the process is ending: later Ctrl-C stay ignored
        raise
    finally:
        # an error or success gives Ctrl-C back: a caller that goes on (main() run in-process)
        # must not keep this handler, nor its children after it
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def encode_files(args: argparse.Namespace, paths: list[str], output_prefix: str,
                 allow_empty: bool = False) -> None:
    """Encode ``paths`` into one dataset per json key under ``output_prefix`` (an empty output
    is an error unless ``allow_empty``: a partition may be empty, the merged dataset not)."""
    level = "sentence" if args.split_sentences else "document"
    encoder = Encoder(args)
    dtype = optimal_dtype(encoder.tokenizer.vocab_size)
    builders = {
        key: IndexedDatasetBuilder(data_file_path(_output_prefix(output_prefix, key, level)), dtype)
        for key in args.json_keys
    }
    start = time.time()
    count, total_bytes = 0, 0
    statuses = {"truncated": 0, "skipped": 0}

    def write(result: tuple[list[EncodedDoc], int]) -> None:
        nonlocal count, total_bytes
        docs, nbytes = result
        for doc in docs:
            status = doc.pop(SFT_STATUS, None)
            if status is not None and status[1][0] in statuses:
                statuses[status[1][0]] += 1
            for key, (tokens, lengths) in doc.items():
                builders[key].add_document(tokens, lengths)
            count += 1
            if count % args.log_interval == 0:
                elapsed = max(time.time() - start, 1e-9)
                print(f"Processed {count} documents "
                      f"({count / elapsed:.2f} docs/s, "
                      f"{(total_bytes + nbytes) / elapsed / 1024 / 1024:.2f} MB/s).",
                      file=sys.stderr, flush=True)
        total_bytes += nbytes

    try:
        if args.workers == 1:
            for chunk in _chunks(paths):
                write(encoder.encode_chunk(chunk))
        else:
            _encode_in_pool(args, paths, write)
        if args.sft:
            print(f"--sft: {statuses['truncated']} conversations truncated, "
                  f"{statuses['skipped']} skipped (over --max-tokens)", file=sys.stderr)
        if not allow_empty:
            check_not_empty(args, builders)
        for key, builder in builders.items():
            builder.finalize(index_file_path(_output_prefix(output_prefix, key, level)))
    except BaseException:
        for builder in builders.values():
            builder.abort()
        raise
    elapsed = max(time.time() - start, 1e-9)
    print(f"Done: {count} documents in {elapsed:.2f} s ({count / elapsed:.2f} docs/s, "
          f"{total_bytes / elapsed / 1024 / 1024:.2f} MB/s).", file=sys.stderr, flush=True)


def _partition_input(args: argparse.Namespace, directory: str) -> list[str]:
    """Write the input lines into ``--partitions`` files (round robin, or contiguous ranges)."""
    paths = [os.path.join(directory, f"partition_{i}.jsonl") for i in range(args.partitions)]
    files = [open(p, "w", encoding="utf-8") for p in paths]  # noqa: SIM115
    try:
        total = 0
        if args.keep_sequential_samples:
            for path in args.inputs:
                total += sum(1 for _, line in read_lines(path) if line.strip())
        index, seen = 0, 0
        for path in args.inputs:
            for _, line in read_lines(path):
                if not line.strip():
                    continue
                if args.keep_sequential_samples:
                    index = min(seen * args.partitions // max(total, 1), args.partitions - 1)
                files[index].write(line if line.endswith("\n") else line + "\n")
                seen += 1
                if not args.keep_sequential_samples:
                    index = (index + 1) % args.partitions
    finally:
        for f in files:
            f.close()
    return paths


def main(argv: list[str] | None = None) -> None:
    """Run the tool."""
    args = get_args(argv)
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    if args.partitions == 1:
        encode_files(args, args.inputs, args.output_prefix)
        return
    level = "sentence" if args.split_sentences else "document"
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".partitions.") as tmp:
        parts = _partition_input(args, tmp)
        for i, part in enumerate(parts):
            encode_files(args, [part], os.path.join(tmp, f"part{i}"), allow_empty=True)
        dtype = optimal_dtype(Encoder(args).tokenizer.vocab_size)
        builders = {key: IndexedDatasetBuilder(
            data_file_path(_output_prefix(args.output_prefix, key, level)), dtype)
            for key in args.json_keys}
        try:
            for key, builder in builders.items():
                for i in range(len(parts)):
                    builder.add_index(_output_prefix(os.path.join(tmp, f"part{i}"), key, level))
            check_not_empty(args, builders)
            for key, builder in builders.items():
                builder.finalize(index_file_path(_output_prefix(args.output_prefix, key, level)))
        except BaseException:
            for builder in builders.values():
                builder.abort()
            raise


if __name__ == "__main__":
    run_tool(main)
