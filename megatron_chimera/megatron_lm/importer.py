"""``import_megatron``: a Megatron-LM checkpoint -> our release checkpoint.

The model's shape comes from Megatron's saved ``args`` (checked: a feature we do not have is
refused by name); the tensors stream from the reader one at a time, each checked against the
GPTModel the args describe (built on the ``meta`` device: names, shapes, dtypes) and written
bitwise as it comes (``save_streamed``), every one of them used and every parameter filled, so a
conversion holds about one stored tensor, not the model. The result is a release checkpoint
(iteration 0, fresh optimizer on ``--load``), as ``import-hf`` writes, so it trains under any
layout. ``--ckpt-format torch`` (one file per stage) fills a whole model first.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import torch

from megatron_chimera.checkpoint.checkpointing import (
    CKPT_FORMATS,
    FORMAT_TORCH_DIST,
    CheckpointContents,
    StageSlice,
    read_tracker,
    save_checkpoint,
    save_streamed,
)
from megatron_chimera.checkpoint.megatron_format import (
    FORMAT_MEGATRON_DIST,
    MegatronCheckpoint,
    MegatronCheckpointError,
    find_megatron_checkpoint,
)
from megatron_chimera.checkpoint.tokenizer_record import TokenizerSettings
from megatron_chimera.config import ConfigError, ModelConfig
from megatron_chimera.hf.convert import checkpoint_args
from megatron_chimera.inference.loader import build_model
from megatron_chimera.megatron_lm.args import args_dict, check_supported, model_config_from_args
from megatron_chimera.megatron_lm.legacy_reader import LegacyReader
from megatron_chimera.megatron_lm.names import to_ours
from megatron_chimera.megatron_lm.torch_dist_reader import TorchDistReader
from megatron_chimera.model.family import GPT2


@dataclass(frozen=True)
class MegatronImportResult:
    """What ``import_megatron`` read and wrote."""

    source: MegatronCheckpoint
    model_config: ModelConfig
    tokenizer: TokenizerSettings
    checkpoint: str
    tensors: int  # Megatron tensors copied
    notes: list[str] = field(default_factory=list)


def open_megatron(load: str) -> MegatronCheckpoint:
    """The Megatron-LM checkpoint at ``load``; MegatronCheckpointError when it is not one."""
    found = find_megatron_checkpoint(load)
    if found is None:
        raise MegatronCheckpointError(
            f"--load {load}: not a Megatron-LM checkpoint (expected a directory with "
            "latest_checkpointed_iteration.txt over iter_*/ holding metadata.json + *.distcp "
            "(torch_dist) or mp_rank_*/model_optim_rng.pt (legacy), or such an iter_* directory)")
    return found


def _tokenizer(args: dict) -> TokenizerSettings:
    kind = args.get("tokenizer_type")
    return TokenizerSettings(kind if kind != "NullTokenizer" else None, args.get("vocab_file"),
                             args.get("merge_file"), args.get("tokenizer_model"))


def _checked(stream, params: dict[str, torch.Tensor], source: str):
    """(our name, tensor) of every (Megatron name, tensor) of ``stream``, checked against the
    model's parameters ``params`` (``meta`` tensors will do: only names, shapes and dtypes are
    used): a tensor we have no place for, a shape or dtype that differs, a tensor given twice,
    and a parameter left unfilled at the end are refused."""
    filled: set[str] = set()
    for name, tensor in stream:
        ours = to_ours(name)
        if ours is None or ours not in params or ours in filled:
            raise MegatronCheckpointError(f"{source}: tensor {name!r} is a model part this "
                                          "converter does not support (unknown layout)")
        target = params[ours]
        if tuple(tensor.shape) != tuple(target.shape):
            raise MegatronCheckpointError(
                f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, the model its args "
                f"describe needs {tuple(target.shape)} for {ours}")
        if tensor.dtype != target.dtype:
            raise MegatronCheckpointError(
                f"{source}: tensor {name!r} is {tensor.dtype}, but the args (fp16 / bf16) "
                f"describe {target.dtype} weights")
        filled.add(ours)
        yield ours, tensor
        del tensor  # not held while the next one is read
    missing = sorted(set(params) - filled)
    if missing:
        raise MegatronCheckpointError(f"{source}: the checkpoint lacks {', '.join(missing[:4])}"
                                      f"{' ...' if len(missing) > 4 else ''} (unknown layout)")


def _stream(reader: TorchDistReader | LegacyReader, args: dict, num_layers: int,
            source: str):
    """The (normalised name, tensor) stream of ``reader``; a legacy grid must match args' T x P."""
    if isinstance(reader, TorchDistReader):
        return reader.iter_model(num_layers)
    expected = (int(args.get("tensor_model_parallel_size") or 1),
                int(args.get("pipeline_model_parallel_size") or 1))
    if (reader.tensor, reader.pipeline) != expected:
        raise MegatronCheckpointError(
            f"{source}: holds a {reader.tensor} x {reader.pipeline} grid of mp_rank_* files, "
            f"but its args say T={expected[0]} x P={expected[1]} (files missing)")
    tied = not args.get("untie_embeddings_and_output_weights", False)
    return reader.iter_model(bool(args.get("swiglu", False)), tied)


def _vocab_rows(reader: TorchDistReader | LegacyReader, args: dict, source: str) -> int:
    """The stored vocabulary rows: the embedding's (torch_dist) or ``args.padded_vocab_size``."""
    rows = args.get("padded_vocab_size")
    if isinstance(reader, TorchDistReader):
        meta = reader.tensors.get("embedding.word_embeddings.weight")
        rows = int(meta.size[0]) if meta is not None else rows
    if not rows:
        raise MegatronCheckpointError(f"{source}: the saved args lack 'padded_vocab_size'")
    return int(rows)


def _notes(reader: TorchDistReader | LegacyReader, common: dict, args: dict) -> list[str]:
    notes = [f"trained at T={args.get('tensor_model_parallel_size', 1)} x "
             f"P={args.get('pipeline_model_parallel_size', 1)}; the import loads under any layout"]
    has_optimizer = (bool(reader.optimizer_keys()) if isinstance(reader, TorchDistReader)
                     else "optimizer" in common)
    if has_optimizer:
        notes.append("the checkpoint's optimizer state is not imported: training starts from "
                     "these weights with a fresh optimizer (as --finetune)")
    return notes


def import_megatron(load: str, save: str,
                    ckpt_format: str = FORMAT_TORCH_DIST) -> MegatronImportResult:
    """Convert the Megatron-LM checkpoint at ``load`` into a release checkpoint under ``save``."""
    if ckpt_format not in CKPT_FORMATS:
        raise ConfigError(f"--ckpt-format must be one of {', '.join(CKPT_FORMATS)}")
    if os.path.isdir(save) and read_tracker(save) is not None:
        raise MegatronCheckpointError(f"--save {save} already holds a checkpoint; import into a "
                                      "new directory")
    found = open_megatron(load)
    reader = (TorchDistReader(found.path) if found.format == FORMAT_MEGATRON_DIST
              else LegacyReader(found.path))
    common = reader.common()
    source = found.path
    args = args_dict(common.get("args"), source)
    check_supported(args, source)
    config = model_config_from_args(args, _vocab_rows(reader, args, source), source)
    streamed = ckpt_format == FORMAT_TORCH_DIST
    with torch.device("meta") if streamed else contextlib.nullcontext():
        model = build_model(GPT2, config)  # torch_dist: names, shapes and dtypes only
    params = dict(model.named_parameters())
    tensors = _checked(_stream(reader, args, config.num_layers, source), params, source)
    tokenizer = _tokenizer(args)
    provenance = {"megatron_checkpoint": os.path.abspath(found.path), "format": found.format,
                  "iteration": found.iteration}
    layers = (0, config.num_layers)
    contents = CheckpointContents(
        0, [StageSlice(0, layers, model)], [layers],
        args=checkpoint_args(config, tokenizer, GPT2, provenance), save_optim=False,
        release=True)
    if streamed:  # each tensor written as it is read: memory about the largest stored tensor
        path = save_streamed(save, contents, tensors)
    else:  # the torch format's one file per stage needs the whole model
        with torch.no_grad():
            for ours, tensor in tensors:
                params[ours].copy_(tensor)
        path = save_checkpoint(save, contents, rank=0, world_size=1, ckpt_format=ckpt_format)
    return MegatronImportResult(found, config, tokenizer, path, len(params),
                                _notes(reader, common, args))
