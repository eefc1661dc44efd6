"""The equivalence checker end to end: a published bug re-created by monkeypatching one function
(torchtitan #3280: with context parallelism the loss divided by the context size twice) is caught
and named, while a pipeline layout of the same run agrees with one process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT

pytestmark = [pytest.mark.functional]

# the bug, injected into every process the checker starts (sitecustomize runs at start-up)
CP_TWICE = '''
import megatron_chimera.model.context_parallel as cp
_mean = cp.sequence_mean_loss
def _twice(output, mask):
    loss, reported = _mean(output, mask)
    size = cp.context_parallel_size()
    return loss / size, reported / size
cp.sequence_mean_loss = _twice
'''
MODEL = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
         "--max-position-embeddings 64 --micro-batch-size 1 --global-batch-size 4 --lr 1e-3 "
         "--vocab-size 500 --mock-data").split()


@pytest.mark.timeout(240)
def test_cp_loss_divided_twice_is_named(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(CP_TWICE)
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO_ROOT)]))
    out = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "check_equivalence.py"),
                          "--steps", "2", "--layouts", "CP2", "1f1b,D2", "--", *MODEL],
                         env=env, capture_output=True, text=True, timeout=230)
    rows = {line.split()[0]: line for line in out.stdout.splitlines()
            if line.startswith(("CP2", "1f1b,D2"))}
    assert out.returncode == 1, out.stdout + out.stderr
    assert "step 1: lm loss" in rows["CP2"], rows
    assert rows["1f1b,D2"].endswith("agrees"), rows
