#!/usr/bin/env python
"""Merge every ``.bin``/``.idx`` dataset in a directory into one (Megatron's tool, same flags).

Datasets are appended in sorted order of their prefixes; all must share one dtype.

Example::

    python tools/merge_datasets.py --input data/parts --output-prefix data/all_text_document
"""

from __future__ import annotations

import argparse
import os

from megatron_chimera.data.indexed_dataset import (
    IndexedDatasetBuilder,
    MMapIndexedDataset,
    data_file_path,
    index_file_path,
)
from megatron_chimera.errors import ToolArgumentParser, run_tool


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    parser = ToolArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", required=True,
                        help="directory holding the .bin/.idx pairs to merge")
    parser.add_argument("--output-prefix", required=True,
                        help="prefix of the merged dataset (writes PREFIX.bin and PREFIX.idx)")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.input):
        parser.error(f"--input {args.input}: not a directory")
    return args


def find_prefixes(directory: str) -> list[str]:
    """Sorted prefixes of the complete .bin/.idx pairs in ``directory``."""
    prefixes = []
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".idx"):
            continue
        prefix = os.path.join(directory, name[: -len(".idx")])
        if not os.path.isfile(data_file_path(prefix)):
            raise SystemExit(f"{index_file_path(prefix)}: no matching .bin file")
        prefixes.append(prefix)
    return prefixes


def main(argv: list[str] | None = None) -> None:
    """Merge the datasets."""
    args = get_args(argv)
    out = os.path.abspath(args.output_prefix)
    prefixes = [p for p in find_prefixes(args.input) if os.path.abspath(p) != out]
    if not prefixes:
        raise SystemExit(f"--input {args.input}: no .bin/.idx datasets found")
    builder = IndexedDatasetBuilder(data_file_path(args.output_prefix),
                                    MMapIndexedDataset(prefixes[0]).dtype)
    try:
        for prefix in prefixes:
            builder.add_index(prefix)
        builder.finalize(index_file_path(args.output_prefix))
    except BaseException:
        builder.abort()
        raise
    print(f"merged {len(prefixes)} datasets into {args.output_prefix}")


if __name__ == "__main__":
    run_tool(main)
