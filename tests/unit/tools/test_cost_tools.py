"""The cost tools end to end: compare_schedules.py --cost-grid and benchmark_generation.py."""

from __future__ import annotations

import importlib.util
import json
import re
import sys

import pytest
import torch

from megatron_chimera.errors import UsageError
from tests.helpers import REPO_ROOT

ROOT = REPO_ROOT


def tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_cost_grid_prints_every_point_and_writes_json(tmp_path, capsys):
    out = tmp_path / "grid.json"
    assert tool("compare_schedules").main(["-D", "4", "-N", "4", "--cost-grid", "--json",
                                           str(out)]) == 0
    text = capsys.readouterr().out
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + 12  # header and B/F {0.5,1,1.5,2} x W/B {0.25,0.5,1}
    assert "lower bound" in rows[0] and "zb measured" in rows[0] and "chimera" in rows[0]
    points = json.loads(out.read_text())
    assert len(points) == 12
    for p in points:
        assert p["lower_bound"] <= min(p["makespans"].values()) + 1e-9
        assert p["chosen_makespan"] <= min(p["makespans"]["1f1b"], p["makespans"]["chimera"])


@pytest.mark.parametrize("argv,message", [
    (["--cost-grid", "--weight-cost", "1"], "--cost-grid sets the costs .* --weight-cost"),
    (["--cost-grid", "--chimera-zb-costs", "1,1,1"], "drop --chimera-zb-costs"),
    (["--end-stage-factor", "2"], "--end-stage-factor apply only with --cost-grid"),
    (["--cost-grid", "--measurement-noise", "1.5"], "--measurement-noise must be in"),
])
def test_cost_grid_flags_rejected(argv, message):
    with pytest.raises(UsageError) as info:  # run_tool prints it as one error line, exit 2
        tool("compare_schedules").main(["-D", "4", "-N", "4", *argv])
    assert re.search(message, str(info.value))


def test_generation_benchmark(tmp_path, capsys):
    out = tmp_path / "gen.json"
    assert tool("benchmark_generation").main(["-D", "4", "--n-per-d", "1", "2", "--json",
                                              str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["D"], r["N"], r["costs"]) for r in rows] == [
        (4, 4, "unit"), (4, 4, "skewed"), (4, 8, "unit"), (4, 8, "skewed")]
    assert all(r["makespan"] >= r["lower_bound"] and r["seconds"] > 0 for r in rows)
    assert "| 4 | 8 | skewed |" in capsys.readouterr().out


@pytest.mark.parametrize("clock", ["wall", "cpu"])
def test_layer_host_overhead_compares_our_layer_with_a_plain_one(tmp_path, clock):
    """``benchmark_layer.py --host-overhead`` times both stacks and writes the ratios; the two
    stacks compute the same math, so the plain layer is a fair baseline (its output shape and
    gradient flow are checked here, the ratio target is the benchmark's to report). ``--clock
    cpu`` times the thread's CPU time."""
    bench = tool("benchmark_layer")
    figures = bench.host_overhead(layers=1, steps=3, warmup=1, clock=clock)
    for key in ("ours_forward_us", "ours_backward_us", "plain_forward_us", "plain_backward_us",
                "split_forward_us", "split_backward_us"):
        assert figures[key] > 0, key
    assert figures["forward_ratio"] == figures["ours_forward_us"] / figures["plain_forward_us"]
    assert figures["backward_ratio"] == (figures["ours_backward_us"]
                                         / figures["plain_backward_us"])
    plain = bench.PlainLayer(32, 2, 0.0)
    x = torch.randn(4, 1, 32, requires_grad=True)
    plain(x).sum().backward()
    assert plain(x).shape == x.shape and all(p.grad is not None for p in plain.parameters())


def test_host_costs_of_traced_gaps_resimulate_a_row():
    """benchmark_schedules.py --trace: the mean local gap is the per-action host time; a
    critical message costs posting + flight + wake-up less that (the simulator charges it
    before every compute); a row's simulation with them is the simulator's with those terms."""
    from megatron_chimera.pipeline.trace import GapBreakdown
    from megatron_chimera.schedules import build_schedule
    from megatron_chimera.schedules.simulate import CostModel, simulate

    bench = tool("benchmark_schedules")
    gaps = GapBreakdown(hops=[0.001, 0.003], wake_to_start=[0.0005, 0.0005],
                        end_to_send=[0.0001, 0.0003], local_gaps=[0.0002, 0.0004])
    host = bench.HostCosts.of(gaps)
    assert host.action_s == pytest.approx(0.0003)
    assert host.message_s == pytest.approx(0.0002 + 0.002 + 0.0005 - 0.0003)
    assert bench.HostCosts.of(GapBreakdown(local_gaps=[0.1])) is None  # no critical hop
    schedule = build_schedule("zbv", 4, 8)
    model = CostModel(0.01, 0.02, 0.01, p2p_alpha=1e-5)
    row = bench.Row("zbv", {}, 4, 8, 1.0, 0.5, {"sim_inputs": (schedule, model)})
    expected = simulate(schedule, CostModel(0.01, 0.02, 0.01, p2p_alpha=host.message_s,
                                            action_overhead=host.action_s)).makespan
    assert host.simulate(row) == pytest.approx(expected)
    assert expected > simulate(schedule, model).makespan
    assert host.simulate(bench.Row("torch-zbv", {}, 4, 8, 1.0, None)) is None


def test_host_costs_charge_what_the_computes_overran():
    """The traced compute times of a row, against its simulated (nominal) ones, give the
    overrun per action, pooled over the rows; the simulation charges it with the host's time
    before each action."""
    from megatron_chimera.pipeline.trace import GapBreakdown
    from megatron_chimera.schedules import build_schedule
    from megatron_chimera.schedules.simulate import CostModel, simulate

    bench = tool("benchmark_schedules")
    schedule = build_schedule("1f1b", 2, 2)
    model = CostModel(0.01, 0.02)
    nominal = simulate(schedule, model)
    over = 0.001  # every traced action 1 ms longer than nominal, two traced iterations
    computes = [e.end - e.start + over for e in nominal.events] * 2
    gaps = GapBreakdown(hops=[0.001], wake_to_start=[0.0], end_to_send=[0.0],
                        local_gaps=[0.0002], computes=computes)
    row = bench.Row("1f1b", {}, 2, 2, 1.0, nominal.makespan,
                    {"gaps": gaps, "sim_inputs": (schedule, model),
                     "nominal_compute": (sum(nominal.busy), len(nominal.events))})
    host = bench.host_costs([row, bench.Row("torch-1f1b", {}, 2, 2, 1.0, None)])
    assert host.overrun_s == pytest.approx(over)
    assert host.per_action_s == pytest.approx(0.0002 + over)
    expected = simulate(schedule, CostModel(0.01, 0.02, p2p_alpha=host.message_s,
                                            action_overhead=0.0002 + over)).makespan
    assert host.simulate(row) == pytest.approx(expected)


@pytest.mark.parametrize("p2p_us, costs, message", [
    ("fast", "known", "p2p_us= takes microseconds >= 0, got fast"),
    (-5, "known", "p2p_us= takes microseconds >= 0, got -5"),
    ("nan", "known", "p2p_us= takes microseconds >= 0, got nan"),
    (300, "unit", "p2p_us= applies to an order built for the known costs, not to costs=unit"),
])
def test_benchmark_row_message_time_rejected(p2p_us, costs, message):
    from megatron_chimera.config import ConfigError

    bench = tool("benchmark_schedules")
    with pytest.raises(ConfigError, match=re.escape(message)):
        bench.build_message_seconds("bitpipe-zb", p2p_us, costs)
    assert bench.build_message_seconds("bitpipe-zb", 400, "known") == pytest.approx(4e-4)
    assert bench.build_message_seconds("bitpipe-zb", 0, "unit") == 0.0


def test_benchmark_overlap_ratio_line_pairs_rows_with_and_without_the_flag():
    """benchmark_schedules.py --all-to-all-ms: each row with overlap_moe_expert_parallel_comm is
    compared with the same schedule, N and options without it (measured and simulated ratio);
    --trace and negative times are refused for MoE rows."""
    bench = tool("benchmark_schedules")
    rows = [bench.Row("chimera", {}, 4, 16, 2.0, 1.9, {"exposed_all_to_all_s": 1.0}),
            bench.Row("chimera", {bench.OVERLAP_OPTION: 1}, 4, 16, 1.4, 1.3,
                      {"exposed_all_to_all_s": 0.2}),
            bench.Row("1f1b", {bench.OVERLAP_OPTION: 1}, 4, 16, 3.0, 3.0)]  # no partner row
    lines = [line for line in bench.overlap_ratios(rows) if line]
    assert len(lines) == 1
    assert "chimera N=16: measured 1.400 s with / 2.000 s without = 0.700" in lines[0]
    assert f"(simulated {1.3 / 1.9:.3f})" in lines[0]
    for argv, message in ((["--all-to-all-ms", "5", "--trace"], "--trace does not apply"),
                          (["--all-to-all-ms", "-1"], "--all-to-all-ms must be >= 0")):
        with pytest.raises(UsageError) as info:
            bench.parse_args(argv)
        assert message in str(info.value)
