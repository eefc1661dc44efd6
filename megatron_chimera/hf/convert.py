"""``import_hf`` and ``export_hf``: Hugging Face directories <-> our layout-independent checkpoints.

An import builds the whole model once, loads the mapped weights into it (strictly: every tensor
used, every parameter filled) and writes it with :func:`~megatron_chimera.checkpoint.checkpointing.
save_checkpoint` as a *release* checkpoint at iteration 0: ``--load`` then starts training from it
with a fresh optimizer under any D, pipes and W. The checkpoint records the model's arguments, the
family and the tokenizer, so the tools and ``export_hf`` need nothing else. An export loads the
checkpoint on one process, maps the weights back (vocabulary unpadded), writes ``config.json``,
``model.safetensors`` and the tokenizer files atomically, and (``verify``) loads the result with
``transformers`` and reports the largest logit difference on a random batch.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_chimera.checkpoint.checkpointing import (
    CKPT_FORMATS,
    FORMAT_TORCH_DIST,
    CheckpointContents,
    StageSlice,
    read_tracker,
    save_checkpoint,
)
from megatron_chimera.checkpoint.tokenizer_record import TokenizerSettings
from megatron_chimera.config import (
    CheckpointConfig,
    ConfigError,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainConfig,
    TrainingConfig,
)
from megatron_chimera.data.tokenizers import build_tokenizer
from megatron_chimera.hf import bert, gpt2, llama
from megatron_chimera.hf import moe as hf_moe
from megatron_chimera.hf.common import HFError
from megatron_chimera.hf.hf_dir import (
    CONFIG_FILE,
    SAFETENSORS_FILE,
    read_config,
    read_weights,
    require_transformers,
    safetensors_writer,
    write_dir,
)
from megatron_chimera.hf.tokenizer_files import export_tokenizer, import_tokenizer
from megatron_chimera.inference.loader import LoadedModel, build_model, load_model, load_tokenizer
from megatron_chimera.model.family import BERT, GPT2, ModelFamily

FAMILY_OF_MODEL_TYPE = {gpt2.MODEL_TYPE: GPT2, bert.MODEL_TYPE: BERT,
                        **{model_type: GPT2 for model_type in llama.ARCHITECTURES},
                        **{model_type: GPT2 for model_type in hf_moe.ARCHITECTURES},
                        **{model_type: GPT2 for model_type in hf_moe.REFUSED}}
CONFIG_CLASSES = {gpt2.MODEL_TYPE: "GPT2Config", bert.MODEL_TYPE: "MegatronBertConfig",
                  "llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
                  "mixtral": "MixtralConfig", "qwen2_moe": "Qwen2MoeConfig",
                  "qwen3_moe": "Qwen3MoeConfig"}


@dataclass(frozen=True)
class Agreement:
    """Our model vs ``transformers`` on one random batch (fp32, eager attention)."""

    max_abs_logit_diff: float  # over the real (unpadded) vocabulary
    loss_diff: float  # |our loss - theirs|: next-token (GPT) or all-token MLM (BERT) cross-entropy


@dataclass(frozen=True)
class ImportResult:
    """What ``import_hf`` wrote."""

    family: ModelFamily
    model_config: ModelConfig
    tokenizer: TokenizerSettings
    checkpoint: str
    weights_file: str
    notes: list[str] = field(default_factory=list)
    agreement: Agreement | None = None


@dataclass(frozen=True)
class ExportResult:
    """What ``export_hf`` wrote, and how well transformers' load of it agrees (None: unchecked)."""

    family: ModelFamily
    architecture: str
    hf_dir: str
    files: list[str]
    notes: list[str] = field(default_factory=list)
    agreement: Agreement | None = None


def read_hf_config(hf_dir: str) -> tuple[ModelFamily, Any]:
    """The family (GPT or BERT) and the ``transformers`` config object of ``hf_dir``."""
    raw = read_config(hf_dir)
    model_type = raw["model_type"]
    if model_type not in FAMILY_OF_MODEL_TYPE:
        raise HFError(f"{os.path.join(hf_dir, CONFIG_FILE)}: model_type {model_type!r} is not "
                      f"supported (one of {', '.join(FAMILY_OF_MODEL_TYPE)})")
    transformers = require_transformers()
    family = FAMILY_OF_MODEL_TYPE[model_type]
    cls = getattr(transformers, CONFIG_CLASSES[model_type])
    try:
        return family, cls.from_dict(raw)
    except (TypeError, ValueError) as exc:
        raise HFError(f"{os.path.join(hf_dir, CONFIG_FILE)}: invalid config ({exc})") from None


def checkpoint_args(model: ModelConfig, tokenizer: TokenizerSettings, family: ModelFamily,
                     provenance: dict[str, Any]) -> dict[str, Any]:
    """The argument record of an imported checkpoint (the same shape training saves)."""
    data = DataConfig(tokenizer_type=tokenizer.tokenizer_type, vocab_file=tokenizer.vocab_file,
                      merge_file=tokenizer.merge_file, tokenizer_model=tokenizer.tokenizer_model)
    config = TrainConfig(model=model, parallel=ParallelConfig(), optimizer=OptimizerConfig(),
                         data=data, training=TrainingConfig(), checkpoint=CheckpointConfig(),
                         logging=LoggingConfig())
    args = dataclasses.asdict(config)
    args["model_family"] = family.name
    args["imported_from"] = provenance
    return args


def _tokenizer_notes(tokenizer: TokenizerSettings, model: ModelConfig, hf_dir: str) -> list[str]:
    """Check the copied tokenizer against the model's vocabulary."""
    if tokenizer.tokenizer_type is None:
        return [f"{hf_dir} has no GPT-2 BPE (vocab.json + merges.txt), WordPiece (vocab.txt) or "
                "fast tokenizer (tokenizer.json) files: the checkpoint has no tokenizer (pass "
                "--tokenizer-type ... to the tools)"]
    built = build_tokenizer(tokenizer.tokenizer_type, vocab_file=tokenizer.vocab_file,
                            merge_file=tokenizer.merge_file,
                            tokenizer_model=tokenizer.tokenizer_model)
    if built.vocab_size > model.vocab_size:
        return [f"the tokenizer has {built.vocab_size} ids (Megatron's {tokenizer.tokenizer_type} "
                f"included), the model {model.vocab_size}: training with it needs a padded "
                f"vocabulary of {model.padded_vocab_size}"]
    return []


def import_hf(hf_dir: str, save: str, make_vocab_size_divisible_by: int = 128,
              max_position_embeddings: int | None = None, verify: bool = False,
              ckpt_format: str = FORMAT_TORCH_DIST) -> ImportResult:
    """Convert the Hugging Face model in ``hf_dir`` into a release checkpoint under ``save`` in
    ``ckpt_format`` (``torch_dist`` by default, as training writes); ``verify`` also runs both
    models on a random batch (positions unchanged only)."""
    if make_vocab_size_divisible_by <= 0:
        raise ConfigError("--make-vocab-size-divisible-by must be positive")
    if ckpt_format not in CKPT_FORMATS:
        raise ConfigError(f"--ckpt-format must be one of {', '.join(CKPT_FORMATS)}")
    if max_position_embeddings is not None and max_position_embeddings <= 0:
        raise ConfigError("--max-position-embeddings must be positive")
    existing = read_tracker(save) if os.path.isdir(save) else None
    if existing is not None:
        raise HFError(f"--save {save} already holds a checkpoint (iteration {existing}); "
                      "import into a new directory")
    family, hf = read_hf_config(hf_dir)
    tensors, weights_file = read_weights(hf_dir)
    config_path = os.path.join(hf_dir, CONFIG_FILE)
    if hf.model_type in hf_moe.ARCHITECTURES or hf.model_type in hf_moe.REFUSED:
        model_config = hf_moe.model_config_from_hf(hf, config_path, make_vocab_size_divisible_by,
                                                   max_position_embeddings)
        state = hf_moe.state_from_hf(tensors, model_config, hf.model_type, weights_file)
    elif hf.model_type in llama.ARCHITECTURES:
        model_config = llama.model_config_from_hf(hf, config_path, make_vocab_size_divisible_by,
                                                  max_position_embeddings)
        state = llama.state_from_hf(tensors, model_config, weights_file)
    elif family is GPT2:
        model_config = gpt2.model_config_from_hf(hf, config_path, make_vocab_size_divisible_by,
                                                 max_position_embeddings)
        state = gpt2.state_from_hf(tensors, model_config, weights_file)
    else:
        model_config = bert.model_config_from_hf(hf, tensors, config_path,
                                                 make_vocab_size_divisible_by,
                                                 max_position_embeddings)
        state = bert.state_from_hf(tensors, model_config, weights_file)
    model = build_model(family, model_config)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise HFError(f"{weights_file}: the weights do not fit {config_path} ({exc})") from None
    tokenizer = import_tokenizer(hf_dir, save, family, prefer_fast=hf.model_type != "gpt2")
    notes = _tokenizer_notes(tokenizer, model_config, hf_dir)
    provenance = {"hf_dir": os.path.abspath(hf_dir), "model_type": hf.model_type,
                  "weights": os.path.basename(weights_file)}
    layers = (0, model_config.num_layers)
    path = save_checkpoint(save, CheckpointContents(0, [StageSlice(0, layers, model)], [layers],
                                                    args=checkpoint_args(model_config, tokenizer,
                                                    family, provenance), save_optim=False,
                                                    release=True), rank=0, world_size=1,
                           ckpt_format=ckpt_format)
    agreement = None
    if verify and max_position_embeddings is None:
        agreement = compare_with_transformers(model, family, model_config, hf_dir)
    return ImportResult(family, model_config, tokenizer, path, weights_file, notes, agreement)


def _special_id(loaded: LoadedModel, name: str) -> int | None:
    """The tokenizer's ``eod`` / ``pad`` id when the checkpoint has a usable tokenizer."""
    try:
        return int(getattr(load_tokenizer(loaded), name))
    except (ConfigError, NotImplementedError, OSError):
        return None


def llama_model_type(loaded: LoadedModel, model_type: str | None) -> str | None:
    """The Hugging Face architecture a GPT checkpoint exports as: None for GPT-2 (learned
    positions), else ``model_type`` when given, the imported model's type, or (dense) ``qwen2``
    with a QKV bias and ``llama`` without, (MoE) ``qwen2_moe`` with a shared expert and
    ``mixtral`` without."""
    config = loaded.model_config
    is_moe = config.moe.enabled
    if config.position_embedding_type != "rope" and model_type is None:
        if is_moe:
            raise HFError("export-hf: an MoE checkpoint exports as mixtral or qwen2_moe, which "
                          "need RoPE (--position-embedding-type rope), RMSNorm and SwiGLU")
        return None
    allowed = hf_moe.ARCHITECTURES if is_moe else llama.ARCHITECTURES
    if model_type is not None:
        if model_type not in allowed:
            kind = "has MoE layers" if is_moe else "has no MoE layers"
            raise HFError(f"--model-type {model_type!r}: the checkpoint {kind}, choose one of "
                          f"{', '.join(allowed)}")
        return model_type
    imported = ((loaded.common.get("args") or {}).get("imported_from") or {}).get("model_type")
    if imported in allowed:
        return imported
    if is_moe:
        return hf_moe.default_model_type(config)
    return "qwen2" if config.add_qkv_bias else "llama"


def export_hf(load: str, hf_dir: str, overwrite: bool = False,
              verify: bool = True, model_type: str | None = None) -> ExportResult:
    """Write the checkpoint under ``load`` as a ``from_pretrained`` directory ``hf_dir``
    (``model_type``: llama, mistral or qwen2 for a dense RoPE model, mixtral or qwen2_moe for
    an MoE one; default as imported)."""
    transformers = require_transformers()
    loaded = load_model(load, "cpu", params_dtype="fp32")
    config = loaded.model_config
    state = {k: v.detach() for k, v in loaded.model.state_dict().items()}
    notes: list[str] = []
    decoder = llama_model_type(loaded, model_type) if loaded.family is GPT2 else None
    if decoder in hf_moe.ARCHITECTURES:
        tensors = hf_moe.state_to_hf(state, config, decoder)
        kwargs, moe_notes = hf_moe.hf_config_dict(config, decoder, _special_id(loaded, "eod"))
        hf_config = getattr(transformers, CONFIG_CLASSES[decoder])(**kwargs)
        notes += moe_notes
    elif decoder is not None:
        tensors = llama.state_to_hf(state, config)
        cls = getattr(transformers, CONFIG_CLASSES[decoder])
        hf_config = cls(**llama.hf_config_dict(config, decoder, _special_id(loaded, "eod")))
    elif loaded.family is GPT2:
        tensors = gpt2.state_to_hf(state, config)
        hf_config = transformers.GPT2Config(**gpt2.hf_config_dict(
            config, _special_id(loaded, "eod")))
    else:
        tensors = bert.state_to_hf(state, config)
        kwargs, warning = bert.hf_config_dict(config, _special_id(loaded, "pad"))
        hf_config = transformers.MegatronBertConfig(**kwargs)
        notes += [warning] if warning else []
    tokenizer_files, note = export_tokenizer(loaded.data_config, load, config.max_positions)
    notes += [note] if note else []
    files = {CONFIG_FILE: hf_config.to_json_string(use_diff=True).encode(),
             SAFETENSORS_FILE: safetensors_writer(tensors), **tokenizer_files}
    write_dir(hf_dir, files, overwrite=overwrite)
    agreement = (compare_with_transformers(loaded.model, loaded.family, config, hf_dir)
                 if verify else None)
    return ExportResult(loaded.family, hf_config.architectures[0], os.path.abspath(hf_dir),
                        sorted(files), notes, agreement)


@torch.no_grad()
def compare_with_transformers(model: torch.nn.Module, family: ModelFamily, config: ModelConfig,
                              hf_dir: str, batch: int = 2, seq: int = 16) -> Agreement:
    """Run ``model`` and ``from_pretrained(hf_dir)`` on the same random tokens."""
    transformers = require_transformers()
    seq = min(seq, config.max_positions)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (batch, seq), generator=generator)
    labels = torch.randint(0, config.vocab_size, (batch, seq), generator=generator)
    was_training = model.training
    model.eval()
    if family is GPT2:
        cls = (transformers.GPT2LMHeadModel if config.learned_positions
               else transformers.AutoModelForCausalLM)
        hf = cls.from_pretrained(hf_dir, attn_implementation="eager")
        ours = model(tokens, torch.arange(seq).expand(batch, seq))
        theirs = hf.eval()(input_ids=tokens).logits
    else:
        cls = (transformers.MegatronBertForPreTraining if config.bert_binary_head
               else transformers.MegatronBertForMaskedLM)
        hf = cls.from_pretrained(hf_dir, attn_implementation="eager").eval()
        types = torch.zeros_like(tokens)
        if model.num_tokentypes > 1:
            types[:, seq // 2:] = 1
        ours, _ = model(tokens, torch.ones(batch, seq),
                        tokentype_ids=types if model.num_tokentypes else None)
        out = hf(input_ids=tokens, token_type_ids=types, attention_mask=torch.ones_like(tokens))
        theirs = out.prediction_logits if config.bert_binary_head else out.logits
    model.train(was_training)
    # our logits span the padded vocabulary (padding at -inf); the loss is over all of it
    our_loss = torch.nn.functional.cross_entropy(ours.float().flatten(0, 1), labels.flatten())
    their_loss = torch.nn.functional.cross_entropy(theirs.float().flatten(0, 1), labels.flatten())
    diff = (ours[..., :config.vocab_size].float() - theirs.float()).abs().max()
    return Agreement(float(diff), abs(float(our_loss) - float(their_loss)))
