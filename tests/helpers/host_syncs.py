"""Count the host synchronisations a piece of code would make on a GPU, on CPU: the aten ops
that read a tensor's value on the host (``_local_scalar_dense`` behind ``.item()``, ``nonzero``,
``masked_select``, ``unique``, ``repeat_interleave`` without ``output_size``), plus
``Tensor.tolist`` and ``torch.tensor`` of a Python list (a pageable host-to-device copy)."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_READS = {"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select",
          "aten._unique2", "aten.unique_consecutive", "aten.unique_dim"}


class _Reads(TorchDispatchMode):
    def __init__(self, counts: Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        if name in _READS:
            self.counts[name] += 1
        elif str(func) == "aten.repeat_interleave.Tensor" and kwargs.get("output_size") is None:
            self.counts["aten.repeat_interleave (no output_size)"] += 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_host_syncs() -> Iterator[Counter]:
    """Within the block, count host reads of device values by kind (a Counter; ``total()``
    is the number of synchronisations the block would make on CUDA)."""
    counts: Counter = Counter()
    tolist, tensor = torch.Tensor.tolist, torch.tensor

    def counted_tolist(self):
        counts["Tensor.tolist"] += 1
        return tolist(self)

    def counted_tensor(data, *args, **kwargs):
        if isinstance(data, (list, tuple)):
            counts["torch.tensor(list)"] += 1
        return tensor(data, *args, **kwargs)

    torch.Tensor.tolist, torch.tensor = counted_tolist, counted_tensor
    try:
        with _Reads(counts):
            yield counts
    finally:
        torch.Tensor.tolist, torch.tensor = tolist, tensor
