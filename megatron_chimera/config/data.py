"""Datasets, tokenizer and the samples built from them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megatron_chimera.config.flag import flag, non_negative, positive, probability
from megatron_chimera.config.model import BERT, GPT

TOKENIZER_TYPES = (  # --tokenizer-type: Megatron's tokenizer names
    "GPT2BPETokenizer",
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "NullTokenizer",
    "HuggingFaceTokenizer",
)


@dataclass(frozen=True)
class DataConfig:
    """Datasets and tokenizer (``--data-path``, ``--split``, ``--tokenizer-type``, ...)."""

    FLAG_GROUP: ClassVar[str] = "data and tokenizer"

    data_path: tuple[str, ...] | None = flag(  # Megatron's [weight] prefix list, as given
        None, "--data-path", nargs="*", help="dataset prefix, or weight prefix pairs to blend")
    split: str = flag(
        "969, 30, 1", "--split", derived=True,
        help="train, valid, test proportions of --data-path, e.g. 969,30,1 (the default)")
    # per-split files (each a [weight] prefix list), instead of data_path
    train_data_path: tuple[str, ...] | None = flag(
        None, "--train-data-path", nargs="*",
        help="training data: every document of a prefix, or weight prefix pairs to blend "
             "(instead of --data-path / --split)")
    valid_data_path: tuple[str, ...] | None = flag(
        None, "--valid-data-path", nargs="*",
        help="validation data: a prefix or weight prefix pairs (instead of --data-path / "
             "--split)")
    test_data_path: tuple[str, ...] | None = flag(
        None, "--test-data-path", nargs="*",
        help="test data: a prefix or weight prefix pairs (instead of --data-path / --split)")
    mock_data: bool = flag(False, "--mock-data",
                           help="deterministic synthetic samples instead of --data-path")
    tokenizer_type: str | None = flag(None, "--tokenizer-type", choices=TOKENIZER_TYPES,
                                      help="Megatron tokenizer name")
    tokenizer_model: str | None = flag(
        None, "--tokenizer-model",
        help="SentencePiece model file, or HuggingFaceTokenizer's local directory "
             "(tokenizer.json, tokenizer_config.json; nothing is downloaded)")
    vocab_file: str | None = flag(None, "--vocab-file",
                                  help="GPT-2 vocab.json or WordPiece vocab.txt")
    merge_file: str | None = flag(None, "--merge-file", help="GPT-2 merges.txt")
    vocab_size: int | None = flag(None, "--vocab-size", type=int, check=positive,
                                  help="vocabulary of the NullTokenizer / bare --mock-data")
    num_workers: int = flag(2, "--num-workers", check=non_negative,
                            help="DataLoader worker processes")
    data_cache_path: str | None = flag(
        None, "--data-cache-path",
        help="directory of the cached sample indices (default next to the data)")
    # BERT masking (Megatron's defaults): whole words (WordPiece / SentencePiece), n-grams <= 3
    mask_prob: float = flag(0.15, "--mask-prob", check=probability, family=BERT,
                            help="BERT: fraction of tokens to predict")
    short_seq_prob: float = flag(0.1, "--short-seq-prob", check=probability, family=BERT,
                                 help="BERT: probability of a shorter target length")
    whole_word_masking: bool = flag(
        True, "--no-whole-word-masking", family=BERT,
        help="BERT: mask tokens one by one instead of whole words (WordPiece ## continuations, "
             "SentencePiece word starts)")
    masking_max_ngram: int = flag(
        3, "--masking-max-ngram", check=positive, family=BERT,
        help="BERT: longest n-gram of words masked together (Megatron: 3; 1 masks single words)")
    # GPT samples packed from several documents (Megatron's flags; computed in the data workers)
    reset_position_ids: bool = flag(
        False, "--reset-position-ids", family=GPT,
        help="GPT: position ids restart after every end-of-document token")
    reset_attention_mask: bool = flag(
        False, "--reset-attention-mask", family=GPT,
        help="GPT: tokens attend only within their own document of a packed sample")
    eod_mask_loss: bool = flag(
        False, "--eod-mask-loss", family=GPT,
        help="GPT: no loss at positions whose input is the end-of-document token")
    # supervised fine-tuning on tools/preprocess_data.py --sft output (data/sft_dataset.py)
    sft: bool = flag(
        False, "--sft", family=GPT,
        help="GPT: supervised fine-tuning on a preprocess_data.py --sft dataset (PREFIX_text_"
             "document and its PREFIX_loss_mask_document): whole conversations packed into "
             "--seq-length (with --variable-seq-lengths: into variable-length micro-batches) "
             "with document masks, the loss a mean over the global batch's "
             "trained tokens (implies --reset-attention-mask --reset-position-ids "
             "--calculate-per-token-loss)")
    sft_overlong: str = flag(
        "error", "--sft-overlong", choices=("error", "truncate", "skip"), family=GPT,
        help="--sft: a conversation longer than --seq-length is an error, truncated or "
             "skipped (counted in the log; with --variable-seq-lengths: --overlong-documents)")

    # packed variable-length micro-batches (THD): data/packed_dataset.py
    variable_seq_lengths: bool = flag(
        False, "--variable-seq-lengths", family=GPT,
        help="GPT: micro-batches of whole documents packed up to --micro-batch-tokens, each of "
             "its own length (no padding, attention within documents, positions restarting)")
    micro_batch_tokens: int | None = flag(
        None, "--micro-batch-tokens", type=int, check=positive, family=GPT,
        help="GPT --variable-seq-lengths: token budget of a packed micro-batch (default "
             "--seq-length)")
    overlong_documents: str = flag(
        "error", "--overlong-documents", choices=("error", "truncate", "skip"), family=GPT,
        help="GPT --variable-seq-lengths: a document over the token budget is an error, cut to "
             "it, or left out (counted in the log)")

    @property
    def split_data_paths(self) -> tuple[tuple[str, ...] | None, ...] | None:
        """(train, valid, test) per-split paths, or None when the run uses ``data_path``."""
        paths = (self.train_data_path, self.valid_data_path, self.test_data_path)
        return paths if any(p is not None for p in paths) else None
