"""Write Megatron-LM checkpoints without Megatron: ``torch_dist`` and legacy ``mp_rank_*`` files.

The layouts are facts checked against real megatron-core 0.16.1 output (``GPTModel`` with the
local spec, ``use_cpu_initialization``, saved by ``dist_checkpointing.save`` at 1 and 4 gloo ranks,
T=2 x P=2, and its ``state_dict()`` per rank for the legacy files, as Megatron-LM's
``training/checkpointing.py`` saves them), see docs/MEGATRON_CHECKPOINTS.md:

* ``torch_dist``: keys without a ``model.`` prefix; layers stacked on dim 0 under
  ``decoder.layers.<suffix>``; both layer norms named after the linear they feed
  (``self_attention.linear_qkv.layer_norm_weight``, ``mlp.linear_fc1.layer_norm_weight``);
  one bytes item per layer and linear, ``<key>._extra_state/shard_{i}_{L}``
  (``torch.save([None])``);
  a tied output layer is absent; ``common.pt`` holds ``args`` (an ``argparse.Namespace``),
  ``iteration``, ``checkpoint_version`` 3.0; ``metadata.json`` names the backend.
* legacy: ``iter_0000007/mp_rank_TT[_PPP]/model_optim_rng.pt`` (``_PPP`` only with P > 1) holding
  ``args``, ``checkpoint_version``, ``iteration``, ``model`` (that rank's ``state_dict()``: layer
  numbers local to the stage, local-spec norms ``input_layernorm`` / ``pre_mlp_layernorm``,
  ``_extra_state`` None), ``rng_state`` (numpy's state included); ``linear_qkv`` and the
  vocabulary split on rows, ``linear_proj`` / ``linear_fc2`` on columns, SwiGLU's ``linear_fc1``
  per rank ``[gate_r; up_r]``; with a tied embedding and P > 1 the last stage holds its shard of
  ``output_layer.weight``.

The Transformer-Engine spec's legacy names (``linear_qkv.layer_norm_weight``, an ``io.BytesIO``
``_extra_state`` as older Transformer Engine versions return) come from Megatron-LM's source, not
from a run (Transformer Engine needs CUDA).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

ITERATION = 7
LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
           "mlp.linear_fc2")
LOCAL_NORMS = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
               "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
               "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
               "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias"}


def megatron_args(kind: str, layers: int = 2, tensor: int = 1, pipeline: int = 1,
                  **overrides) -> argparse.Namespace:
    """Megatron-LM's saved ``args`` of a tiny GPT-2-like (LayerNorm, GeLU, biases, learned
    positions, tied) or Llama-like (RMSNorm, SwiGLU, 4 heads in 2 query groups, RoPE, untied)."""
    llama = kind == "llama"
    values = dict(
        num_layers=layers, hidden_size=32, ffn_hidden_size=48 if llama else 128,
        num_attention_heads=4, kv_channels=8, group_query_attention=llama,
        num_query_groups=2 if llama else 1, max_position_embeddings=16, seq_length=16,
        position_embedding_type="rope" if llama else "learned_absolute", rotary_percent=1.0,
        rotary_base=10000, rotary_interleaved=False, use_rope_scaling=False,
        rope_scaling_factor=8.0, normalization="RMSNorm" if llama else "LayerNorm",
        norm_epsilon=1e-5, apply_layernorm_1p=False, swiglu=llama, squared_relu=False,
        openai_gelu=False, add_bias_linear=not llama, add_qkv_bias=False,
        untie_embeddings_and_output_weights=llama, padded_vocab_size=128,
        make_vocab_size_divisible_by=64, vocab_size=None, tensor_model_parallel_size=tensor,
        pipeline_model_parallel_size=pipeline, virtual_pipeline_model_parallel_size=None,
        num_experts=None, qk_layernorm=False, multi_latent_attention=False, mtp_num_layers=None,
        transformer_impl="local", use_legacy_models=False, fp16=False, bf16=False,
        params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=0.02, tokenizer_type="NullTokenizer", ckpt_format="torch_dist",
        iteration=ITERATION)
    values.update(overrides)
    return argparse.Namespace(**values)


def global_tensors(args: argparse.Namespace, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random whole-model tensors under Megatron-core's global names
    (``decoder.layers.{i}.<torch_dist suffix>``), shaped as ``args`` describes."""
    gen = torch.Generator().manual_seed(seed)
    h, heads, d = args.hidden_size, args.num_attention_heads, args.kv_channels
    groups = args.num_query_groups if args.group_query_attention else heads
    qkv = (heads + 2 * groups) * d
    fc1 = args.ffn_hidden_size * (2 if args.swiglu else 1)
    shapes = {"self_attention.linear_qkv.layer_norm_weight": (h,),
              "self_attention.linear_qkv.weight": (qkv, h),
              "self_attention.linear_proj.weight": (h, heads * d),
              "mlp.linear_fc1.layer_norm_weight": (h,),
              "mlp.linear_fc1.weight": (fc1, h),
              "mlp.linear_fc2.weight": (h, args.ffn_hidden_size)}
    if args.normalization == "LayerNorm":
        shapes.update({"self_attention.linear_qkv.layer_norm_bias": (h,),
                       "mlp.linear_fc1.layer_norm_bias": (h,)})
    if args.add_bias_linear:
        shapes.update({"self_attention.linear_qkv.bias": (qkv,),
                       "self_attention.linear_proj.bias": (h,), "mlp.linear_fc1.bias": (fc1,),
                       "mlp.linear_fc2.bias": (h,)})

    def rand(shape):
        return torch.randn(shape, generator=gen) * 0.2

    out = {"embedding.word_embeddings.weight": rand((args.padded_vocab_size, h))}
    if args.position_embedding_type == "learned_absolute":
        out["embedding.position_embeddings.weight"] = rand((args.max_position_embeddings, h))
    for i in range(args.num_layers):
        for suffix, shape in shapes.items():
            value = rand(shape)
            out[f"decoder.layers.{i}.{suffix}"] = value + 1 if "norm_weight" in suffix else value
    out["decoder.final_layernorm.weight"] = rand((h,)) + 1
    if args.normalization == "LayerNorm":
        out["decoder.final_layernorm.bias"] = rand((h,))
    if args.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = rand((args.padded_vocab_size, h))
    return out


def _tracker(root: Path) -> None:
    (root / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))


def write_torch_dist(root: Path, args: argparse.Namespace,
                     tensors: dict[str, torch.Tensor]) -> Path:
    """A Megatron-core ``torch_dist`` checkpoint of ``tensors`` under ``root``."""
    path = root / f"iter_{ITERATION:07d}"
    path.mkdir(parents=True)
    layers, state = args.num_layers, {}
    for name, value in tensors.items():
        if name.startswith("decoder.layers."):
            index, suffix = name[len("decoder.layers."):].split(".", 1)
            if int(index) == 0:
                state["decoder.layers." + suffix] = torch.stack(
                    [tensors[f"decoder.layers.{i}.{suffix}"] for i in range(layers)])
        else:
            state[name] = value
    for linear in LINEARS:
        for i in range(layers):
            state[f"decoder.layers.{linear}._extra_state/shard_{i}_{layers}"] = [None]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=FileSystemWriter(str(path)), no_dist=True,
                 planner=DefaultSavePlanner(flatten_state_dict=False))
    torch.save({"args": args, "iteration": ITERATION, "checkpoint_version": 3.0,
                "num_floating_point_operations_so_far": 0}, path / "common.pt")
    (path / "metadata.json").write_text(json.dumps(
        {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
         "common_backend": "torch", "common_backend_version": 1}))
    _tracker(root)
    return path


def _shard(name: str, value: torch.Tensor, rank: int, tensor: int, swiglu: bool) -> torch.Tensor:
    suffix = name.split(".", 3)[3] if name.startswith("decoder.layers.") else name
    if suffix.startswith("mlp.linear_fc1.") and "layer_norm" not in suffix and swiglu:
        gate, up = value.chunk(2, dim=0)
        return torch.cat([gate.chunk(tensor)[rank], up.chunk(tensor)[rank]]).clone()
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
                  "mlp.linear_fc1.weight", "mlp.linear_fc1.bias",
                  "embedding.word_embeddings.weight", "output_layer.weight"):
        return value.chunk(tensor, dim=0)[rank].clone()
    if suffix in ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight"):
        return value.chunk(tensor, dim=1)[rank].clone()
    return value.clone()


def _rng_state() -> list[dict]:
    return [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}]


def write_legacy(root: Path, args: argparse.Namespace, tensors: dict[str, torch.Tensor],
                 spec: str = "local") -> Path:
    """A legacy Megatron-LM checkpoint of ``tensors`` split over ``args``' T x P ranks."""
    tensor, pipeline = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    per_stage = args.num_layers // pipeline
    tied = not args.untie_embeddings_and_output_weights
    path = root / f"iter_{ITERATION:07d}"
    legacy_args = argparse.Namespace(**{**vars(args), "ckpt_format": "torch"})
    for p in range(pipeline):
        first, last = p == 0, p == pipeline - 1
        for t in range(tensor):
            model: dict[str, object] = {}
            for name, value in tensors.items():
                if name.startswith("decoder.layers."):
                    index, suffix = name[len("decoder.layers."):].split(".", 1)
                    local = int(index) - p * per_stage
                    if not 0 <= local < per_stage:
                        continue
                    if spec == "local":
                        suffix = LOCAL_NORMS.get(suffix, suffix)
                    key = f"decoder.layers.{local}.{suffix}"
                elif name.startswith("embedding.") and not first:
                    continue
                elif name.startswith(("decoder.final", "output_layer")) and not last:
                    continue
                else:
                    key = name
                model[key] = _shard(name, value, t, tensor, args.swiglu)
            if tied and last and pipeline > 1:
                model["output_layer.weight"] = _shard(
                    "output_layer.weight", tensors["embedding.word_embeddings.weight"], t, tensor,
                    args.swiglu)
            for i in range(per_stage):
                for linear in LINEARS:
                    model[f"decoder.layers.{i}.{linear}._extra_state"] = (
                        None if spec == "local" else io.BytesIO(b"te-state"))
            name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pipeline > 1 else "")
            (path / name).mkdir(parents=True)
            torch.save({"args": legacy_args, "checkpoint_version": 3.0, "iteration": ITERATION,
                        "model": model, "rng_state": _rng_state(),
                        "num_floating_point_operations_so_far": 0},
                       path / name / "model_optim_rng.pt")
    _tracker(root)
    return path


def write_checkpoint(root: Path, kind: str, fmt: str, tensor: int = 1, pipeline: int = 1,
                     spec: str = "local", seed: int = 0, **overrides
                     ) -> tuple[argparse.Namespace, dict[str, torch.Tensor]]:
    """Write a ``kind`` ("gpt" / "llama") checkpoint in ``fmt`` ("torch_dist" / "legacy") under
    ``root``; returns its args and whole-model tensors (the reference)."""
    args = megatron_args(kind, tensor=tensor, pipeline=pipeline, **overrides)
    tensors = global_tensors(args, seed)
    os.makedirs(root, exist_ok=True)
    if fmt == "torch_dist":
        write_torch_dist(Path(root), args, tensors)
    else:
        write_legacy(Path(root), args, tensors, spec)
    return args, tensors
