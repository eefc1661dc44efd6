"""Deterministic packing of whole documents into variable-length micro-batches (THD layout).

A micro-batch is a list of documents laid back to back, at most ``budget`` tokens in all, the
layout of Megatron's ``--variable-seq-lengths`` packed sequences: ``cu_seqlens`` gives every
document's offsets, positions restart at 0 in every document and a token attends only inside its
own document (``document_ids``; :class:`megatron_chimera.model.document_attention.DocumentMask`
reads them), so nothing is attended or predicted across documents.

Lengths are counted in *input positions*: a document of ``n`` token ids gives ``n - 1`` inputs and
``n - 1`` labels (:func:`input_lengths`), so a micro-batch's token count is exactly its width.

:func:`pack_documents` is a pure function of (lengths in stream order, budget, policy), so the
packing is reproducible on every rank and after a restart; :meth:`PackingPlan.state_dict` records
the plan's fingerprint and how many micro-batches were consumed, and :meth:`PackingPlan.resume`
refuses a checkpoint taken under a different packing instead of silently training other data.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

OVERLONG_POLICIES = ("error", "truncate", "skip")


@dataclass(frozen=True)
class PackedMicroBatch:
    """Documents (indices into the stream) packed into one micro-batch, and the input positions
    each contributes (its whole length, or the budget where it was truncated)."""

    documents: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def tokens(self) -> int:
        """Input positions in the micro-batch (its width in the THD layout)."""
        return sum(self.lengths)

    def cu_seqlens(self) -> np.ndarray:
        """int32 ``[len(documents) + 1]`` offsets of every document, then the total."""
        return np.concatenate(([0], np.cumsum(self.lengths))).astype(np.int32)

    def position_ids(self) -> np.ndarray:
        """int64 positions restarting at 0 in every document."""
        if not self.lengths:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.arange(n, dtype=np.int64) for n in self.lengths])

    def document_ids(self) -> np.ndarray:
        """int32 index (within the micro-batch) of the document every position belongs to."""
        return np.repeat(np.arange(len(self.lengths), dtype=np.int32), self.lengths)


@dataclass(frozen=True)
class PackingPlan:
    """The micro-batches of a document stream, plus the documents truncated or skipped."""

    micro_batches: tuple[PackedMicroBatch, ...]
    budget: int
    truncated: tuple[int, ...]
    skipped: tuple[int, ...]

    def fingerprint(self) -> str:
        """A hash of the budget and every micro-batch's documents and lengths."""
        digest = hashlib.sha256(f"budget={self.budget};".encode())
        for mb in self.micro_batches:
            digest.update(np.asarray(mb.documents, dtype=np.int64).tobytes())
            digest.update(b"|")
            digest.update(np.asarray(mb.lengths, dtype=np.int64).tobytes())
            digest.update(b";")
        return digest.hexdigest()

    def iteration(self, iteration: int, num_microbatches: int, data_parallel_size: int = 1,
                  data_parallel_rank: int = 0) -> tuple[PackedMicroBatch, ...]:
        """The ``num_microbatches`` micro-batches one data-parallel rank trains in ``iteration``:
        iteration ``i`` uses the plan's micro-batches ``[i*N*DP, (i+1)*N*DP)``, rank ``r`` the
        ``r``-th block of ``N`` (their ``tokens`` are the schedule's per-micro-batch counts)."""
        if not 0 <= data_parallel_rank < data_parallel_size or num_microbatches < 1:
            raise ValueError(f"data-parallel rank {data_parallel_rank} of {data_parallel_size} "
                             f"with {num_microbatches} micro-batches per iteration")
        per_iteration = num_microbatches * data_parallel_size
        available = len(self.micro_batches) // per_iteration
        if not 0 <= iteration < available:
            raise ValueError(f"iteration {iteration} needs {per_iteration} packed micro-batches "
                             f"per iteration; the plan's {len(self.micro_batches)} cover "
                             f"{available} iterations")
        start = iteration * per_iteration + data_parallel_rank * num_microbatches
        return self.micro_batches[start:start + num_microbatches]

    def state_dict(self, consumed: int) -> dict[str, object]:
        """What a checkpoint stores to resume after ``consumed`` micro-batches."""
        if not 0 <= consumed <= len(self.micro_batches):
            raise ValueError(f"consumed={consumed} is outside the plan's "
                             f"{len(self.micro_batches)} micro-batches")
        return {"fingerprint": self.fingerprint(), "consumed": consumed, "budget": self.budget}

    def resume(self, state: dict[str, object]) -> tuple[PackedMicroBatch, ...]:
        """The micro-batches not yet consumed at ``state``; refuses a state from another plan."""
        if state.get("fingerprint") != self.fingerprint():
            raise ValueError(
                f"the packed micro-batches differ from the checkpoint's (budget "
                f"{state.get('budget')} then, {self.budget} now, or other documents or order): "
                f"resuming would train different data")
        return self.micro_batches[int(state["consumed"]):]


def input_lengths(sizes: Sequence[int] | np.ndarray) -> np.ndarray:
    """Input positions of documents of ``sizes`` token ids (``size - 1``; 0 for ``size < 2``)."""
    return np.maximum(np.asarray(sizes, dtype=np.int64) - 1, 0)


def pack_documents(lengths: Sequence[int] | np.ndarray, budget: int, overlong: str = "error",
                   open_bins: int = 1) -> PackingPlan:
    """Pack documents of ``lengths`` input positions, in stream order, into micro-batches of at
    most ``budget`` positions, each document whole in one micro-batch.

    A document goes into the first of the ``open_bins`` most recent micro-batches with room for
    it (``open_bins=1`` is next-fit: order fully kept); when none has room the oldest is closed
    and a new one opened. Micro-batches come out in the order they were opened. A document longer
    than ``budget`` raises (``overlong="error"``), is cut to ``budget`` (``"truncate"``) or is
    left out (``"skip"``); empty documents are left out and listed in ``skipped``.
    """
    if overlong not in OVERLONG_POLICIES:
        raise ValueError(f"overlong must be one of {OVERLONG_POLICIES}, got {overlong!r}")
    if int(budget) < 1:
        raise ValueError(f"the micro-batch token budget must be positive, got {budget}")
    if int(open_bins) < 1:
        raise ValueError(f"open_bins must be positive, got {open_bins}")
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim != 1:
        raise ValueError(f"lengths must be one-dimensional, got shape {lengths.shape}")
    if lengths.size and lengths.min() < 0:
        raise ValueError(f"document {int(np.argmin(lengths))} has a negative length")
    truncated: list[int] = []
    skipped: list[int] = []
    open_: list[tuple[list[int], list[int]]] = []
    used: list[int] = []
    closed: list[PackedMicroBatch] = []
    for index, n in enumerate(lengths.tolist()):
        if n == 0:
            skipped.append(index)
            continue
        if n > budget:
            if overlong == "error":
                raise ValueError(f"document {index} has {n} input tokens, more than the "
                                 f"micro-batch token budget {budget} (truncate or skip it)")
            if overlong == "skip":
                skipped.append(index)
                continue
            truncated.append(index)
            n = int(budget)
        slot = next((k for k, u in enumerate(used) if u + n <= budget), None)
        if slot is None:
            if len(open_) == open_bins:
                closed.append(_micro_batch(*open_.pop(0)))
                used.pop(0)
            open_.append(([], []))
            used.append(0)
            slot = len(open_) - 1
        open_[slot][0].append(index)
        open_[slot][1].append(n)
        used[slot] += n
    closed.extend(_micro_batch(*bin_) for bin_ in open_)
    return PackingPlan(tuple(closed), int(budget), tuple(truncated), tuple(skipped))


def _micro_batch(documents: list[int], lengths: list[int]) -> PackedMicroBatch:
    return PackedMicroBatch(tuple(documents), tuple(lengths))


def packed_fields(micro_batch: PackedMicroBatch, documents: Sequence[np.ndarray],
                  loss_masks: Sequence[np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """The THD arrays of one micro-batch: ``tokens``, ``labels``, ``loss_mask``, ``position_ids``,
    ``document_ids`` (each ``[micro_batch.tokens]``) and ``cu_seqlens``.

    ``documents[i]`` are the token ids of stream document ``i``; its inputs are ``ids[:-1]`` and
    its labels ``ids[1:]``, cut to the packed length. ``loss_masks[i]`` (per token id, 1 where the
    token is trained as a target, e.g. a response token) gives ``loss_mask = mask[1:]``; without
    it every label is trained.
    """
    tokens, labels, masks = [], [], []
    for index, n in zip(micro_batch.documents, micro_batch.lengths):
        ids = np.asarray(documents[index])
        if ids.shape[0] < n + 1:
            raise ValueError(f"document {index} has {ids.shape[0]} token ids, fewer than the "
                             f"{n + 1} its packed length {n} needs")
        tokens.append(ids[:n])
        labels.append(ids[1:n + 1])
        if loss_masks is None:
            masks.append(np.ones(n, dtype=np.float32))
        else:
            mask = np.asarray(loss_masks[index])
            if mask.shape[0] != ids.shape[0]:
                raise ValueError(f"document {index}: the loss mask has {mask.shape[0]} entries "
                                 f"for {ids.shape[0]} token ids")
            masks.append(mask[1:n + 1].astype(np.float32))
    empty = np.zeros(0, dtype=np.int64)
    return {
        "tokens": np.concatenate(tokens).astype(np.int64) if tokens else empty,
        "labels": np.concatenate(labels).astype(np.int64) if labels else empty,
        "loss_mask": np.concatenate(masks) if masks else np.zeros(0, dtype=np.float32),
        "position_ids": micro_batch.position_ids(),
        "document_ids": micro_batch.document_ids(),
        "cu_seqlens": micro_batch.cu_seqlens(),
    }
