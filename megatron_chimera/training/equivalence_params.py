"""Per-parameter comparison of two runs' per-step ``torch_dist`` checkpoints.

A ``torch_dist`` checkpoint stores every tensor whole under a layout-independent name
(``model/<name>``, ``optim/<name>/<key>``), whatever T, CP, EP, D or the schedule, so the
checkpoints of one process and of a layout after the same step compare name by name. The
gradient is read as Adam's first moment ``exp_avg`` (``(1 - beta1) x`` the gradient at step 1, a
running mean after it): it first differs at the step where the gradient first differs. The value
is the fp32 main parameter when one is saved (mixed precision), the model tensor otherwise.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_chimera.checkpoint.checkpointing import checkpoint_dir
from megatron_chimera.checkpoint.dcp_io import load_chunks
from megatron_chimera.checkpoint.safe_reader import read_metadata


@dataclass(frozen=True)
class ParamDelta:
    """One parameter's relative difference ``|a - b| / |b|`` (L2 norms) at one step."""

    name: str
    kind: str  # "grad" (Adam's first moment) or "value"
    rel: float

    def __str__(self) -> str:
        return f"{self.kind} of {self.name} (rel {self.rel:.2e})"


def step_tensors(root: Path, step: int) -> dict[tuple[str, str], torch.Tensor]:
    """``{(parameter, "value" | "grad"): tensor}`` of the checkpoint saved after ``step``."""
    path = checkpoint_dir(str(root), step)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint of step {step} under {root}")
    found: dict[tuple[str, str], torch.Tensor] = {}
    mains: dict[str, torch.Tensor] = {}
    for fqn, tensor in _read_all(path).items():
        kind, _, rest = fqn.partition("/")
        if kind == "model":
            found[(rest, "value")] = tensor
        elif kind == "optim":
            name, _, key = rest.rpartition("/")
            if key == "exp_avg":
                found[(name, "grad")] = tensor
            elif key == "main_param":
                mains[name] = tensor
    for name, tensor in mains.items():  # mixed precision: compare the fp32 master
        found[(name, "value")] = tensor
    return found


def _read_all(path: str) -> dict[str, torch.Tensor]:
    """Every stored tensor of the checkpoint, whole, in one read (a proxy's are small)."""
    metadata = read_metadata(path)
    requests: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if hasattr(md, "chunks"):
            requests[(fqn, (0,) * len(md.size))] = torch.zeros(tuple(md.size),
                                                               dtype=md.properties.dtype)
    load_chunks(path, requests, collective=False)
    return {fqn: tensor for (fqn, _), tensor in requests.items()}


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    want64, got64 = want.double(), got.double()
    if got64.shape != want64.shape:
        return float("inf")
    scale = float(torch.linalg.vector_norm(want64))
    diff = float(torch.linalg.vector_norm(got64 - want64))
    if scale == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / scale


def param_deltas(reference: Path, other: Path, step: int) -> list[ParamDelta]:
    """Every parameter's relative difference after ``step``, largest first; a tensor only one
    run saved counts as infinitely different."""
    want, got = step_tensors(reference, step), step_tensors(other, step)
    deltas = [ParamDelta(name, kind, _relative(got[(name, kind)], tensor)
                         if (name, kind) in got else float("inf"))
              for (name, kind), tensor in want.items()]
    deltas += [ParamDelta(name, kind, float("inf")) for name, kind in got if (name, kind)
               not in want]
    return sorted(deltas, key=lambda d: (-d.rel, d.kind != "grad", d.name))
