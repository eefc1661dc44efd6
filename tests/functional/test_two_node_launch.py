"""A real two-"node" launch of examples/pretrain_gpt2_chimera_distributed.sh on one machine.

Two torchrun launchers (``NNODES=2``, ``NODE_RANK`` 0 and 1, one master address and port), two
CPU workers each: Chimera with D=4 over both "nodes". The losses must equal those of the same
script's one-node command (its ``DRY_RUN=1`` line, ``NNODES=1``, four workers) run as one world
of four ranks (same ranks, same placement: bit for bit). That world's ranks are forked by hand:
torchrun's one-node launch is not what is compared, and its agent and four fresh interpreters
cost the test ~10 s.
Slow; run it alone with ``pytest tests/functional/test_two_node_launch.py``.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_chimera.parallel_state import NCCL_SEMANTICS_ENV

from .launcher import ROOT, free_port, launch_forked, scalars

pytestmark = [pytest.mark.functional, pytest.mark.slow]

SCRIPT = ROOT / "examples" / "pretrain_gpt2_chimera_distributed.sh"
TINY_ENV = {
    "PP": "4", "CHIMERA_PIPES": "2", "MICRO_BATCH": "1", "GLOBAL_BATCH": "8",
    "NUM_LAYERS": "4", "HIDDEN_SIZE": "64", "NUM_HEADS": "4", "SEQ_LENGTH": "32",
    "TRAIN_ITERS": "6", "PRECISION": "", "MOCK_DATA": "1", "VOCAB_SIZE": "500",
    "LOG_INTERVAL": "1", "EVAL_INTERVAL": "3", "EVAL_ITERS": "1", "SAVE_INTERVAL": "1000",
    "EXTRA_ARGS": "--num-workers 0 --distributed-timeout-minutes 2",
    "TORCHRUN": f"{sys.executable} -m torch.distributed.run",
    "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
    NCCL_SEMANTICS_ENV: "1",  # gloo under NCCL's point-to-point rules, as every distributed test
}


def node_env(tmp_path: Path, name: str, nnodes: int, node_rank: int, per_node: int,
             port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(TINY_ENV, NNODES=str(nnodes), NODE_RANK=str(node_rank),
               GPUS_PER_NODE=str(per_node), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               CHECKPOINT_PATH=str(tmp_path / f"ckpt-{name}"),
               TENSORBOARD_DIR=str(tmp_path / f"tb-{name}"))
    return env


def node(tmp_path: Path, name: str, nnodes: int, node_rank: int, per_node: int,
         port: int) -> subprocess.Popen:
    env = node_env(tmp_path, name, nnodes, node_rank, per_node, port)
    with open(tmp_path / f"{name}-node{node_rank}.log", "w") as log:  # the child keeps its fd
        return subprocess.Popen(["bash", str(SCRIPT)], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def wait_all(procs: list[subprocess.Popen], tmp_path: Path, timeout: float) -> None:
    try:
        for proc in procs:
            proc.wait(timeout=timeout)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)  # the launcher's session: its workers too
                proc.wait()
    logs = {p.name: p.read_text() for p in tmp_path.glob("*.log")}
    for proc in procs:
        assert proc.returncode == 0, logs


@pytest.mark.timeout(600)
def test_two_nodes_match_one_node(tmp_path):
    port = free_port()
    two = [node(tmp_path, "two", 2, rank, 2, port) for rank in (0, 1)]
    wait_all(two, tmp_path, timeout=420)
    # the one-node reference: the script's own command for one node of four workers
    dry = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, capture_output=True, text=True,
                         check=True, env=dict(node_env(tmp_path, "one", 1, 0, 4, free_port()),
                                              DRY_RUN="1"))
    words = shlex.split(dry.stdout)
    assert "--nnodes 1 --node-rank 0 --nproc-per-node 4" in " ".join(words), words
    one = launch_forked("pretrain_gpt2.py", words[words.index("pretrain_gpt2.py") + 1:], 4,
                        timeout=420)
    assert one.returncode == 0, (one.stdout[-3000:], one.stderr[-3000:])
    two_nodes = scalars(tmp_path / "tb-two", "lm loss")
    one_node = scalars(tmp_path / "tb-one", "lm loss")
    assert sorted(two_nodes) == list(range(1, 7)), two_nodes
    print(f"\ntwo nodes: {two_nodes}\none node:  {one_node}")
    assert two_nodes == one_node, (two_nodes, one_node)
    assert scalars(tmp_path / "tb-two", "lm loss validation") == \
        scalars(tmp_path / "tb-one", "lm loss validation")
    log = (tmp_path / "two-node0.log").read_text() + (tmp_path / "two-node1.log").read_text()
    assert "Traceback" not in log and "error:" not in log
