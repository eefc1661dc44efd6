"""Single-tensor all-gather and reduce-scatter that work across torch versions.

torch 2.13 names them ``all_gather_single`` / ``reduce_scatter_single`` and deprecates the older
``all_gather_into_tensor`` / ``reduce_scatter_tensor``; earlier releases have only the older
names. Every caller (tensor- and sequence-parallel mappings, the bucketed gradient reduction, the
distributed optimizer's parameter gather) goes through these two functions, so the project runs
on either without a deprecation warning on the newer one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


def _resolve(new_name: str, old_name: str) -> Callable:
    """The newer collective when this torch has it, else the older one (same signature)."""
    return getattr(dist, new_name, None) or getattr(dist, old_name)


def all_gather_single(output: torch.Tensor, tensor: torch.Tensor,
                      group: dist.ProcessGroup | None = None, async_op: bool = False,
                      *, impl: Callable | None = None):
    """Concatenate every rank's ``tensor`` along dimension 0 into ``output`` (``impl``: a test
    forces one of the two torch spellings)."""
    impl = impl or _resolve("all_gather_single", "all_gather_into_tensor")
    return impl(output, tensor, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, tensor: torch.Tensor,
                          group: dist.ProcessGroup | None = None, async_op: bool = False,
                          *, impl: Callable | None = None):
    """SUM ``tensor`` over the ranks and keep this rank's slice of dimension 0 in ``output``
    (``impl``: a test forces one of the two torch spellings)."""
    impl = impl or _resolve("reduce_scatter_single", "reduce_scatter_tensor")
    return impl(output, tensor, group=group, async_op=async_op)
