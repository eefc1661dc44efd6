"""Pretrain GPT-2 with Megatron's flags on any pipeline schedule (GPipe, 1F1B, Chimera, ...).

Example (4 ranks, Chimera with 2 pipes, synthetic data)::

    torchrun --nproc-per-node 4 pretrain_gpt2.py --num-layers 8 --hidden-size 64 \\
        --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 --global-batch-size 16 \\
        --lr 1e-3 --train-iters 20 --mock-data --vocab-size 500 \\
        --pipeline-model-parallel-size 4 --chimera-pipes 2
"""

from __future__ import annotations

import functools

import torch

from megatron_chimera.config import ModelConfig, TrainConfig
from megatron_chimera.data.gpt_dataset import (
    MockGPTDataset,
    build_train_valid_test_datasets,
    get_batch,
)
from megatron_chimera.model.family import GPT2
from megatron_chimera.model.gpt2 import GPTModel
from megatron_chimera.rank_errors import run_main
from megatron_chimera.training import pretrain_from_flags


def model_provider(config: ModelConfig, seed: int, pre_process: bool = True,
                   post_process: bool = True, layer_range: tuple[int, int] | None = None,
                   stage: int = 0) -> GPTModel:
    """The GPT-2 slice of one pipeline stage (the whole model with the defaults)."""
    return GPTModel(config, pre_process=pre_process, post_process=post_process,
                    layer_range=layer_range, seed=seed)


def train_valid_test_datasets_provider(config: TrainConfig, tokenizer,
                                       num_samples: list[int]) -> tuple:
    """(train, valid, test) datasets: Megatron's GPT datasets, or synthetic with --mock-data."""
    data, seq_length, seed = config.data, config.model.seq_length, config.training.seed
    if data.mock_data:
        return tuple(MockGPTDataset(name, n, seq_length, tokenizer.vocab_size, tokenizer.eod,
                                    seed) if n > 0 else None
                     for name, n in zip(("train", "valid", "test"), num_samples))
    return build_train_valid_test_datasets(data.data_path, data.split, num_samples, seq_length,
                                           seed, cache_dir=data.data_cache_path,
                                           embedding_size=config.model.padded_vocab_size)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Mean per-token loss over the unmasked tokens of the micro-batch."""
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1).to(losses.dtype)
    loss = torch.sum(losses * mask) / mask.sum()
    return loss, {"lm loss": loss.detach()}


def forward_step(batch, model: GPTModel, eod_token: int):
    """Megatron's GPT forward step; ``batch`` is None on a stage that needs no data."""
    if batch is None:
        return model(None, None), None
    device = next(model.parameters()).device
    tokens, labels, loss_mask, _, position_ids = (t.to(device) for t in get_batch(batch,
                                                                                  eod_token))
    output = model(tokens if model.pre_process else None,
                   position_ids if model.pre_process else None,
                   labels=labels if model.post_process else None)
    return output, functools.partial(loss_func, loss_mask)


def main(argv: list[str] | None = None) -> None:
    """Parse and validate flags (every rank, before any process group), then pretrain."""
    pretrain_from_flags(
        argv, train_valid_test_datasets_provider, model_provider,
        lambda tokenizer: functools.partial(forward_step, eod_token=tokenizer.eod),
        family=GPT2,
    )


if __name__ == "__main__":
    run_main(main)
