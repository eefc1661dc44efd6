"""Against real megatron-core (skipped unless ``megatron.core`` is importable; never a runtime
dependency): Megatron's own ``torch_dist`` and legacy saves import with every weight equal to
Megatron's bitwise and logits equal to Megatron's ``GPTModel.forward`` (fp32, 1e-5: 1.2e-7
observed with megatron-core 0.16.1, torch 2.13 CPU); our export loads back into Megatron with
``dist_checkpointing.load(strict=RAISE_ALL)`` (no missing or unexpected key) and equal tensors;
Megatron's T=2 x P=2 legacy files (4 gloo ranks) merge into exactly its torch_dist tensors.
Megatron runs in a subprocess (tests/helpers/megatron_oracle.py: it needs CUDA shims)."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys

import pytest
import torch

from megatron_chimera.inference.loader import load_model
from megatron_chimera.megatron_lm.exporter import export_megatron
from megatron_chimera.megatron_lm.importer import import_megatron
from megatron_chimera.megatron_lm.torch_dist_reader import TorchDistReader
from tests.helpers import REPO_ROOT

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                                or importlib.util.find_spec("megatron.core") is None,
                                reason="megatron-core is not installed (the optional oracle)")
LOGIT_ATOL = 1e-5


def _oracle(*argv: str) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "tests.helpers.megatron_oracle", *argv], cwd=REPO_ROOT,
                   env=env, check=True, timeout=300, capture_output=True)


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_megatron_core_checkpoints_in_and_out(kind, tmp_path):
    _oracle("save", kind, str(tmp_path / "megatron"))
    source = TorchDistReader(str(tmp_path / "megatron/torch_dist/iter_0000007"))
    reference = torch.load(tmp_path / "megatron/logits.pt")
    models = {}
    for fmt in ("torch_dist", "legacy"):
        import_megatron(str(tmp_path / "megatron" / fmt), str(tmp_path / f"ours_{fmt}"))
        models[fmt] = load_model(str(tmp_path / f"ours_{fmt}")).model
        with torch.no_grad():
            logits = models[fmt](reference["tokens"], torch.arange(12).expand(2, 12))
        assert (logits - reference["logits"]).abs().max() < LOGIT_ATOL
    ours = models["torch_dist"].state_dict()
    legacy = models["legacy"].state_dict()
    assert all(torch.equal(ours[k], legacy[k]) for k in ours)
    megatron = dict(source.iter_model(2))
    assert len(megatron) == len(ours)
    exported = export_megatron(str(tmp_path / "ours_torch_dist"), str(tmp_path / "out"))
    assert TorchDistReader(exported.path).tensors.keys() == source.tensors.keys()
    _oracle("load", kind, str(tmp_path / "out"), str(tmp_path / "loaded.pt"))
    loaded = torch.load(tmp_path / "loaded.pt")
    original = torch.load(tmp_path / "megatron/legacy/iter_0000007/mp_rank_00/model_optim_rng.pt",
                          weights_only=False)["model"]
    for name, value in loaded.items():
        assert torch.equal(value, original[name]), name


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_megatron_core_t2_p2_legacy_files_merge_into_its_torch_dist_layout(kind, tmp_path):
    """Megatron's own T=2 x P=2 save: the legacy per-rank files merged (QKV groups, SwiGLU's
    per-rank [gate_r; up_r], row-parallel columns, stage renumbering, the tied copy) give exactly
    the tensors Megatron's torch_dist holds."""
    _oracle("save", kind, str(tmp_path / "megatron"), "2", "2")
    for fmt in ("torch_dist", "legacy"):
        import_megatron(str(tmp_path / "megatron" / fmt), str(tmp_path / f"ours_{fmt}"))
    first = load_model(str(tmp_path / "ours_torch_dist")).model.state_dict()
    second = load_model(str(tmp_path / "ours_legacy")).model.state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
