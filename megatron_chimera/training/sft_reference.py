"""The independent reference of ``--sft`` training: every conversation run on its own.

:func:`reference_losses` trains the whole model in this process with plain SGD (no momentum,
weight decay, clipping or schedule, so the update is ``p -= lr * grad``): each iteration's global
batch is the same packed samples the training reads (samples ``[i G, (i + 1) G)``: ``--seq-length``
rows, or ``--variable-seq-lengths`` micro-batches), but every conversation of them runs
separately, unpacked (inputs ``ids[:-1]``, labels ``ids[1:]``, mask
``mask[1:]`` read straight from the datasets), and the loss is the sum of the masked per-token
losses over the trained tokens of the whole global batch. :func:`write_sft_dataset` writes a
synthetic ``preprocess_data.py --sft``-format dataset (prompt turns untrained, responses trained).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from megatron_chimera.config import ConfigError, TrainConfig
from megatron_chimera.data.indexed_dataset import IndexedDatasetBuilder, index_file_path
from megatron_chimera.data.sft_dataset import MASK_SUFFIX, TEXT_SUFFIX, build_sft_datasets
from megatron_chimera.model.gpt2 import GPTModel

#: the flags that make the training's optimizer step plain SGD
SGD_FLAGS = ("--optimizer", "sgd", "--sgd-momentum", "0", "--weight-decay", "0",
             "--clip-grad", "0", "--lr-decay-style", "constant")


def write_sft_dataset(prefix: str, conversations: int, vocab_size: int, lengths: tuple[int, int],
                      seed: int = 0, sizes: Sequence[int] | None = None) -> str:
    """Write ``prefix`` + ``_text_document`` / ``_loss_mask_document`` of ``conversations``
    random conversations of ``lengths`` (min, max) tokens (or of exactly ``sizes`` tokens, one
    conversation each), each 1-3 turns of an untrained prompt then a trained response; returns
    the ``--data-path``."""
    rng = np.random.default_rng(seed)
    text = IndexedDatasetBuilder(prefix + TEXT_SUFFIX + ".bin", np.int32)
    mask = IndexedDatasetBuilder(prefix + MASK_SUFFIX + ".bin", np.int32)
    for k in range(conversations if sizes is None else len(sizes)):
        n = (int(rng.integers(max(lengths[0], 2), lengths[1] + 1)) if sizes is None
             else int(sizes[k]))
        ids = rng.integers(0, vocab_size, n)
        turns = min(int(rng.integers(1, 4)), n // 2)  # 2 turns - 1 cuts in 1 .. n-1
        bounds = np.sort(rng.choice(np.arange(1, n), size=2 * turns - 1, replace=False))
        trained = (np.searchsorted(bounds, np.arange(n), side="right") % 2).astype(np.int32)
        text.add_document(ids, [n])
        mask.add_document(trained, [n])
    text.finalize(index_file_path(prefix + TEXT_SUFFIX))
    mask.finalize(index_file_path(prefix + MASK_SUFFIX))
    return prefix + TEXT_SUFFIX


def _check_sgd(argv: Sequence[str]) -> None:
    for name, value in zip(SGD_FLAGS[0::2], SGD_FLAGS[1::2]):
        given = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == name]
        if given[-1:] != [value]:
            raise ConfigError(f"the SFT reference needs {' '.join(SGD_FLAGS)} (got {name} "
                              f"{given[-1] if given else 'unset'})")


def global_batches(config: TrainConfig, tokenizer, iterations: int
                   ) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """Every iteration's conversations as the training of ``config`` packs them:
    ``(token ids, label mask)`` of each, ids ``[n + 1]`` for ``n`` inputs and the mask of their
    ``n`` labels, read straight from the datasets -- ``--seq-length`` rows, or
    ``--variable-seq-lengths`` micro-batches (one sample each, budget ``--micro-batch-tokens``)."""
    from megatron_chimera.training.varlen import packed_datasets

    batch = config.training.global_batch_size
    samples = [iterations * batch, 0, 0]
    out: list[list[tuple[np.ndarray, np.ndarray]]] = []
    if config.data.variable_seq_lengths:
        packed = packed_datasets(config, tokenizer, samples, log=False)[0]
        plan = packed.plan.micro_batches
        for i in range(iterations):
            micro_batches = [plan[index % len(plan)] for index in range(i * batch, (i + 1) * batch)]
            out.append([(np.asarray(packed.documents[doc][:n + 1]),
                         np.asarray(packed.loss_masks[doc][1:n + 1]))
                        for mb in micro_batches for doc, n in zip(mb.documents, mb.lengths)])
        return out
    dataset = build_sft_datasets(config.data.data_path[0], config.data.split, samples,
                                 config.model.seq_length, config.training.seed, tokenizer.eod,
                                 config.data.sft_overlong, log=False)[0]
    for i in range(iterations):
        out.append([(dataset.text.get(doc, 0, n), dataset.masks.get(doc, 1, n - 1))
                    for docs, lengths in dataset.samples[i * batch:(i + 1) * batch]
                    for doc, n in zip(docs, lengths) if n > 1])
    return out


def reference_losses(argv: Sequence[str], iterations: int) -> list[float]:
    """The per-iteration global-token mean losses of ``iterations`` iterations of the
    ``pretrain_gpt2.py --sft`` flags ``argv`` (one process; module docstring)."""
    from megatron_chimera.training.arguments import parse_args
    from megatron_chimera.training.training import build_tokenizer_for

    argv = list(argv)
    _check_sgd(argv)
    config = parse_args(argv, world_size=1)
    if not config.data.sft:
        raise ConfigError("the SFT reference needs --sft")
    tokenizer, config = build_tokenizer_for(config)
    model = GPTModel(config.model, seed=config.training.seed)
    lr = config.optimizer.lr
    losses = []
    for conversations in global_batches(config, tokenizer, iterations):
        total = sum(float(trained.sum()) for _, trained in conversations)
        loss_sum = torch.zeros((), dtype=torch.float64)
        model.zero_grad(set_to_none=True)
        for ids_np, trained_np in conversations:
            ids = torch.from_numpy(ids_np.astype(np.int64))[None]
            trained = torch.from_numpy(trained_np.astype(np.float32))
            n = ids.shape[1] - 1
            per_token = model(ids[:, :-1], torch.arange(n)[None], labels=ids[:, 1:])
            loss = torch.sum(per_token.float().reshape(-1) * trained) / total
            loss.backward()
            loss_sum += loss.detach().double()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= lr * p.grad
        losses.append(float(loss_sum))
    return losses
