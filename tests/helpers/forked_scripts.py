"""Run an entry script (``pretrain_gpt2.py``, a tool) as its own process forked from a forkserver
that imported torch, torch._dynamo (which torch.optim imports on first use), DCP and the package
once: each rank then starts in a fraction of a second instead of the 4-5 s of CPU a fresh
interpreter spends importing, which on 2 cores was most of an end-to-end test's time.

The child behaves as ``python script args`` would: its own environment (exactly ``env``), working
directory, ``sys.argv`` and ``sys.path[0]``, stdout and stderr (file descriptors 1 and 2) on the
given files, the script run as ``__main__``, uncaught exceptions printed as Python prints them,
``sys.exit`` codes kept, non-daemon threads joined and ``atexit`` handlers run before it exits.
What differs: the hash seed is the server's (``PYTHONHASHSEED`` is not re-read), and modules
imported by the server are not re-imported. Launches that test torchrun itself still start
torchrun.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import runpy
import sys
import threading
import traceback
from multiprocessing.process import BaseProcess
from pathlib import Path

# imported once in the server (torch._dynamo: ~1.5 s of each rank's CPU otherwise, taken on the
# optimizer's first add_param_group; DCP: ~1 s on the first torch_dist save or load; the
# transformers models the converter, evaluation and generation tools import: ~3 s each)
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.optim",
           "torch.distributed.checkpoint", "megatron_chimera.pipeline.executor",
           "pretrain_gpt2", "pretrain_bert", "transformers.models.llama.modeling_llama",
           "transformers.models.gpt2.modeling_gpt2"]


def forkserver_context() -> mp.context.BaseContext:
    """The forkserver context every test process forks from (started on first use)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # applies when the server starts: the first call wins
    return ctx


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _run_script(script: str, args: list[str], env: dict[str, str], cwd: str, stdout: str,
                stderr: str) -> None:
    for fd, path in ((1, stdout), (2, stderr)):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(handle, fd)
        os.close(handle)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - lives until exit
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:  # noqa: BLE001 - printed as the interpreter prints it
        traceback.print_exc()
        code = 1
    for thread in threading.enumerate():  # the interpreter joins non-daemon threads at exit
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as the harness's ranks: no teardown of gloo's groups


def start_script(script: Path | str, args: list[str], env: dict[str, str], cwd: Path | str,
                 stdout: Path | str, stderr: Path | str) -> BaseProcess:
    """Start ``python script args`` forked from the shared server; its output is appended to
    ``stdout`` and ``stderr`` (paths). Wait with ``join`` and read ``exitcode`` (negative: the
    signal that ended it, as ``subprocess`` reports it)."""
    process = forkserver_context().Process(
        target=_run_script, args=(str(script), list(args), dict(env), str(cwd), str(stdout),
                                  str(stderr)))
    process.start()
    return process
