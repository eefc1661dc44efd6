"""Each example launch script is valid bash; its dry run prints the torchrun command it runs."""

import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT

REPO = REPO_ROOT
SCRIPTS = sorted((REPO / "examples").glob("*.sh")) + sorted(
    (REPO / "examples" / "slurm").glob("*.sbatch")
)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax(script: Path):
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.parametrize(
    "script",
    [s for s in SCRIPTS if "distributed" in s.name or s.suffix == ".sbatch"],
    ids=lambda p: p.name,
)
def test_dry_run_prints_torchrun_command(script: Path, tmp_path: Path):
    env = dict(os.environ, DRY_RUN="1", NNODES="2", NODE_RANK="1", GPUS_PER_NODE="4",
               MASTER_ADDR="node7", SLURM_NNODES="2", CHECKPOINT_PATH=str(tmp_path / "ckpt"))
    out = subprocess.run(["bash", str(script)], env=env, check=True, capture_output=True,
                         text=True, timeout=60).stdout
    lines = [line for line in out.splitlines() if line.startswith("torchrun")]
    expected_lines = 2 if script.suffix == ".sbatch" else 1  # the sbatch prints one line per node
    assert len(lines) == expected_lines, out
    entry = "pretrain_bert.py" if "bert" in script.name else "pretrain_gpt2.py"
    for line in lines:
        assert entry in line and "--chimera-pipes" in line
        assert "--nnodes 2" in line and "--master-addr node7" in line
        # no checkpoint exists yet, so the script must not ask to load one
        assert "--load" not in line
    if script.suffix != ".sbatch":
        assert "--node-rank 1" in lines[0] and "--nproc-per-node 4" in lines[0]


def test_tp_size_reaches_the_command(tmp_path: Path):
    """TP_SIZE=T adds --tensor-model-parallel-size T and --sequence-parallel (unless
    SEQUENCE_PARALLEL=0)."""
    script = REPO / "examples" / "pretrain_gpt2_chimera_distributed.sh"
    for extra, sequence_parallel in (({"TP_SIZE": "4"}, True),
                                     ({"TP_SIZE": "4", "SEQUENCE_PARALLEL": "0"}, False),
                                     ({}, False)):
        env = dict(os.environ, DRY_RUN="1", CHECKPOINT_PATH=str(tmp_path / "ckpt"), **extra)
        out = subprocess.run(["bash", str(script)], env=env, check=True, capture_output=True,
                             text=True, timeout=60).stdout
        assert f"--tensor-model-parallel-size {extra.get('TP_SIZE', '1')}" in out
        assert ("--sequence-parallel" in out) == sequence_parallel
