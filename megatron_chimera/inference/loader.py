"""Load any checkpoint, written on any layout, into one whole model on one device.

The model's shape and the tokenizer come from the arguments saved in ``common.pt``; the family
(GPT-2 or BERT) from the saved ``model_family`` or, for checkpoints written by training, from the
weights (BERT's last stage has an ``lm_head``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megatron_chimera.checkpoint.checkpointing import CheckpointError, StageSlice, checkpoint_dir
from megatron_chimera.checkpoint.loading import CheckpointTarget, load_checkpoint
from megatron_chimera.checkpoint.saved_args import (
    read_common,
    saved_data_config,
    saved_model_config,
)
from megatron_chimera.checkpoint.tokenizer_record import TokenizerSettings, resolve_file
from megatron_chimera.config import ConfigError, DataConfig, ModelConfig
from megatron_chimera.data.tokenizers import MegatronTokenizer, build_tokenizer
from megatron_chimera.model.bert import BertModel
from megatron_chimera.model.family import BERT, FAMILIES, GPT2, ModelFamily
from megatron_chimera.model.gpt2 import GPTModel

LEGACY_NAMES = {"gpt": GPT2}  # family names recorded by earlier checkpoints


@dataclass(frozen=True)
class LoadedModel:
    """A whole model restored from a checkpoint, in eval mode, with what describes it."""

    model: nn.Module
    family: ModelFamily
    model_config: ModelConfig
    data_config: DataConfig
    root: str
    iteration: int
    common: dict[str, Any]


def _iteration_dir(root: str, common: dict[str, Any]) -> str:
    path = checkpoint_dir(root, int(common["iteration"]))
    return path if os.path.isdir(path) else path + ".old"


def detect_family(root: str, common: dict[str, Any]) -> ModelFamily:
    """GPT-2 or BERT: the recorded family, else whether the last stage has an LM head."""
    name = (common.get("args") or {}).get("model_family")
    if name in FAMILIES or name in LEGACY_NAMES:
        return FAMILIES.get(name) or LEGACY_NAMES[name]
    last = common["stages"][-1]["file"]
    path = os.path.join(_iteration_dir(root, common), last)
    try:  # weights_only + mmap: reads the key names without loading the tensors
        keys = torch.load(path, map_location="cpu", weights_only=True, mmap=True)["model"].keys()
    except Exception as exc:  # noqa: BLE001 - torch raises many types for corrupt files
        raise CheckpointError(f"checkpoint file {path} is corrupt or missing "
                              f"({type(exc).__name__}: {exc})") from None
    return BERT if any(k.startswith("lm_head.") for k in keys) else GPT2


def build_model(family: ModelFamily, config: ModelConfig) -> nn.Module:
    """The whole (single-stage) model of ``family``."""
    return BertModel(config) if family is BERT else GPTModel(config)


def load_model(root: str, device: str | torch.device = "cpu",
               params_dtype: str | None = None) -> LoadedModel:
    """Restore the latest checkpoint under ``root`` into one whole model in eval mode.

    ``params_dtype`` ("fp32", "fp16", "bf16") overrides the dtype the checkpoint was trained in.
    """
    if not os.path.isdir(root):
        raise CheckpointError(f"--load {root}: not a directory")
    common = read_common(root)
    if common is None:
        raise CheckpointError(
            f"--load {root}: no checkpoint (no latest_checkpointed_iteration.txt)")
    config = saved_model_config(common, root)
    if params_dtype is not None:
        config = dataclasses.replace(config, params_dtype=params_dtype)
    if config.use_apex and torch.device(device).type != "cuda":
        config = dataclasses.replace(config, use_apex=None)
    family = detect_family(root, common)
    model = build_model(family, config)
    stage = StageSlice(0, (0, config.num_layers), model)
    loaded = load_checkpoint(root, CheckpointTarget([stage], 1, load_optim=False, load_rng=False),
                             rank=0, world_size=1)
    model.to(device).eval()
    return LoadedModel(model, family, config, saved_data_config(common), root,
                       int(loaded.iteration if loaded else 0), common)


def load_tokenizer(loaded: LoadedModel,
                   override: TokenizerSettings | None = None,
                   tokenizer_model: str | None = None) -> MegatronTokenizer:
    """The checkpoint's tokenizer (as its run built it), or ``override`` when given; its files
    are found where recorded or in ``<checkpoint>/tokenizer/``."""
    data, root = loaded.data_config, loaded.root
    if override is not None and override.tokenizer_type is not None:
        data = dataclasses.replace(data, tokenizer_type=override.tokenizer_type,
                                   vocab_file=override.vocab_file, merge_file=override.merge_file,
                                   tokenizer_model=tokenizer_model)
    kind = data.tokenizer_type or "NullTokenizer"
    if kind == "NullTokenizer" and data.vocab_size is None:
        raise ConfigError(f"--load {root}: the checkpoint records no tokenizer; pass "
                          "--tokenizer-type with --vocab-file / --merge-file / --tokenizer-model")
    files = {"--vocab-file": data.vocab_file, "--merge-file": data.merge_file,
             "--tokenizer-model": data.tokenizer_model}
    resolved = {flag: resolve_file(path, root) for flag, path in files.items()}
    for flag, path in files.items():
        if path is not None and resolved[flag] is None:
            raise ConfigError(f"{flag} {path} (recorded in the checkpoint) not found, nor in "
                              f"{os.path.join(root, 'tokenizer')}; pass {flag}")
    tokenizer = build_tokenizer(
        kind, tokenizer_model=resolved["--tokenizer-model"], vocab_file=resolved["--vocab-file"],
        merge_file=resolved["--merge-file"], vocab_size=data.vocab_size,
        make_vocab_size_divisible_by=loaded.model_config.make_vocab_size_divisible_by)
    if tokenizer.vocab_size > loaded.model_config.vocab_size:
        raise ConfigError(f"--tokenizer-type {kind}: {tokenizer.vocab_size} tokens, more than "
                          f"the model's vocabulary {loaded.model_config.vocab_size}")
    return tokenizer
