"""Weighted blending of datasets (``--data-path w1 p1 w2 p2 ...``), as Megatron's BlendableDataset.

Sample ``i`` is drawn from the dataset whose share so far lags its weight the most
(``argmax_d w_d * max(i, 1) - taken_d``, first index on ties), so every prefix of the blended
dataset follows the weights as closely as whole samples allow. The indices are cached as ``.npy``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import numpy as np
import torch

from megatron_chimera.data.dataset_utils import (
    SPLIT_NAMES,
    blended_num_samples,
    cache_prefix,
    load_npy,
    parse_data_paths,
    save_npy_atomic,
)


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


def blend_split_datasets(
    built: Sequence[Sequence[torch.utils.data.Dataset | None]],
    weights: Sequence[float] | None,
    train_valid_test_num_samples: Sequence[int],
    data_prefix: str,
    cache_dir: str | None,
    build_cache: bool,
    name_prefix: str = "",
) -> tuple[torch.utils.data.Dataset | None, ...]:
    """(train, valid, test) from each ``--data-path`` prefix's splits: the one prefix's own, or
    per split a :class:`BlendedDataset` of the prefixes' splits by ``weights``.

    A split no prefix has, or with no requested samples, is ``None``. The blending indices are
    cached in ``cache_dir`` (default: beside the first prefix ``data_prefix``).
    """
    if weights is None:
        return tuple(built[0])
    result: list[torch.utils.data.Dataset | None] = []
    for i, name in enumerate(SPLIT_NAMES):
        parts = [(d[i], w) for d, w in zip(built, weights) if d[i] is not None]
        if not parts or train_valid_test_num_samples[i] <= 0:
            result.append(None)
            continue
        result.append(BlendedDataset(
            [d for d, _ in parts], [w for _, w in parts], train_valid_test_num_samples[i],
            name=f"{name_prefix}{name}",
            cache_dir=cache_dir or os.path.dirname(os.path.abspath(data_prefix)),
            build_cache=build_cache,
        ))
    return tuple(result)


def split_flag(index: int) -> str:
    """``--train-data-path``, ``--valid-data-path`` or ``--test-data-path``."""
    return f"--{SPLIT_NAMES[index]}-data-path"


def build_per_split_datasets(
    split_paths: Sequence[Sequence[str] | None],
    train_valid_test_num_samples: Sequence[int],
    build_whole: Callable[[str, str, int], torch.utils.data.Dataset],
    cache_dir: str | None,
    build_cache: bool,
    name_prefix: str = "",
) -> tuple[torch.utils.data.Dataset | None, ...]:
    """Megatron's ``--train-data-path`` / ``--valid-data-path`` / ``--test-data-path``: split
    ``i`` from every document of its own prefix, or a :class:`BlendedDataset` of its weighted
    prefixes (``ceil(n w 1.005)`` samples each, as ``--data-path``); None for a split without
    a path or without requested samples. ``build_whole(split name, prefix, samples)`` builds
    one prefix's dataset over all its documents."""
    result: list[torch.utils.data.Dataset | None] = []
    for i, (name, paths) in enumerate(zip(SPLIT_NAMES, split_paths)):
        size = train_valid_test_num_samples[i]
        if not paths or size <= 0:
            result.append(None)
            continue
        prefixes, weights = parse_data_paths(paths, split_flag(i))
        counts = [size] if weights is None else [c[0] for c in blended_num_samples(weights,
                                                                                      [size])]
        parts = [build_whole(name, prefix, count) for prefix, count in zip(prefixes, counts)]
        if weights is None:
            result.append(parts[0])
            continue
        result.append(BlendedDataset(
            parts, weights, size, name=f"{name_prefix}{name}_per_split",
            cache_dir=cache_dir or os.path.dirname(os.path.abspath(prefixes[0])),
            build_cache=build_cache))
    return tuple(result)
