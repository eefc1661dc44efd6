"""tools/memory_report.py: a training command's per-rank memory, without running it."""

from __future__ import annotations

import importlib.util

import pytest

from megatron_chimera.config import ConfigError
from tests.helpers import REPO_ROOT

FLAGS = ("--world-size 4 --num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
         "--micro-batch-size 1 --global-batch-size 8 --lr 1e-3 --train-iters 2 "
         "--pipeline-model-parallel-size 4 --chimera-pipes 2").split()


def _tool():
    spec = importlib.util.spec_from_file_location("memory_report",
                                                  REPO_ROOT / "tools" / "memory_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prints_every_rank_of_an_uneven_chimera(capsys):
    tool = _tool()
    assert tool.main([*FLAGS, "--pipeline-model-parallel-layout", "Et*3|t*2|t*2|tL"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "stages Et*3|t*2|t*2|tL" in out[0]
    ranks = [line for line in out if line.startswith(" pipeline rank")]
    assert len(ranks) == 4
    # Chimera: ranks 0 and 3 hold stages 0 and 3 (4 layers, embedding, head), 1 and 2 the
    # middle ones (4 layers): the end ranks hold more
    weights = [float(line.split("weights ")[1].split()[0]) for line in ranks]
    assert weights[0] == weights[3] > weights[1] == weights[2]


def test_a_layout_of_seven_layers_is_refused():
    with pytest.raises(ConfigError, match="holds 7 transformer layers, --num-layers is 8"):
        _tool().main([*FLAGS, "--pipeline-model-parallel-layout", "Et*3|t*2|t*2|L"])
