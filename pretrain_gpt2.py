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
from megatron_chimera.data.gpt_sample_fields import GPTSampleDataset, LtorOptions
from megatron_chimera.data.samplers import batch_to_device
from megatron_chimera.data.sft_dataset import build_sft_datasets, is_logging_process
from megatron_chimera.model.context_parallel import (
    context_parallel_size,
    document_split,
    document_tokens,
    sequence_mean_loss,
    split_batch,
)
from megatron_chimera.model.document_attention import DocumentMask
from megatron_chimera.model.family import GPT2
from megatron_chimera.model.gpt2 import GPTModel
from megatron_chimera.model.loss_normalization import TOKEN_MEAN, TokenMean, divisor_of
from megatron_chimera.model.sequence_slices import SLICE, SequenceSlice
from megatron_chimera.training import pretrain_from_flags, run_main
from megatron_chimera.training.varlen import packed_datasets


def model_provider(config: ModelConfig, seed: int, pre_process: bool = True,
                   post_process: bool = True, layer_range: tuple[int, int] | None = None,
                   stage: int = 0) -> GPTModel:
    """The GPT-2 slice of one pipeline stage (the whole model with the defaults)."""
    return GPTModel(config, pre_process=pre_process, post_process=post_process,
                    layer_range=layer_range, seed=seed)


def ltor_options(config: TrainConfig, tokenizer) -> LtorOptions:
    """--reset-position-ids / --reset-attention-mask / --eod-mask-loss and the tokenizer's eod."""
    data = config.data
    return LtorOptions(tokenizer.eod, reset_position_ids=data.reset_position_ids,
                       reset_attention_mask=data.reset_attention_mask,
                       eod_mask_loss=data.eod_mask_loss)


def train_valid_test_datasets_provider(config: TrainConfig, tokenizer,
                                       num_samples: list[int]) -> tuple:
    """(train, valid, test) datasets: Megatron's GPT datasets, or synthetic with --mock-data
    (packed variable-length micro-batches with --variable-seq-lengths, --sft conversations
    packed into --seq-length rows or, with both, into variable-length ones); the data workers add
    each sample's loss mask, position ids and document ids."""
    data, seq_length, seed = config.data, config.model.seq_length, config.training.seed
    if data.variable_seq_lengths:  # packed documents (--sft: with loss masks), one row each
        return packed_datasets(config, tokenizer, num_samples)
    if data.sft:  # whole conversations packed, with their own masks, positions and documents
        return build_sft_datasets(data.data_path[0], data.split, num_samples, seq_length, seed,
                                  tokenizer.eod, data.sft_overlong,
                                  config.model.padded_vocab_size, data.data_cache_path,
                                  log=is_logging_process())
    if data.mock_data:
        datasets = tuple(MockGPTDataset(name, n, seq_length, tokenizer.vocab_size, tokenizer.eod,
                                        seed) if n > 0 else None
                         for name, n in zip(("train", "valid", "test"), num_samples))
    else:
        datasets = build_train_valid_test_datasets(
            data.data_path, data.split, num_samples, seq_length, seed,
            cache_dir=data.data_cache_path, embedding_size=config.model.padded_vocab_size,
            split_paths=data.split_data_paths)
    options = ltor_options(config, tokenizer)
    return tuple(None if d is None else GPTSampleDataset(d, options) for d in datasets)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor,
              token_mean: TokenMean | None = None):
    """Mean per-token loss over the unmasked tokens of the micro-batch (with context
    parallelism: over the whole sequence, every context rank's tokens); with ``token_mean``
    (--calculate-per-token-loss, --sft) the micro-batch's share of the global batch's
    per-token mean, so the logged mean over micro-batches is that mean."""
    if context_parallel_size() > 1:
        loss, reported = sequence_mean_loss(output_tensor.float(), loss_mask, token_mean)
        return loss, {"lm loss": reported}
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1).to(losses.dtype)
    loss = torch.sum(losses * mask) / divisor_of(mask.sum(), token_mean)
    return loss, {"lm loss": loss.detach()}


def slice_loss_func(piece: SequenceSlice, loss_mask: torch.Tensor,
                    output_tensor: torch.Tensor, token_mean: TokenMean | None = None):
    """One slice's share of its sequence's mean per-token loss (:meth:`SequenceSlice.loss`)."""
    loss, reported = piece.loss(output_tensor.float(), loss_mask, token_mean)
    return loss, {"lm loss": reported}


def reads_positions(model: GPTModel) -> bool:
    """Whether this stage reads the position ids: the first stage, and every stage with RoPE
    (whose positions restart at each document under --reset-position-ids)."""
    return model.pre_process or model.config.position_embedding_type == "rope"


def batch_fields(model: GPTModel) -> list[str]:
    """The micro-batch fields a stage reads: tokens and positions at the first stage (positions
    at every stage with RoPE), labels and the loss mask at the last, the document ids
    (--reset-attention-mask) everywhere."""
    fields = ["document_ids"]
    if model.pre_process or model.post_process:
        fields.append("text")
        fields.append("tokens" if model.pre_process else "labels")  # packed micro-batches
        if model.pre_process and model.post_process:
            fields.append("labels")
    if reads_positions(model):
        fields.append("position_ids")
    if model.post_process:
        fields.append("loss_mask")
    return fields


def forward_step(batch, model: GPTModel):
    """Megatron's GPT forward step; ``batch`` is None on a stage that needs no data (with
    --reset-attention-mask every stage gets the batch: each needs the document mask). Only the
    fields this stage reads move to its device, asynchronously from pinned memory."""
    if batch is None:
        return model(None, None), None
    piece = batch.get(SLICE)  # one slice of a sequence (sequence-sliced pipelines)
    token_mean = batch.get(TOKEN_MEAN)  # the global-token mean's divisor (per-token loss)
    device = next(model.parameters()).device
    # (context parallelism: one packed row is split per document, decided on the host)
    split = document_split(batch.get("document_ids")) if piece is None else None
    batch = batch_to_device(batch, device, batch_fields(model))
    # (context parallelism: this rank's zigzag share of every per-token field)
    tokens, labels, loss_mask, document_ids, position_ids = split_batch(*get_batch(batch),
                                                                        split=split)
    if piece is not None:
        output = model(tokens if model.pre_process else None,
                       position_ids if reads_positions(model) else None,
                       attention_mask=piece.mask(document_ids),
                       labels=labels if model.post_process else None)
        return output, functools.partial(slice_loss_func, piece, loss_mask,
                                         token_mean=token_mean)
    mask = None if document_ids is None else DocumentMask(document_ids, device)
    if split is not None:
        mask = document_tokens(split, True, device)
    output = model(tokens if model.pre_process else None,
                   position_ids if reads_positions(model) else None,
                   attention_mask=mask,
                   labels=labels if model.post_process else None)
    return output, functools.partial(loss_func, loss_mask, token_mean=token_mean)


def main(argv: list[str] | None = None) -> None:
    """Parse and validate flags (every rank, before any process group), then pretrain."""
    pretrain_from_flags(
        argv, train_valid_test_datasets_provider, model_provider,
        lambda tokenizer: forward_step,
        family=GPT2,
    )


if __name__ == "__main__":
    run_main(main)
