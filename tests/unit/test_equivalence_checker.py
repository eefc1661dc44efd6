"""The layout-equivalence checker's inputs: layouts, the proxy's flags, the one-line refusals,
and how two runs' curves are compared (no process is launched here)."""

from __future__ import annotations

import pytest

from megatron_chimera.errors import ConfigError
from megatron_chimera.training import equivalence as eq

USER = ("--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --num-query-groups 4 "
        "--group-query-attention --num-experts 4 "
        "--seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 "
        "--global-batch-size 8 --lr 1e-4 --vocab-size 500 --tensor-model-parallel-size 8 "
        "--pipeline-model-parallel-size 4 --chimera-pipes 2 --save /ckpt --bf16").split()


def test_layout_grammar():
    lay = eq.parse_layout("T2,CP2,D4,chimera:W2")
    assert (lay.tp, lay.cp, lay.pp, lay.dp, lay.schedule, lay.pipes) == (2, 2, 4, 1, "chimera", 2)
    assert lay.world_size == 16
    assert "--sequence-parallel" in lay.flags()
    assert eq.parse_layout("1f1b,D4,DP2,EP2").flags() == [
        "--tensor-model-parallel-size", "1", "--context-parallel-size", "1",
        "--pipeline-model-parallel-size", "4", "--expert-model-parallel-size", "2",
        "--pipeline-schedule", "1f1b"]
    assert eq.parse_layout("zbv,D2,MB4").flags()[-2:] == ["--micro-batch-size", "4"]
    for bad, word in (("T2,X3", "'X3'"), ("chimera:Q2", "W<pipes>"), ("T0", "'T0'")):
        with pytest.raises(ConfigError, match=word):
            eq.parse_layout(bad)


def test_proxy_keeps_settings_and_drops_the_layout():
    flags = eq.proxy_flags(USER, [eq.parse_layout("1f1b,D4")], 3)
    for gone in ("--tensor-model-parallel-size", "--chimera-pipes", "--save", "/ckpt"):
        assert gone not in flags
    assert flags[flags.index("--hidden-size") + 1] == "64"
    assert flags[flags.index("--num-query-groups") + 1] == "2"  # GQA kept
    assert flags[flags.index("--num-layers") + 1] == "8"
    assert "--bf16" in flags and eq.precision(flags) == "bf16" and "--mock-data" in flags
    assert flags[flags.index("--global-batch-size") + 1] == "8"  # accumulation kept


def test_the_proxy_keeps_dropout_only_when_asked():
    """Against one process dropout is off; ``--against-flag`` (a layout against itself) keeps
    the user's."""
    user = [*USER, "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    for keep, want in ((False, "0"), (True, "0.1")):
        flags = eq.proxy_flags(user, [eq.parse_layout("D4")], 3, keep_dropout=keep)
        for name in ("--hidden-dropout", "--attention-dropout"):
            assert flags.count(name) == 1 and flags[flags.index(name) + 1] == want, flags


def test_refusals_name_the_reason():
    flags = eq.proxy_flags(USER, [eq.parse_layout("D4")], 3)
    with pytest.raises(ConfigError, match="layout 'EP2,D2'.*expert-model-parallel-size 2 does "
                                          "not divide"):
        eq.check_fits(flags, eq.parse_layout("EP2,D2"))
    with pytest.raises(ConfigError, match="unrecognized arguments: --no-such-flag"):
        eq.check_fits([*flags, "--no-such-flag"], eq.Layout("one process"))


def test_compare_names_the_first_divergence():
    ref = eq.Curves({1: 5.0, 2: 4.0, 3: 3.0}, {1: 2.0, 2: 1.0, 3: 1.0})
    same = eq.Curves({1: 5.0, 2: 4.0 * (1 + 1e-6), 3: 3.0}, {1: 2.0, 2: 1.0, 3: 1.0})
    assert eq.compare(ref, same, 1e-5).first == ""
    off = eq.Curves({1: 5.0, 2: 4.0, 3: 2.0}, {1: 2.0, 2: 1.5, 3: 1.0})
    result = eq.compare(ref, off, 1e-5)
    assert result.first.startswith("step 2: grad norm 1.5 vs 1")
    assert result.grad_norm == pytest.approx(0.5) and result.loss == pytest.approx(1 / 3)


def test_param_deltas_name_the_parameter_from_two_checkpoints(tmp_path):
    """Two one-step torch_dist checkpoints (written as the runs write them, DCP chunks under
    global names): the gradient moment of one parameter differs, and it is the one named."""
    import torch

    from megatron_chimera.checkpoint.checkpointing import checkpoint_dir
    from megatron_chimera.checkpoint.dcp_io import SaveChunk, save_chunks
    from megatron_chimera.training.equivalence_params import param_deltas

    def write(root, grad_scale):
        tensors = {"model/layers.0.w": torch.ones(4, 3),
                   "optim/layers.0.w/exp_avg": torch.full((4, 3), 0.1 * grad_scale),
                   "model/layers.1.w": torch.arange(6.0),
                   "optim/layers.1.w/exp_avg": torch.full((6,), 0.2)}
        chunks = {(fqn, (0,) * t.dim()): SaveChunk(tuple(t.shape), t) for fqn, t in
                  tensors.items()}
        save_chunks(checkpoint_dir(str(root), 1), chunks)

    write(tmp_path / "ref", 1.0)
    write(tmp_path / "other", 2.0)
    write(tmp_path / "noise", 1.0 + 1e-4)  # below the per-parameter gradient bound
    ref = eq.Curves({1: 5.0}, {1: 2.0}, tmp_path / "ref")
    assert eq.compare(ref, eq.Curves({1: 5.0}, {1: 2.0}, tmp_path / "noise"), 1e-5).first == ""
    result = eq.compare(ref, eq.Curves({1: 5.0}, {1: 4.0}, tmp_path / "other"), 1e-5)
    assert result.first == ("step 1: grad norm 4 vs 2; first parameter: grad of layers.0.w "
                            "(rel 1.00e+00)") and result.param == 1.0
    deltas = param_deltas(tmp_path / "ref", tmp_path / "other", 1)
    assert str(deltas[0]) == "grad of layers.0.w (rel 1.00e+00)"
    assert [d.rel for d in deltas[1:]] == [0.0, 0.0, 0.0]
    with pytest.raises(FileNotFoundError, match="no checkpoint of step 2"):
        param_deltas(tmp_path / "ref", tmp_path / "other", 2)


@pytest.mark.parametrize("argv, reason", [
    (["--layouts", "EP2,D2", "--", *USER], "layout 'EP2,D2': --expert-model-parallel-size 2"),
    (["--layouts", "T2,Q4", "--", *USER], "layout 'T2,Q4': unknown part 'Q4'"),
    (["--layouts", "D2", "--", *USER, "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--", *USER], "no layout given"),
    (["--against-flag", "--no-such-flag", "--layouts", "D2", "--", *USER],
     "unrecognized arguments: --no-such-flag"),
])
def test_the_tool_refuses_in_one_line_before_any_run(argv, reason, capsys):
    """tools/check_equivalence.py itself: exit 2 and one line naming why, no run started."""
    import importlib.util

    from tests.helpers import REPO_ROOT

    spec = importlib.util.spec_from_file_location(
        "check_equivalence_tool", REPO_ROOT / "tools" / "check_equivalence.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main(argv) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("check_equiv")]
    assert len(err) == 1 and reason in err[0], err


def test_a_failed_run_is_named_by_its_ranks_error_not_torchruns_summary():
    """torchrun ends a failed job with its own summary (a pointer to its error docs); the
    checker shows the first line that names the rank's error instead."""
    output = ("[rank 3] RuntimeError: pipeline failure: rank 3 timed out receiving F0.1.2\n"
              "[rank 0] RuntimeError: rank 3 failed first\n"
              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
              "  error_file: <N/A>\n"
              "  traceback : To enable traceback see: "
              "https://pytorch.org/docs/stable/elastic/errors.html\n")
    assert eq.failure_line(output, 1) == ("[rank 3] RuntimeError: pipeline failure: rank 3 "
                                          "timed out receiving F0.1.2")
    assert eq.failure_line("killed\n", -9) == "exit -9"
