"""tools/preprocess_data.py on bad input and Ctrl-C: one error line, nothing half-written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.functional.launcher import RunResult, launch
from tests.helpers import REPO_ROOT
from tests.helpers.processes import processes_mentioning

ROOT = REPO_ROOT
TOOL = ROOT / "tools" / "preprocess_data.py"

pytestmark = pytest.mark.timeout(180)


def run_tool(args: list[str], timeout: float = 120) -> RunResult:
    """``python tools/preprocess_data.py args``, forked from the test server (a fresh interpreter
    spends ~3 s of CPU importing); exit code and output as a process's. The Ctrl-C drill below
    starts its own process (it signals it)."""
    return launch(str(TOOL.relative_to(ROOT)), args, timeout=timeout)


def null_args(input_path: Path, prefix: Path, workers: int = 1) -> list[str]:
    return ["--input", str(input_path), "--output-prefix", str(prefix), "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "1000", "--workers", str(workers)]


def error_lines(result: RunResult) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


@pytest.mark.parametrize("workers", [1, 2])
def test_non_utf8_input_names_file_and_line(tmp_path, workers):
    corpus = tmp_path / "corpus.jsonl"
    good = json.dumps({"text": "1 2 3"}).encode() + b"\n"
    corpus.write_bytes(good * 2 + b'{"text": "4 5 \xff\xfe 6"}\n' + good)
    result = run_tool(null_args(corpus, tmp_path / "out", workers))
    lines = error_lines(result)
    assert result.returncode == 1, result.stderr
    assert len(lines) == 1 and lines[0].startswith(f"error: {corpus}:3: not UTF-8"), lines
    assert not list(tmp_path.glob("out*")), "nothing may be written"


@pytest.mark.parametrize("content", ["", json.dumps({"text": ""}) + "\n" + json.dumps(
    {"text": "   "}) + "\n"])
def test_empty_corpus_is_an_error_and_writes_nothing(tmp_path, content):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(content)
    result = run_tool(null_args(corpus, tmp_path / "out"))
    lines = error_lines(result)
    assert result.returncode == 1, result.stderr
    assert lines[-1].startswith("error: --input") and "no text to write" in lines[-1], lines
    assert "Traceback" not in result.stderr
    assert not list(tmp_path.glob("out*"))


def test_bad_json_is_one_line_naming_the_line(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"text": "1 2"}) + "\n{not json\n")
    result = run_tool(null_args(corpus, tmp_path / "out", workers=2))
    lines = error_lines(result)
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: {corpus}:2: not valid JSON"), lines


def test_bad_flag_is_one_line():
    result = run_tool(["--input", "x", "--output-prefix", "y", "--tokenizer-type", "nope",
                       "--workers", "1"])
    lines = error_lines(result)
    assert result.returncode == 2 and len(lines) == 1 and "--tokenizer-type" in lines[0], lines


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("gap", [0.0, 0.05, 0.4])
def test_double_ctrl_c_with_workers_exits_cleanly(tmp_path, gap):
    corpus = tmp_path / "big.jsonl"
    line = json.dumps({"text": " ".join(str(i % 1000) for i in range(300))}) + "\n"
    corpus.write_text(line * 40000)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    prefix = out_dir / f"ctrlc{os.getpid()}"
    proc = subprocess.Popen(
        [sys.executable, str(TOOL), *null_args(corpus, prefix, workers=2), "--log-interval",
         "200"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        first = proc.stderr.readline()  # a progress line: the pool is working
        assert first.startswith("Processed"), first
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole group
        time.sleep(gap)
        os.killpg(proc.pid, signal.SIGINT)
        start = time.monotonic()
        _, rest = proc.communicate(timeout=30)
        assert time.monotonic() - start < 30
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    lines = [ln for ln in rest.splitlines() if ln.strip() and not ln.startswith("Processed")]
    assert proc.returncode == 130, (proc.returncode, rest)
    assert lines == ["interrupted"], rest
    deadline = time.monotonic() + 10
    while processes_mentioning(str(prefix)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_mentioning(str(prefix)), "a worker outlived the tool"
    assert not list(out_dir.iterdir()), f"left behind: {list(out_dir.iterdir())}"
