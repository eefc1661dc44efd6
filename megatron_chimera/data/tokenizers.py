"""Megatron's tokenizers (``--tokenizer-type``) on the sentencepiece and tokenizers libraries.

Token ids, vocabulary sizes and special ids follow Megatron's wrappers, so datasets preprocessed by
Megatron's ``tools/preprocess_data.py`` decode the same way here:

* ``GPT2BPETokenizer``: byte-level BPE (``vocab.json`` + ``merges.txt``); eod = ``<|endoftext|>``.
* ``BertWordPieceLowerCase`` / ``BertWordPieceCase``: WordPiece from ``vocab.txt``; ``[BOS]`` and
  ``[EOS]`` are appended to the vocabulary when absent (as Megatron does) and eod = ``[EOS]``.
* ``SentencePieceTokenizer``: a SentencePiece model; ``<CLS> <SEP> <EOD> <MASK>`` (and pad/bos/eos
  pieces when the model has none) are appended after the model's pieces; eod = ``<EOD>``.
* ``GPTSentencePieceTokenizer``: a SentencePiece model as is; eod = the model's eos id.
* ``NullTokenizer``: text is whitespace-separated integer ids; eod = ``vocab_size``.
* ``HuggingFaceTokenizer``: ``--tokenizer-model DIR``, a local directory ``AutoTokenizer``
  reads (a fast tokenizer's ``tokenizer.json`` and ``tokenizer_config.json``: Llama, Mistral,
  Qwen2); ids as ``tokenizer(text).input_ids`` (its BOS included, as Megatron's wrapper);
  vocab_size = ``len(tokenizer)``; eod = its eos id.
"""

from __future__ import annotations

import json
import os
import re
from abc import ABC, abstractmethod

from megatron_chimera.config import TOKENIZER_TYPES, ConfigError
from megatron_chimera.layout import pad_vocab_size


class MegatronTokenizer(ABC):
    """What every tokenizer offers: text to ids, ids to text, and the special ids datasets need."""

    make_vocab_size_divisible_by: int = 128

    @property
    def padded_vocab_size(self) -> int:
        """``vocab_size`` rounded up to ``make_vocab_size_divisible_by`` (Megatron's padding)."""
        return pad_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by)

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids (unpadded)."""

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""

    @abstractmethod
    def detokenize(self, ids: list[int]) -> str:
        """Text of a list of ids."""

    def _missing(self, what: str) -> int:
        raise NotImplementedError(f"{type(self).__name__} has no {what} token")

    @property
    def eod(self) -> int:
        """End-of-document id appended by ``--append-eod``."""
        return self._missing("eod")

    @property
    def cls(self) -> int:
        """BERT [CLS] id."""
        return self._missing("cls")

    @property
    def sep(self) -> int:
        """BERT [SEP] id."""
        return self._missing("sep")

    @property
    def mask(self) -> int:
        """BERT [MASK] id."""
        return self._missing("mask")

    @property
    def pad(self) -> int:
        """Padding id."""
        return self._missing("pad")


def _require_file(path: str | None, flag: str, tokenizer_type: str) -> str:
    if path is None:
        raise ConfigError(f"{flag} is required for --tokenizer-type {tokenizer_type}")
    if not os.path.isfile(path):
        raise ConfigError(f"{flag} {path}: file not found")
    return path


def _require_directory(path: str | None, tokenizer_type: str) -> str:
    """A local tokenizer directory (nothing is downloaded: a hub name is refused)."""
    if path is None:
        raise ConfigError(f"--tokenizer-model is required for --tokenizer-type {tokenizer_type}")
    if not os.path.isdir(path):
        raise ConfigError(f"--tokenizer-model {path}: not a directory (a local copy of the "
                          "tokenizer, e.g. written by save_pretrained; nothing is downloaded)")
    return path


class GPT2BPETokenizer(MegatronTokenizer):
    """GPT-2 byte-level BPE (``vocab.json`` + ``merges.txt``) via the ``tokenizers`` library."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        with open(vocab_file, encoding="utf-8") as f:
            self._vocab: dict[str, int] = json.load(f)
        bpe = models.BPE.from_file(vocab_file, merge_file)
        self._tokenizer = Tokenizer(bpe)
        self._tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tokenizer.decoder = decoders.ByteLevel()
        if "<|endoftext|>" not in self._vocab:
            raise ConfigError(f"--vocab-file {vocab_file}: no <|endoftext|> token (GPT-2 eod)")
        self._eod = self._vocab["<|endoftext|>"]

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: list[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    @property
    def eod(self) -> int:
        return self._eod


class BertWordPieceTokenizer(MegatronTokenizer):
    """BERT WordPiece (``vocab.txt``), lower-cased or cased, via the ``tokenizers`` library."""

    def __init__(self, vocab_file: str, lower_case: bool = True) -> None:
        from tokenizers import BertWordPieceTokenizer as _HFWordPiece

        vocab: dict[str, int] = {}
        with open(vocab_file, encoding="utf-8") as f:
            for line in f:
                token = line.rstrip("\n")
                if token and token not in vocab:
                    vocab[token] = len(vocab)
        for required in ("[CLS]", "[SEP]", "[PAD]", "[MASK]", "[UNK]"):
            if required not in vocab:
                raise ConfigError(f"--vocab-file {vocab_file}: no {required} token")
        # Megatron appends [BOS] and [EOS] when the vocabulary lacks them.
        for extra in ("[BOS]", "[EOS]"):
            vocab.setdefault(extra, len(vocab))
        self._vocab = vocab
        self._inv_vocab = {i: t for t, i in vocab.items()}
        self._tokenizer = _HFWordPiece(vocab_file, lowercase=lower_case)

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def vocab(self) -> dict[str, int]:
        """Token -> id."""
        return self._vocab

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: list[int]) -> str:
        text = " ".join(self._inv_vocab[int(i)] for i in ids)
        return text.replace(" ##", "").strip()

    @property
    def cls(self) -> int:
        return self._vocab["[CLS]"]

    @property
    def sep(self) -> int:
        return self._vocab["[SEP]"]

    @property
    def mask(self) -> int:
        return self._vocab["[MASK]"]

    @property
    def pad(self) -> int:
        return self._vocab["[PAD]"]

    @property
    def eod(self) -> int:
        return self._vocab["[EOS]"]


class SentencePieceTokenizer(MegatronTokenizer):
    """A SentencePiece model with Megatron's special tokens appended after its pieces."""

    def __init__(self, model_file: str) -> None:
        import sentencepiece

        self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        self._vocab = {self._sp.id_to_piece(i): i for i in range(self._sp.get_piece_size())}
        self._special: dict[str, int] = {}

        def add_special(token: str) -> int:
            if token not in self._vocab:
                self._vocab[token] = len(self._vocab)
            self._special[token] = self._vocab[token]
            return self._vocab[token]

        self._cls = add_special("<CLS>")
        self._sep = add_special("<SEP>")
        self._eod = add_special("<EOD>")
        self._mask = add_special("<MASK>")
        ids = {"pad": self._sp.pad_id(), "bos": self._sp.bos_id(), "eos": self._sp.eos_id()}
        named = {}
        for name, sp_id in ids.items():
            piece = self._sp.id_to_piece(sp_id) if sp_id >= 0 else f"<{name.upper()}>"
            named[name] = add_special(piece)
        self._pad, self._bos, self._eos = named["pad"], named["bos"], named["eos"]
        self._inv_special = {i: t for t, i in self._special.items()}
        pattern = "|".join(re.escape(t) for t in sorted(self._special, key=len, reverse=True))
        self._special_re = re.compile(f"({pattern})")

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    def pieces(self) -> list[tuple[str, bool]]:
        """``(piece, ordinary)`` of every id; Megatron's special tokens are not ordinary."""
        by_id = {index: piece for piece, index in self._vocab.items()}
        ordinary = dict(enumerate(ok for _, ok in _sentencepiece_pieces(self._sp)))
        special = set(self._special.values())
        return [(by_id[i], ordinary.get(i, False) and i not in special)
                for i in range(len(self._vocab))]

    def tokenize(self, text: str) -> list[int]:
        """SentencePiece ids; special-token strings in the text become their ids (as Megatron)."""
        ids: list[int] = []
        for i, part in enumerate(self._special_re.split(text)):
            if i % 2:
                ids.append(self._special[part])
            elif part:
                ids.extend(self._sp.encode(part))
        return ids

    def detokenize(self, ids: list[int]) -> str:
        pieces: list[str] = []
        run: list[int] = []
        for i in ids:
            i = int(i)
            if i in self._inv_special:
                pieces.append(self._sp.decode(run))
                pieces.append(self._inv_special[i])
                run = []
            else:
                run.append(i)
        pieces.append(self._sp.decode(run))
        return " ".join(p for p in pieces if p)

    @property
    def cls(self) -> int:
        return self._cls

    @property
    def sep(self) -> int:
        return self._sep

    @property
    def mask(self) -> int:
        return self._mask

    @property
    def pad(self) -> int:
        return self._pad

    @property
    def eod(self) -> int:
        return self._eod


class GPTSentencePieceTokenizer(MegatronTokenizer):
    """A SentencePiece model used as is (no extra tokens); eod is the model's eos."""

    def __init__(self, model_file: str) -> None:
        import sentencepiece

        self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        if self._sp.eos_id() < 0:
            raise ConfigError(f"--tokenizer-model {model_file}: the model has no eos piece (eod)")

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def pieces(self) -> list[tuple[str, bool]]:
        """``(piece, ordinary)`` of every id (control / unknown / unused: not ordinary)."""
        return _sentencepiece_pieces(self._sp)

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def detokenize(self, ids: list[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    @property
    def eod(self) -> int:
        return self._sp.eos_id()

    @property
    def pad(self) -> int:
        pad = self._sp.pad_id()
        return pad if pad >= 0 else self._sp.eos_id()


class HuggingFaceTokenizer(MegatronTokenizer):
    """A ``transformers`` tokenizer from a local directory (Megatron's ``HuggingFaceTokenizer``:
    its own special tokens, eod = eos)."""

    def __init__(self, directory: str) -> None:
        import transformers

        self._tokenizer = transformers.AutoTokenizer.from_pretrained(directory,
                                                                     local_files_only=True)

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)

    def tokenize(self, text: str) -> list[int]:
        return list(self._tokenizer(text).input_ids)

    def detokenize(self, ids: list[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids])

    @property
    def eod(self) -> int:
        eos = self._tokenizer.eos_token_id
        return self._missing("an eos token") if eos is None else int(eos)

    @property
    def pad(self) -> int:
        pad = self._tokenizer.pad_token_id
        return self.eod if pad is None else int(pad)


def _sentencepiece_pieces(sp) -> list[tuple[str, bool]]:
    """``(piece, ordinary)`` of a SentencePiece model's ids."""
    return [(sp.id_to_piece(i), not (sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i)))
            for i in range(sp.get_piece_size())]


class NullTokenizer(MegatronTokenizer):
    """Text is already ids ("12 7 431"); eod is ``vocab_size`` (one past the given ids)."""

    def __init__(self, vocab_size: int) -> None:
        self._vocab_size_without_eod = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size_without_eod + 1

    def tokenize(self, text: str) -> list[int]:
        return [int(x) for x in text.split()]

    def detokenize(self, ids: list[int]) -> str:
        return " ".join(str(int(x)) for x in ids)

    @property
    def eod(self) -> int:
        return self._vocab_size_without_eod


def build_tokenizer(
    tokenizer_type: str,
    tokenizer_model: str | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    vocab_size: int | None = None,
    make_vocab_size_divisible_by: int = 128,
) -> MegatronTokenizer:
    """Megatron's ``build_tokenizer``: the tokenizer named by ``--tokenizer-type``."""
    if make_vocab_size_divisible_by <= 0:
        raise ConfigError("--make-vocab-size-divisible-by must be positive")
    try:
        tokenizer = _build(tokenizer_type, tokenizer_model, vocab_file, merge_file, vocab_size)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - each library fails its own way on a corrupt file
        files = ", ".join(f"--{flag.replace('_', '-')} {path}" for flag, path in (
            ("tokenizer_model", tokenizer_model), ("vocab_file", vocab_file),
            ("merge_file", merge_file)) if path)
        detail = (str(exc).strip().splitlines() or [""])[0][:160]
        raise ConfigError(f"--tokenizer-type {tokenizer_type}: cannot read {files or 'its files'}"
                          f" ({type(exc).__name__}: {detail})") from None
    tokenizer.make_vocab_size_divisible_by = make_vocab_size_divisible_by
    return tokenizer


# --tokenizer-type -> the file flags it needs
REQUIRED_FILES: dict[str, tuple[str, ...]] = {
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "BertWordPieceLowerCase": ("vocab_file",),
    "BertWordPieceCase": ("vocab_file",),
    "SentencePieceTokenizer": ("tokenizer_model",),
    "GPTSentencePieceTokenizer": ("tokenizer_model",),
    "NullTokenizer": (),
    "HuggingFaceTokenizer": ("tokenizer_model",),
}


def check_tokenizer_args(tokenizer_type: str, tokenizer_model: str | None = None,
                         vocab_file: str | None = None, merge_file: str | None = None,
                         vocab_size: int | None = None) -> None:
    """ConfigError naming the flag unless the tokenizer type is known, its files exist and a
    NullTokenizer has a vocabulary size (the one check, run by validation and by the builder)."""
    if tokenizer_type not in REQUIRED_FILES:
        raise ConfigError(f"--tokenizer-type {tokenizer_type!r} is not supported; choose one of "
                          + ", ".join(TOKENIZER_TYPES))
    paths = {"tokenizer_model": tokenizer_model, "vocab_file": vocab_file,
             "merge_file": merge_file}
    if tokenizer_type == "HuggingFaceTokenizer":
        _require_directory(tokenizer_model, tokenizer_type)
        return
    for name in REQUIRED_FILES[tokenizer_type]:
        _require_file(paths[name], "--" + name.replace("_", "-"), tokenizer_type)
    if tokenizer_type == "NullTokenizer" and (vocab_size is None or vocab_size <= 0):
        raise ConfigError("--vocab-size (a positive integer) is required for NullTokenizer")


def _build(
    tokenizer_type: str,
    tokenizer_model: str | None,
    vocab_file: str | None,
    merge_file: str | None,
    vocab_size: int | None,
) -> MegatronTokenizer:
    check_tokenizer_args(tokenizer_type, tokenizer_model, vocab_file, merge_file, vocab_size)
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        return BertWordPieceTokenizer(vocab_file,
                                      lower_case=tokenizer_type == "BertWordPieceLowerCase")
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "GPTSentencePieceTokenizer":
        return GPTSentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model)
    return NullTokenizer(vocab_size)


def padded_vocab_size(
    tokenizer: MegatronTokenizer, make_vocab_size_divisible_by: int = 128,
    tensor_model_parallel_size: int = 1,
) -> int:
    """Megatron's ``--make-vocab-size-divisible-by`` padding of the tokenizer's vocabulary."""
    if make_vocab_size_divisible_by <= 0:
        raise ConfigError("--make-vocab-size-divisible-by must be positive")
    return pad_vocab_size(tokenizer.vocab_size, make_vocab_size_divisible_by,
                          tensor_model_parallel_size)
