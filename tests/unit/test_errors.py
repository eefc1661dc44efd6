"""errors.run_tool and the tools: one ``error:`` line per user error, tracebacks on request."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_chimera.errors import (
    InputFileError,
    UsageError,
    one_line,
    user_error_in,
)
from tests.functional.launcher import RunResult, launch
from tests.helpers import REPO_ROOT

ROOT = REPO_ROOT
pytestmark = pytest.mark.timeout(120)

SCRIPT = """
import sys
from megatron_chimera.errors import InputFileError, run_tool
def main():
    kind = sys.argv[1]
    if kind == "user":
        raise InputFileError("data.jsonl:3: not UTF-8 text")
    if kind == "chained":
        try:
            raise InputFileError("root cause in a.bin")
        except InputFileError as exc:
            raise RuntimeError("wrapper") from exc
    if kind == "bug":
        raise KeyError("oops")
    if kind == "exit":
        raise SystemExit("no datasets found")
    return 0
run_tool(main)
"""


def run(kind: str, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, kind, *extra], cwd=ROOT,
                          capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, **(env or {})))


def lines(proc: subprocess.CompletedProcess | RunResult) -> list[str]:
    return [ln for ln in proc.stderr.splitlines() if ln.strip()]


def test_user_error_is_one_line():
    proc = run("user")
    assert proc.returncode == 1 and lines(proc) == ["error: data.jsonl:3: not UTF-8 text"]


def test_user_error_behind_a_wrapper_is_shown():
    proc = run("chained")
    assert proc.returncode == 1 and lines(proc) == ["error: root cause in a.bin"]


def test_systemexit_message_gets_the_prefix():
    proc = run("exit")
    assert proc.returncode == 1 and lines(proc) == ["error: no datasets found"]


def test_a_bug_keeps_its_traceback():
    proc = run("bug")
    assert proc.returncode == 1 and "Traceback" in proc.stderr
    assert lines(proc)[-1] == "error: 'oops'"


@pytest.mark.parametrize("how", ["flag", "env"])
def test_tracebacks_on_request(how):
    proc = run("user", "--debug-tracebacks") if how == "flag" else \
        run("user", env={"MEGATRON_CHIMERA_TRACEBACKS": "1"})
    assert proc.returncode == 1 and "Traceback" in proc.stderr
    assert lines(proc)[-1] == "error: data.jsonl:3: not UTF-8 text"


def test_helpers():
    assert one_line(ValueError("a\n  b")) == "a b"
    assert isinstance(user_error_in(OSError(2, "No such file")), OSError)
    assert user_error_in(KeyError("x")) is None
    assert UsageError.exit_code == 2 and issubclass(InputFileError, ValueError)


def _tool(name: str, *args: str) -> RunResult:
    """``python tools/<name> args``, forked from the test server (the tools import torch: a
    fresh interpreter spends ~4 s of CPU on it); exit code and output as a process's."""
    return launch(f"tools/{name}", list(args), timeout=60)


def test_merge_datasets_bad_input_is_one_line(tmp_path):
    proc = _tool("merge_datasets.py", "--input", str(tmp_path / "none"), "--output-prefix", "x")
    assert proc.returncode == 2 and len(lines(proc)) == 1, proc.stderr
    assert lines(proc)[0].startswith("error: --input") and "not a directory" in lines(proc)[0]
    proc = _tool("merge_datasets.py", "--input", str(tmp_path), "--output-prefix", "x")
    assert proc.returncode == 1 and lines(proc) == [
        f"error: --input {tmp_path}: no .bin/.idx datasets found"]


def test_train_tokenizer_non_utf8_names_file_and_line(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_bytes(json.dumps({"text": "hello"}).encode() + b"\n" + b'{"text": "\xff"}\n')
    proc = _tool("train_tokenizer.py", "--input", str(corpus), "--model-prefix",
                 str(tmp_path / "spm"), "--vocab-size", "50")
    assert proc.returncode == 1 and len(lines(proc)) == 1, proc.stderr
    assert lines(proc)[0].startswith(f"error: {corpus}:2: not UTF-8 text")


@pytest.mark.parametrize("kind", ["SentencePieceTokenizer", "GPT2BPETokenizer"])
def test_corrupt_tokenizer_file_is_one_config_error(tmp_path, kind):
    from megatron_chimera.config import ConfigError
    from megatron_chimera.data.tokenizers import build_tokenizer

    bad = tmp_path / "bad.file"
    bad.write_bytes(b"\x00garbage{")
    files = ({"tokenizer_model": str(bad)} if kind == "SentencePieceTokenizer"
             else {"vocab_file": str(bad), "merge_file": str(bad)})
    with pytest.raises(ConfigError, match=f"--tokenizer-type {kind}: cannot read --"):
        build_tokenizer(kind, **files)


def test_every_tool_reports_errors_in_one_line():
    """Every script under tools/ ends in run_tool (or run_cli, built on it) and parses its flags
    with ToolArgumentParser (argparse's complaint as one line)."""
    offenders = []
    for path in sorted((ROOT / "tools").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if '__name__ == "__main__"' not in text:
            continue
        main_block = text.split('__name__ == "__main__"', 1)[1]
        if "run_tool(" not in main_block and "run_cli(" not in main_block:
            offenders.append(f"{path.relative_to(ROOT)}: not run through run_tool")
        if "argparse.ArgumentParser(" in text:
            offenders.append(f"{path.relative_to(ROOT)}: argparse.ArgumentParser")
    assert not offenders, offenders


def test_checkpoint_tools_one_line_on_a_missing_checkpoint(tmp_path):
    proc = _tool("generate_text.py", "--load", str(tmp_path / "none"), "--prompt", "a",
                 "--device", "cpu")
    assert proc.returncode == 2 and len(lines(proc)) == 1, proc.stderr
    assert lines(proc)[0].startswith("error: ") and "Traceback" not in proc.stderr
    proc = _tool("generate_text.py", "--no-such-flag")
    assert proc.returncode == 2 and len(lines(proc)) == 1, proc.stderr
    assert "the following arguments are required: --load" in lines(proc)[0]


def test_a_text_prompt_for_a_checkpoint_without_tokenizer_says_what_to_pass():
    from megatron_chimera.config import ConfigError
    from megatron_chimera.data.tokenizers import NullTokenizer
    from megatron_chimera.inference.tool_support import prompt_token_ids

    tokenizer = NullTokenizer(100)
    assert prompt_token_ids(tokenizer, "12 7 43", "ck") == [12, 7, 43]
    assert prompt_token_ids(tokenizer, "", "ck") == [tokenizer.eod]
    with pytest.raises(ConfigError) as info:
        prompt_token_ids(tokenizer, "Once upon a time", "ck")
    message = str(info.value)
    assert "checkpoint ck has no tokenizer" in message and "--tokenizer-type" in message
    assert "token ids separated by spaces" in message and "\n" not in message
