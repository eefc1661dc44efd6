"""Weighted blending of datasets (``--data-path w1 p1 w2 p2 ...``), as Megatron's BlendableDataset.

Sample ``i`` is drawn from the dataset whose share so far lags its weight the most
(``argmax_d w_d * max(i, 1) - taken_d``, first index on ties), so every prefix of the blended
dataset follows the weights as closely as whole samples allow. The indices are cached as ``.npy``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch

from megatron_chimera.data.dataset_utils import cache_prefix, load_npy, save_npy_atomic


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16, dataset_sample_index int64) of the greedy weighted interleaving."""
    w = [float(x) for x in weights]
    taken = [0] * len(w)
    dataset_index = np.empty(size, dtype=np.int16)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    for i in range(size):
        scale = max(float(i), 1.0)
        best, best_error = 0, w[0] * scale - taken[0]
        for d in range(1, len(w)):
            error = w[d] * scale - taken[d]
            if error > best_error:
                best, best_error = d, error
        dataset_index[i] = best
        dataset_sample_index[i] = taken[best]
        taken[best] += 1
    return dataset_index, dataset_sample_index


class BlendedDataset(torch.utils.data.Dataset):
    """``size`` samples interleaved from ``datasets`` in proportion to ``weights``."""

    def __init__(
        self,
        datasets: Sequence[torch.utils.data.Dataset],
        weights: Sequence[float],
        size: int,
        name: str = "train",
        cache_dir: str | None = None,
        build_cache: bool = True,
    ) -> None:
        if len(datasets) != len(weights) or not datasets:
            raise ValueError("BlendedDataset needs one weight per dataset")
        if len(datasets) > np.iinfo(np.int16).max:
            raise ValueError("too many datasets to blend")
        total = float(sum(weights))
        self.datasets = list(datasets)
        self.weights = [float(w) / total for w in weights]
        self.size = size
        description = {
            "class": "BlendedDataset", "size": size, "weights": tuple(self.weights),
            "datasets": tuple(getattr(d, "cache_paths", {}).get("shuffle_idx", repr(len(d)))
                              for d in self.datasets),
        }
        prefix = cache_prefix(os.path.join(cache_dir or ".", "blend"), cache_dir, name, description)
        paths = (f"{prefix}_dataset_index.npy", f"{prefix}_dataset_sample_index.npy")
        if build_cache and not all(os.path.isfile(p) for p in paths):
            index, sample_index = build_blending_indices(self.weights, size)
            for d, dataset in enumerate(self.datasets):
                needed = int(np.count_nonzero(index == d))
                if needed > len(dataset):
                    raise ValueError(
                        f"blended {name} dataset {d} has {len(dataset)} samples, {needed} needed"
                    )
            save_npy_atomic(paths[0], index)
            save_npy_atomic(paths[1], sample_index)
        self.dataset_index = load_npy(paths[0], "blending dataset index")
        self.dataset_sample_index = load_npy(paths[1], "blending sample index")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        dataset = self.datasets[int(self.dataset_index[idx])]
        return dataset[int(self.dataset_sample_index[idx])]
