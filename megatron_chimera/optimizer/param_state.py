"""Per-parameter optimizer state as checkpoints store it, independent of how it is held.

A checkpoint keeps, for every model parameter (by global name), the inner optimizer's state of its
main parameter -- moment tensors shaped like the parameter, scalars such as torch's ``step`` --
plus ``main_param``, the fp32 main copy of a 16-bit parameter. The local optimizer reads and writes
these entries directly; the distributed optimizer gathers or slices its shards into and out of
them. Either way the file is the same, so any layout resumes any other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

ParamEntry = dict[str, Any]

# optimizer group entries that choose a kernel: they follow the resuming run, not the checkpoint
KERNEL_CHOICES = ("foreach", "fused", "capturable", "differentiable")
MAIN_PARAM = "main_param"


@dataclass
class ParamFragments:
    """One parameter's optimizer state as a sharded checkpoint keeps it: per-parameter scalars
    and, per flat range of the local shard (keyed by its offset), the per-element values."""

    scalars: dict[str, Any] = field(default_factory=dict)
    ranges: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)


class ParamStateError(ValueError):
    """Saved optimizer state that does not fit this run's parameters."""


def to_host(value: Any) -> Any:
    """A tensor as saved: on the host, with no device-side copy (a device tensor is copied to
    host memory; a host tensor is written as it is, since saving is synchronous)."""
    return value.detach().cpu() if torch.is_tensor(value) else value


def own_copy(entry: ParamEntry) -> ParamEntry:
    """A copy of ``entry`` whose tensors are not shared with any other entry."""
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in entry.items()}


def is_elementwise(value: Any, numel: int) -> bool:
    """Whether a state value holds one number per parameter element (Adam's moments), as
    opposed to a per-parameter scalar (torch's ``step``)."""
    return torch.is_tensor(value) and value.dim() > 0 and value.numel() == numel


def load_inner(inner: torch.optim.Optimizer, states: dict[int, ParamEntry],
               saved_groups: list[dict[str, Any]] | None) -> None:
    """Restore the inner optimizer through its own ``load_state_dict``, so its policy applies
    (e.g. fused / capturable Adam's ``step`` on the parameter's device, state cast to the
    parameter's dtype and device) and group entries such as Apex FusedAdam's ``step`` return.

    ``states`` maps ``id(param)`` of the inner optimizer's parameters to their state."""
    groups, state, index = [], {}, 0
    usable = saved_groups if saved_groups and len(saved_groups) == len(inner.param_groups) else None
    for position, group in enumerate(inner.param_groups):
        hyper = {k: v for k, v in group.items() if k != "params"}
        if usable is not None:  # the saved entries, but this run's choice of kernel
            hyper.update({k: v for k, v in usable[position].items() if k not in KERNEL_CHOICES})
        ids = []
        for param in group["params"]:
            if id(param) in states:
                state[index] = states[id(param)]
            ids.append(index)
            index += 1
        groups.append({**hyper, "params": ids})
    inner.load_state_dict({"state": state, "param_groups": groups})


def group_entries(inner: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The inner optimizer's group entries besides the parameters (lr, betas, Apex's step)."""
    return [{k: to_host(v) for k, v in group.items() if k != "params"}
            for group in inner.param_groups]
