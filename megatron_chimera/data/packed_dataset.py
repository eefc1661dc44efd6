"""Packed variable-length micro-batches as a dataset (``--variable-seq-lengths``).

Sample ``i`` of :class:`PackedDataset` is packed micro-batch ``i`` of a document stream
(:func:`~megatron_chimera.data.packing.pack_documents`, up to ``--micro-batch-tokens`` input
positions, documents whole where they fit): the THD fields ``tokens``, ``labels``,
``loss_mask``, ``position_ids`` (restarting in every document) and ``document_ids``, each of the
micro-batch's own length. With ``--micro-batch-size 1`` Megatron's sampler and collate function
make every micro-batch ``[1, T_m]``, so the consumed-samples bookkeeping counts packed
micro-batches and a resume continues with exactly the next one (the packing is a pure function
of the document lengths and the budget, the same on every rank and after a restart).

Documents come from a Megatron ``.bin/.idx`` dataset (:class:`IndexedDocuments`: one document
per sequence, a ``--split`` range of them) or are synthetic (:class:`MockDocuments`:
log-normal lengths, ``--mock-data``). When the run needs more micro-batches than the stream
packs into, the plan is repeated (epochs of the same packing).
"""

from __future__ import annotations

from collections.abc import Sequence
from statistics import NormalDist
from typing import Protocol

import numpy as np

from megatron_chimera.config import ConfigError
from megatron_chimera.data.packing import PackingPlan, input_lengths, pack_documents, packed_fields


class Documents(Protocol):
    """A stream of documents: their token counts and their token ids."""

    def sizes(self) -> np.ndarray:
        """Token ids of every document (int64, stream order)."""

    def __getitem__(self, index: int) -> np.ndarray:
        """Token ids of document ``index``."""


class MockDocuments:
    """Synthetic documents with log-normal lengths (median ``median`` token ids, ``sigma`` of
    the log, at most ``max_length``, at least 2): learnable counting runs ending in ``eod``;
    document ``i`` depends only on ``(seed, split, i)``."""

    def __init__(self, count: int, median: int, max_length: int, vocab_size: int, eod: int,
                 seed: int, split: int = 0, sigma: float = 1.0) -> None:
        if vocab_size < 2:
            raise ConfigError("mock data needs a vocabulary of at least 2 ids")
        rng = np.random.default_rng([seed, split, 0x7A12])
        # stratified draws (one per 1/count quantile band, shuffled): the sample's median is
        # ``median`` however few documents there are
        bands = (rng.permutation(count) + rng.random(count)) / count
        normal = NormalDist(np.log(median), sigma)
        drawn = np.exp([normal.inv_cdf(min(max(u, 1e-12), 1 - 1e-12)) for u in bands])
        self._sizes = np.clip(np.rint(drawn), 2, max_length).astype(np.int64)
        self.vocab_size, self.eod, self.seed, self.split = vocab_size, eod, seed, split

    def sizes(self) -> np.ndarray:
        """Token ids of every document."""
        return self._sizes

    def __getitem__(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.split, index])
        n = int(self._sizes[index])
        ids = (int(rng.integers(self.vocab_size)) + np.arange(n, dtype=np.int64)) \
            % self.vocab_size
        ids[-1] = self.eod
        return ids


class IndexedDocuments:
    """Sequences ``[first, last)`` of a Megatron indexed dataset, one document each."""

    def __init__(self, indexed, first: int, last: int) -> None:
        self.indexed, self.first = indexed, int(first)
        self._sizes = np.asarray(indexed.sequence_lengths[first:last], dtype=np.int64)

    def sizes(self) -> np.ndarray:
        """Token ids of every document."""
        return self._sizes

    def __getitem__(self, index: int) -> np.ndarray:
        return np.asarray(self.indexed.get(self.first + int(index)), dtype=np.int64)


class _Lazy(Sequence):
    """The documents of a source as a sequence (read on access)."""

    def __init__(self, documents: Documents) -> None:
        self.documents = documents

    def __len__(self) -> int:
        return len(self.documents.sizes())

    def __getitem__(self, index):  # type: ignore[override]
        return self.documents[index]


class PackedDataset:
    """Packed micro-batch ``i % len(plan)`` of ``documents`` as THD fields (module docstring);
    ``num_samples`` micro-batches in all; each row is padded to a multiple of ``pad_multiple``
    (the tensor-parallel size under ``--sequence-parallel``) with an untrained document. With
    ``loss_masks`` (``--sft``: per token id, 1 where trained, the same documents) a label is
    trained where its token's mask is 1, else every label is."""

    def __init__(self, documents: Documents, budget: int, num_samples: int,
                 overlong: str = "error", pad_multiple: int = 1,
                 loss_masks: Documents | None = None) -> None:
        try:
            self.plan: PackingPlan = pack_documents(input_lengths(documents.sizes()), budget,
                                                    overlong)
        except ValueError as exc:
            text = str(exc).replace("(truncate or skip it)",
                                    "(--overlong-documents truncate or skip)")
            raise ConfigError(f"--variable-seq-lengths: {text}") from exc
        if not self.plan.micro_batches:
            raise ConfigError("--variable-seq-lengths: no document of 2 or more tokens to pack")
        self.documents, self.loss_masks = documents, loss_masks
        self.num_samples = int(num_samples)
        self.pad_multiple = int(pad_multiple)

    def __len__(self) -> int:
        return self.num_samples

    def tokens(self, index: int) -> int:
        """Input positions of micro-batch ``index``, padding included (its row's length)."""
        n = self.plan.micro_batches[index % len(self.plan.micro_batches)].tokens
        return n + (-n) % self.pad_multiple

    def real_tokens(self, index: int) -> int:
        """Input positions of micro-batch ``index`` that hold documents (no padding)."""
        return self.plan.micro_batches[index % len(self.plan.micro_batches)].tokens

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < self.num_samples:
            raise IndexError(index)
        micro_batch = self.plan.micro_batches[index % len(self.plan.micro_batches)]
        masks = None if self.loss_masks is None else _Lazy(self.loss_masks)
        fields = packed_fields(micro_batch, _Lazy(self.documents), masks)
        del fields["cu_seqlens"]  # (the document ids carry it; collation stacks equal shapes)
        pad = (-micro_batch.tokens) % self.pad_multiple
        if pad:  # a document of its own, never trained (sequence parallelism splits the row)
            fill = {"tokens": np.zeros(pad, np.int64), "labels": np.zeros(pad, np.int64),
                    "loss_mask": np.zeros(pad, np.float32),
                    "position_ids": np.arange(pad, dtype=np.int64),
                    "document_ids": np.full(pad, len(micro_batch.documents), np.int32)}
            fields = {k: np.concatenate([fields[k], fill[k]]) for k in fields}
        return fields

    def describe(self) -> str:
        """One line: micro-batches, documents truncated / skipped, mean fill of the budget."""
        plan = self.plan
        fill = np.mean([mb.tokens for mb in plan.micro_batches]) / plan.budget
        return (f"packed {len(plan.micro_batches)} variable-length micro-batches of at most "
                f"{plan.budget} tokens (mean fill {fill:.1%}); {len(plan.truncated)} documents "
                f"truncated, {len(plan.skipped)} skipped")
