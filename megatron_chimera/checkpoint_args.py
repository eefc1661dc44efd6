"""Megatron's ``check_checkpoint_args``: a checkpoint loads only into the model it was saved from.

Shapes alone do not tell models apart: a 4-layer checkpoint fills the first two layers of a
2-layer model (and brings the 4-layer model's final norm and head), a 4-head checkpoint loads
into 8 heads (its QKV re-split). So the *model-defining* arguments saved with the checkpoint are
compared with the run's, and every difference is named in one error. As Megatron: the layers,
hidden size, heads, position embeddings, padded vocabulary and tokenizer type; beyond Megatron
(whose loader catches them as shape errors): the FFN size, untied output layer and BERT's token
types and binary head. Everything else may change: the layout (D, pipes, W, schedule, T) --
checkpoints are layout-independent -- and training settings (dropout, learning rate, precision,
sequence length up to the position embeddings). Unlike Megatron, ``--finetune`` is checked too:
fine-tuning starts from the same model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_chimera.checkpointing import CheckpointError
from megatron_chimera.config import TrainConfig, pad_vocab_size

# name in the signature -> the flag(s) a user changes
MODEL_ARGS: dict[str, str] = {
    "num_layers": "--num-layers",
    "hidden_size": "--hidden-size",
    "num_attention_heads": "--num-attention-heads",
    "ffn_hidden_size": "--ffn-hidden-size",
    "max_position_embeddings": "--max-position-embeddings",
    "padded_vocab_size": "the padded vocabulary (tokenizer / --vocab-size, "
                         "--make-vocab-size-divisible-by)",
    "tokenizer_type": "--tokenizer-type",
    "untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
    "num_tokentypes": "the token-type embeddings (BERT)",
    "bert_binary_head": "--bert-no-binary-head",
}


def model_signature(args: dict[str, Any]) -> dict[str, Any]:
    """The model-defining values of a run's arguments (``dataclasses.asdict(TrainConfig)``, as
    saved in ``common.pt``), derived values resolved (FFN 4h, positions = seq length, padding).
    Keys missing from an older checkpoint are left out."""
    model = args.get("model") or {}
    data = args.get("data") or {}
    out: dict[str, Any] = {}
    for key in ("num_layers", "hidden_size", "num_attention_heads",
                "untie_embeddings_and_output_weights", "num_tokentypes", "bert_binary_head"):
        if key in model:
            out[key] = model[key]
    if "hidden_size" in model:
        out["ffn_hidden_size"] = model.get("ffn_hidden_size") or 4 * model["hidden_size"]
    if "seq_length" in model:
        out["max_position_embeddings"] = (model.get("max_position_embeddings")
                                          or model["seq_length"])
    if "vocab_size" in model and "make_vocab_size_divisible_by" in model:
        out["padded_vocab_size"] = pad_vocab_size(model["vocab_size"],
                                                  model["make_vocab_size_divisible_by"])
    if "tokenizer_type" in data:
        out["tokenizer_type"] = data["tokenizer_type"] or "NullTokenizer"
    return out


def checkpoint_args_mismatches(saved_args: dict[str, Any], config: TrainConfig) -> list[str]:
    """``"<flag>: <saved> in the checkpoint, <now> now"`` for every model-defining difference."""
    saved = model_signature(saved_args)
    now = model_signature(dataclasses.asdict(config))
    return [f"{MODEL_ARGS[key]}: {saved[key]} in the checkpoint, {now[key]} now"
            for key in MODEL_ARGS if key in saved and key in now and saved[key] != now[key]]


def check_checkpoint_args(config: TrainConfig, saved_args: dict[str, Any], path: str) -> None:
    """Raise one CheckpointError naming every model-defining argument in which the checkpoint at
    ``path`` differs from ``config``."""
    mismatches = checkpoint_args_mismatches(saved_args, config)
    if mismatches:
        raise CheckpointError(
            f"{path} was saved from a different model: {'; '.join(mismatches)} "
            "(layout and training flags may change, the model's may not)")
