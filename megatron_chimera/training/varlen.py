"""``--variable-seq-lengths`` in the training loop: the flags' checks, the packed datasets and
every iteration's message lengths.

Every rank reads every micro-batch of a packed run (each stage needs the document ids, like
``--reset-attention-mask``), so each knows the length of every micro-batch of the iteration from
its own data loader, which packs deterministically: the executor sizes every send and receive by
it (``PipelineExecutor.run(microbatch_tokens=...)``) and no shape is exchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_chimera.config import ConfigError, TrainConfig
from megatron_chimera.data.dataset_utils import (
    SPLIT_NAMES,
    get_train_valid_test_split,
    open_checked_dataset,
)
from megatron_chimera.data.packed_dataset import IndexedDocuments, MockDocuments, PackedDataset
from megatron_chimera.data.sft_dataset import open_sft_masks


def token_budget(config: TrainConfig) -> int:
    """Input positions of a packed micro-batch at most (``--micro-batch-tokens``, default
    ``--seq-length``)."""
    return config.data.micro_batch_tokens or config.model.seq_length


def sequence_split(config: TrainConfig) -> int:
    """Ranks a micro-batch's tokens are split over in the pipeline messages: the
    context-parallel size times the tensor-parallel size under ``--sequence-parallel``."""
    tp = config.parallel.tensor_model_parallel_size
    sp = tp if config.model.sequence_parallel and tp > 1 else 1
    return config.parallel.context_parallel_size * sp


def row_multiple(config: TrainConfig) -> int:
    """What a packed row's length is padded to a multiple of: :func:`sequence_split`, twice
    that under context parallelism (the per-document zigzag cuts a row into 2 x CP equal
    chunks, :mod:`megatron_chimera.model.context_parallel.documents`)."""
    cp = config.parallel.context_parallel_size
    return sequence_split(config) * (2 if cp > 1 else 1)


def check_variable_seq_lengths(config: TrainConfig) -> None:
    """One clear line for every flag the packed micro-batches do not run with."""
    data, model, parallel = config.data, config.model, config.parallel
    if not data.variable_seq_lengths:
        if data.micro_batch_tokens is not None or data.overlong_documents != "error":
            raise ConfigError("--micro-batch-tokens and --overlong-documents need "
                              "--variable-seq-lengths")
        return
    refused = [
        (config.training.micro_batch_size != 1,
         f"--micro-batch-size {config.training.micro_batch_size} (a packed micro-batch is one "
         "row of documents: use --micro-batch-size 1 and --micro-batch-tokens for its size)"),
        (parallel.pipeline_sequence_slices > 1, "--pipeline-sequence-slices > 1"),
        (data.sft and data.sft_overlong != "error",
         f"--sft-overlong {data.sft_overlong} (it applies to --seq-length rows: use "
         "--overlong-documents)"),
        (data.split_data_paths is not None, "--train/valid/test-data-path (use --data-path)"),
        (not data.mock_data and data.data_path is not None and len(data.data_path) != 1,
         "blended --data-path (give one prefix)"),
    ]
    for bad, what in refused:
        if bad:
            raise ConfigError(f"--variable-seq-lengths does not run with {what}")
    if model.learned_positions and token_budget(config) > model.max_positions:
        raise ConfigError(f"--micro-batch-tokens {token_budget(config)} exceeds the "
                          f"{model.max_positions} learned positions (--max-position-embeddings)")


def packed_datasets(config: TrainConfig, tokenizer, num_samples: Sequence[int],
                    log: bool = True) -> tuple[PackedDataset | None, ...]:
    """(train, valid, test) packed datasets: synthetic documents with log-normal lengths
    (median a quarter of the budget) for ``--mock-data``, else the ``--split`` ranges of the
    one ``--data-path`` prefix (with ``--sft``: its conversations, in stream order, and their
    loss masks); rank 0 logs the packing (``log``)."""
    data, budget, seed = config.data, token_budget(config), config.training.seed
    sources: list = []
    masks: list = [None] * len(SPLIT_NAMES)
    if data.mock_data:
        for split, n in enumerate(num_samples):
            count = max(4 * n, 16)  # ~2-4 documents per micro-batch: enough for one epoch
            sources.append(MockDocuments(count, max(2, budget // 4), budget + 1,
                                         tokenizer.vocab_size, tokenizer.eod, seed, split))
    else:
        indexed = open_checked_dataset(data.data_path[0], config.model.padded_vocab_size,
                                       data.data_cache_path)
        bounds = get_train_valid_test_split(data.split, len(indexed))
        sources = [IndexedDocuments(indexed, bounds[i], bounds[i + 1])
                   for i in range(len(SPLIT_NAMES))]
        if data.sft:
            mask = open_sft_masks(data.data_path[0], indexed)
            masks = [IndexedDocuments(mask, bounds[i], bounds[i + 1])
                     for i in range(len(SPLIT_NAMES))]
    out: list[PackedDataset | None] = []
    for source, mask, n in zip(sources, masks, num_samples):
        if n <= 0 or not len(source.sizes()):
            out.append(None)
            continue
        out.append(PackedDataset(source, budget, n, data.overlong_documents,
                                 row_multiple(config), loss_masks=mask))
    if log and (not dist.is_initialized() or dist.get_rank() == 0):
        for line in log_packing(out):
            print(line, flush=True)
    return tuple(out)


def _packing(data: dict, model: dict) -> tuple | None:
    """(budget, overlong policy) of a packed run's data and model sections; None unpacked."""
    if not data.get("variable_seq_lengths"):
        return None
    return (data.get("micro_batch_tokens") or model.get("seq_length"),
            data.get("overlong_documents", "error"))


def check_packing_resume(config: TrainConfig, saved_args: dict, path: str) -> str | None:
    """ConfigError when resuming ``path`` would pack the documents differently (another token
    budget or overlong policy, or packing switched on or off): the consumed micro-batches would
    no longer be the same documents. With ``--allow-data-order-change``, the line to log."""
    saved_data = saved_args.get("data")
    if not isinstance(saved_data, dict):
        return None
    then = _packing(saved_data, saved_args.get("model") or {})
    now = _packing(dataclasses.asdict(config.data), dataclasses.asdict(config.model))
    if then == now:
        return None
    name = lambda p: ("unpacked" if p is None  # noqa: E731
                      else f"packed to {p[0]} tokens, overlong documents: {p[1]}")
    what = f"the micro-batches are {name(now)}, the checkpoint's were {name(then)} ({path})"
    if not config.training.allow_data_order_change:
        raise ConfigError(f"{what}: the resumed run would train other documents than the "
                          "uninterrupted one; keep the checkpoint's --variable-seq-lengths / "
                          "--micro-batch-tokens / --overlong-documents or pass "
                          "--allow-data-order-change")
    return f" data order changed on purpose: {what}"


def microbatch_tokens(batches: Sequence[dict[str, torch.Tensor] | None], split: int = 1
                      ) -> list[int]:
    """Every micro-batch's message length, from the batches this rank read (all of them): its
    tokens, divided by ``split`` (:func:`sequence_split`; the rows are padded to a multiple)."""
    missing = next((m for m, b in enumerate(batches) if b is None), None)
    if missing is not None:
        raise RuntimeError(f"micro-batch {missing} was not read on this rank: packed "
                           "micro-batches are read by every stage")
    return [int(b["document_ids"].shape[-1]) // split for b in batches]


def log_packing(datasets: Sequence[PackedDataset | None]) -> list[str]:
    """One line per split: how its documents were packed."""
    return [f" {name}: {d.describe()}" for name, d in zip(SPLIT_NAMES, datasets)
            if d is not None]

