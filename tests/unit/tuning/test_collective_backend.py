"""The profile's collective backend: NCCL moves device memory over the links; gloo (as the Chimera
paper's runtime ran) stages every message and all-reduce through the host.

The references below are the published figures typed out again (megatron_chimera/tuning/
hardware.py names the sources): the P100's pinned copies at 11,688 MB/s host -> device and
12,886 MB/s device -> host, gloo's ring over TCP at 20 MB per 17,251 us per rank.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
from pathlib import Path

import pytest

from megatron_chimera.config import ConfigError, ModelConfig
from megatron_chimera.tuning.analytic_costs import ModelSpec
from megatron_chimera.tuning.hardware import PRESETS, load_hardware_profile
from megatron_chimera.tuning.perf_model import PerformanceModel
from megatron_chimera.tuning.training_plan import TrainingPlan

ROOT = Path(__file__).resolve().parents[3]
H2D, D2H = 11.688e9, 12.886e9  # bytes/s, Microway's bandwidthTest on a Tesla P100-PCIE-16GB
GLOO = 20e6 / 17_251e-6  # bytes/s, pytorch/gloo issue #248


def small() -> ModelSpec:
    """A 4-layer fp32 GPT: cheap to simulate, messages and gradients of real sizes."""
    return ModelSpec(ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=4,
                                 seq_length=128, vocab_size=1000, params_dtype="fp32"), "gpt2")


def test_gloo_prices_host_copies_and_the_host_path_nccl_the_link():
    """An all-reduce of n bytes over r replicas with gloo costs Rabenseifner's latency, the ring's
    2 (r-1)/r n at gloo's host bandwidth, and the whole buffer copied down and up over PCIe; a
    pipeline message crosses PCIe twice around the send. With NCCL both are the Aries link's."""
    layout = TrainingPlan.of("chimera", 4, 2, 1, 4, pipes=2)
    replicas = layout.pipes * layout.W
    nbytes = 80e6
    aries = PRESETS["p100"].inter_node
    gloo = PerformanceModel(small(), PRESETS["p100-gloo"]).cost_model(layout)
    nccl = PerformanceModel(small(), PRESETS["p100"]).cost_model(layout)
    latency = 2 * math.log2(replicas) * aries.alpha_s
    ring = 2 * (replicas - 1) / replicas * nbytes
    assert gloo.allreduce_time(replicas, nbytes) == pytest.approx(
        latency + ring / GLOO + nbytes / H2D + nbytes / D2H, rel=1e-9)
    assert nccl.allreduce_time(replicas, nbytes) == pytest.approx(
        latency + ring / (aries.bandwidth_gbps * 1e9), rel=1e-9)
    size = gloo.activation_bytes
    assert size == 128 * 256 * 4
    for costs, per_byte in ((gloo, 1 / GLOO + 1 / H2D + 1 / D2H),
                            (nccl, 1 / (aries.bandwidth_gbps * 1e9))):
        assert costs.p2p_edges
        for _, _, alpha, beta in costs.p2p_edges:
            assert alpha + beta * size == pytest.approx(aries.alpha_s + per_byte * size,
                                                        rel=1e-9)
    # a slower link than gloo's host path bounds the ring instead
    slow = dataclasses.replace(PRESETS["p100-gloo"],
                               inter_node=dataclasses.replace(aries, bandwidth_gbps=0.5))
    link = slow.collective_link(slow.inter_node, 4)
    assert 1 / (link.bandwidth_gbps * 1e9) == pytest.approx(
        1 / 0.5e9 + (1 / H2D + 1 / D2H) / 1.5, rel=1e-9)


def test_a_gloo_profile_needs_its_host_figures_and_round_trips(tmp_path):
    """gloo without the copy or host-path bandwidth, or an unknown backend, is refused with the
    key named; the gloo preset loads back from its JSON form."""
    gloo = PRESETS["p100-gloo"]
    path = tmp_path / "gloo.json"
    path.write_text(json.dumps(gloo.to_dict()))
    assert load_hardware_profile(path) == gloo
    for change, message in ((dict(host_copy_gbps=0.0), "host_copy_gbps"),
                            (dict(host_transport_gbps=0.0), "host_transport_gbps"),
                            (dict(collective_backend="mpi"), "collective_backend")):
        path.write_text(json.dumps(gloo.to_dict() | change))
        with pytest.raises(ConfigError, match=message):
            load_hardware_profile(path)
    assert PRESETS["p100"].describe_backend().startswith("nccl")
    assert "host-staged" in gloo.describe_backend()


def test_predict_cli_names_the_backend_and_prices_it(tmp_path, capsys):
    """``tools/autotune.py --predict --hardware p100-gloo`` prints the backend, writes it to the
    JSON record and prices the layout as the model does (slower than device-direct NCCL)."""
    spec = importlib.util.spec_from_file_location("autotune_cli", ROOT / "tools" / "autotune.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    argv = ["--predict", "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads",
            "4", "--seq-length", "128", "--vocab-size", "1000", "--num-gpus", "8",
            "--global-batch-size", "8",
            "--pipeline-model-parallel-size", "4", "--pipeline-schedule", "chimera",
            "--chimera-pipes", "2", "--micro-batch-size", "1"]
    records = {}
    for name in ("p100", "p100-gloo"):
        path = tmp_path / f"{name}.json"
        assert cli.main([*argv, "--hardware", name, "--json", str(path)]) == 0
        records[name] = json.loads(path.read_text())
    out = capsys.readouterr().out
    assert "collectives: gloo (host-staged" in out and "collectives: nccl" in out
    assert records["p100-gloo"]["collective_backend"] == "gloo"
    layout = TrainingPlan.of("chimera", 4, 2, 1, 4, pipes=2)
    expected = PerformanceModel(small(), PRESETS["p100-gloo"]).predict(layout)
    assert records["p100-gloo"]["iteration_s"] == pytest.approx(expected.iteration_s)
    assert records["p100-gloo"]["iteration_s"] > records["p100"]["iteration_s"]
