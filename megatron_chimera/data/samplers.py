"""Megatron's pretraining sampler, collate function and data iterator, resumable at any sample.

The samples of an iteration are ``num_microbatches x micro_batch_size x data_parallel_size``
consecutive sample ids starting at ``consumed_samples``. Step ``j`` of the sampler takes the next
``micro_batch_size x data_parallel_size`` ids and gives replica ``r`` the slice
``[r * micro_batch_size, (r + 1) * micro_batch_size)``. So replica ``r`` reads its micro-batches in
global micro-batch order, every rank of a pipeline (same ``r``) reads the same ones, and resuming
with the saved ``consumed_samples`` continues with exactly the next sample. With Chimera the
executor hands pipe ``p`` the block ``[p * N / P, (p + 1) * N / P)`` of these ``N`` micro-batches
(``next_microbatches`` returns them in that global order).
"""

from __future__ import annotations

import itertools
import signal
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import torch

from megatron_chimera.config import ConfigError


class MegatronPretrainingSampler:
    """Yields this replica's micro-batches of sample indices, from ``consumed_samples`` on."""

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ) -> None:
        if total_samples <= 0:
            raise ConfigError(f"no samples to train on (total_samples={total_samples})")
        if consumed_samples < 0 or consumed_samples >= total_samples:
            raise ConfigError(
                f"consumed_samples {consumed_samples} is outside the dataset of {total_samples}"
            )
        if micro_batch_size <= 0:
            raise ConfigError("--micro-batch-size must be positive")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ConfigError(
                f"data_parallel_rank {data_parallel_rank} not in [0, {data_parallel_size})"
            )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.step = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        full, rest = divmod(self.total_samples - self.consumed_samples, self.step)
        return full + (1 if rest > self.data_parallel_rank * self.micro_batch_size
                       and not self.drop_last else 0)

    def __iter__(self) -> Iterator[list[int]]:
        first = self.data_parallel_rank * self.micro_batch_size
        start = self.consumed_samples
        while start + self.step <= self.total_samples:
            yield list(range(start + first, start + first + self.micro_batch_size))
            start += self.step
        if not self.drop_last:
            rest = list(range(start + first, min(start + first + self.micro_batch_size,
                                                  self.total_samples)))
            if rest:
                yield rest


def microbatch_first_samples(consumed_samples: int, num_microbatches: int, micro_batch_size: int,
                             data_parallel_rank: int, data_parallel_size: int) -> list[int]:
    """Global index of the first sample of each of this replica's ``N`` micro-batches of the
    iteration starting at ``consumed_samples`` (the sampler's layout: step ``m`` gives replica
    ``r`` samples ``consumed + (m W + r) B ...``), so the same sample has the same index on any
    data-parallel size."""
    return [consumed_samples + (m * data_parallel_size + data_parallel_rank) * micro_batch_size
            for m in range(num_microbatches)]


def batch_tokens(dataset: object, first_sample: int, count: int) -> int | None:
    """Input tokens of samples ``[first_sample, first_sample + count)`` (a global batch, every
    replica's share) when the dataset counts them (``real_tokens``: packed samples whose padding
    is not work), else None. Host-side, from the packing: no device sync."""
    counter = getattr(dataset, "real_tokens", None)
    if counter is None:
        return None
    return sum(counter(i) for i in range(first_sample, first_sample + count))


def collate_samples(samples: Sequence[dict[str, object]]) -> dict[str, torch.Tensor]:
    """Stack a list of sample dicts (numpy arrays or ints) into a dict of torch tensors."""
    out: dict[str, torch.Tensor] = {}
    for key in samples[0]:
        values = [s[key] for s in samples]
        if isinstance(values[0], np.ndarray):
            out[key] = torch.from_numpy(np.stack(values))
        else:
            out[key] = torch.tensor(values)
    return out


def build_pretraining_data_loader(
    dataset: torch.utils.data.Dataset,
    consumed_samples: int,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    num_workers: int = 2,
) -> torch.utils.data.DataLoader:
    """Megatron's ``build_pretraining_data_loader`` with the single (sequential) sampler."""
    sampler = MegatronPretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                         data_parallel_rank, data_parallel_size)
    # A private generator for the loader's worker seed: creating (or re-creating) an iterator
    # never draws from the global torch RNG, so it cannot shift the training's random stream.
    return torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, num_workers=num_workers, collate_fn=collate_samples,
        pin_memory=torch.cuda.is_available(), persistent_workers=num_workers > 0,
        generator=torch.Generator().manual_seed(consumed_samples),
        worker_init_fn=ignore_sigterm,
    )


def ignore_sigterm(worker_id: int = 0) -> None:  # noqa: ARG001 - worker_init_fn signature
    """A data worker ignores SIGTERM (``scancel`` signals every process of the job): it ends
    with the training process, which may catch SIGTERM to save first (--exit-signal-handler),
    instead of dying and failing the process's next batch."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def build_data_iterator(
    dataset: torch.utils.data.Dataset | None,
    consumed_samples: int,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    num_workers: int = 2,
    read: bool = True,
) -> Iterator[dict[str, torch.Tensor] | None] | None:
    """An iterator over this replica's micro-batches (``None`` for a missing split). With
    ``read=False`` (a rank none of whose stages reads the data) it yields ``None`` forever: no
    worker loads or collates a batch only to throw it away."""
    if dataset is None:
        return None
    if not read:
        return itertools.repeat(None)
    return iter(build_pretraining_data_loader(dataset, consumed_samples, micro_batch_size,
                                              data_parallel_rank, data_parallel_size, num_workers))


def batch_to_device(micro_batch: dict[str, torch.Tensor], device: torch.device | str,
                    fields: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """The ``fields`` (default all) of a collated micro-batch on ``device``. The copies are
    asynchronous (``non_blocking``): the DataLoader pins its batches on CUDA machines, so the
    host does not wait for the transfer; on the CPU they are the tensors themselves."""
    names = micro_batch.keys() if fields is None else [f for f in fields if f in micro_batch]
    return {name: micro_batch[name].to(device, non_blocking=True) for name in names}


def next_microbatches(
    data_iterator: Iterator[dict[str, torch.Tensor]] | None,
    num_microbatches: int,
    needed: Iterable[int] | None = None,
) -> list[dict[str, torch.Tensor] | None]:
    """The ``N`` micro-batches of one iteration, in global micro-batch order.

    Always advances the iterator by ``N`` so every rank stays in step; entries whose id is not in
    ``needed`` (a rank with no first or last stage of that micro-batch's pipe) are ``None``.
    """
    if data_iterator is None:
        return [None] * num_microbatches
    keep = set(range(num_microbatches)) if needed is None else set(needed)
    batches: list[dict[str, torch.Tensor] | None] = []
    for m in range(num_microbatches):
        batch = next(data_iterator)
        batches.append(batch if m in keep else None)
    return batches
