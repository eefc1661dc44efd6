"""Pretrain BERT (masked LM + sentence-order prediction) with Megatron's flags on any schedule.

Example (4 ranks, Chimera with 2 pipes, synthetic data)::

    torchrun --nproc-per-node 4 pretrain_bert.py --num-layers 8 --hidden-size 64 \\
        --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 --global-batch-size 16 \\
        --lr 1e-3 --train-iters 20 --mock-data --vocab-size 500 \\
        --pipeline-model-parallel-size 4 --chimera-pipes 2
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from megatron_chimera.config import ModelConfig, TrainConfig
from megatron_chimera.data.bert_dataset import (
    BertSampling,
    BertTokens,
    MockBertDataset,
    build_train_valid_test_datasets,
    get_bert_batch,
)
from megatron_chimera.data.masking import word_start_table
from megatron_chimera.data.samplers import batch_to_device
from megatron_chimera.model.bert import BertModel
from megatron_chimera.model.family import BERT
from megatron_chimera.model.loss_normalization import loss_divisor
from megatron_chimera.training import pretrain_from_flags, run_main

# Special ids of bare --mock-data (a NullTokenizer has no [CLS]/[SEP]/[MASK]/[PAD]).
MOCK_PAD, MOCK_CLS, MOCK_SEP, MOCK_MASK = 0, 1, 2, 3


def model_provider(config: ModelConfig, seed: int, pre_process: bool = True,
                   post_process: bool = True, layer_range: tuple[int, int] | None = None,
                   stage: int = 0) -> BertModel:
    """The BERT slice of one pipeline stage (the whole model with the defaults)."""
    return BertModel(config, pre_process=pre_process, post_process=post_process,
                     layer_range=layer_range, seed=seed)


def special_ids(tokenizer) -> tuple[int, int, int, int]:
    """(cls, sep, mask, pad) of the tokenizer, or fixed low ids for a NullTokenizer."""
    try:
        return tokenizer.cls, tokenizer.sep, tokenizer.mask, tokenizer.pad
    except Exception:  # noqa: BLE001 - the tokenizer lacks BERT's special tokens
        return MOCK_CLS, MOCK_SEP, MOCK_MASK, MOCK_PAD


def train_valid_test_datasets_provider(config: TrainConfig, tokenizer,
                                       num_samples: list[int]) -> tuple:
    """(train, valid, test) BERT datasets, or synthetic sentence pairs with --mock-data."""
    data, seq_length, seed = config.data, config.model.seq_length, config.training.seed
    cls_id, sep_id, mask_id, pad_id = special_ids(tokenizer)
    binary_head = config.model.bert_binary_head
    # whole-word masking for WordPiece / SentencePiece vocabularies unless --no-whole-word-masking
    words = word_start_table(tokenizer) if data.whole_word_masking else None
    masking = dict(masked_lm_prob=data.mask_prob, word_starts=words,
                   max_ngram=data.masking_max_ngram)
    if data.mock_data:
        return tuple(
            MockBertDataset(name, n, seq_length, tokenizer.vocab_size, cls_id, sep_id, mask_id,
                            pad_id, seed, binary_head=binary_head, **masking)
            if n > 0 else None
            for name, n in zip(("train", "valid", "test"), num_samples))
    return build_train_valid_test_datasets(
        data.data_path, data.split, num_samples, seq_length, seed,
        BertTokens(tokenizer.vocab_size, cls_id, sep_id, mask_id, pad_id),
        BertSampling(short_seq_prob=data.short_seq_prob, binary_head=binary_head, **masking),
        cache_dir=data.data_cache_path, embedding_size=config.model.padded_vocab_size,
        split_paths=data.split_data_paths)


def loss_func(loss_mask: torch.Tensor, sentence_order: torch.Tensor, output_tensor):
    """Masked-LM loss over the masked positions plus the sentence-order loss (binary head)."""
    lm_loss_, sop_logits = output_tensor
    mask = loss_mask.reshape(-1).float()
    lm_loss = torch.sum(lm_loss_.float().reshape(-1) * mask) / loss_divisor(mask.sum())
    if sop_logits is None:
        return lm_loss, {"lm loss": lm_loss.detach()}
    sop_loss = F.cross_entropy(sop_logits.float(), sentence_order.reshape(-1))
    loss = lm_loss + sop_loss
    return loss, {"lm loss": lm_loss.detach(), "sop loss": sop_loss.detach()}


def forward_step(batch, model: BertModel):
    """Megatron's BERT forward step: every stage needs the padding mask of the micro-batch."""
    device = next(model.parameters()).device
    tokens, types, sentence_order, loss_mask, lm_labels, padding_mask = get_bert_batch(
        batch_to_device(batch, device))
    # Unmasked positions carry label -1 (Megatron's convention) and have loss_mask 0.
    lm_labels = lm_labels.clamp(min=0)
    output = model(tokens if model.pre_process else None, padding_mask,
                   tokentype_ids=types if model.pre_process else None,
                   lm_labels=lm_labels if model.post_process else None)
    return output, functools.partial(loss_func, loss_mask, sentence_order)


def main(argv: list[str] | None = None) -> None:
    """Parse and validate flags (every rank, before any process group), then pretrain."""
    pretrain_from_flags(
        argv, train_valid_test_datasets_provider, model_provider, lambda _: forward_step,
        family=BERT,
    )


if __name__ == "__main__":
    run_main(main)
