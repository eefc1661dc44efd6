"""Deterministic, layout-independent parameter initialisation (Megatron's init methods).

Every parameter group is drawn from its own ``torch.Generator`` seeded from ``(seed, key)``, where
``key`` is stable across pipeline layouts: ``"layer.<global index>"`` for transformer layers and a
fixed name for embeddings, pooler and heads. A stage slice built alone therefore holds exactly the
weights of the same layers of the whole model, and every copy of the tied word embedding is equal.
A tensor-parallel shard draws the whole (master) tensor and keeps its slice (Megatron's
``_initialize_affine_weight_cpu``), so the full weights do not depend on T either.
"""

from __future__ import annotations

import hashlib
import math

import torch

from megatron_chimera.tensor_parallel.utils import master_shape, shard_of_master

WORD_EMBEDDINGS_KEY = "word_embeddings"
POSITION_EMBEDDINGS_KEY = "position_embeddings"
TOKENTYPE_EMBEDDINGS_KEY = "tokentype_embeddings"
OUTPUT_LAYER_KEY = "output_layer"
POOLER_KEY = "pooler"
LM_HEAD_KEY = "lm_head"
BINARY_HEAD_KEY = "binary_head"


def layer_key(global_layer_index: int) -> str:
    """Init key of the transformer layer with 0-based global index ``global_layer_index``."""
    return f"layer.{global_layer_index}"


def make_generator(seed: int, key: str) -> torch.Generator:
    """CPU generator seeded by a stable 63-bit hash of ``(seed, key)`` (not Python's ``hash``)."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return generator


@torch.no_grad()
def init_normal_(param: torch.Tensor, std: float, generator: torch.Generator) -> None:
    """Fill ``param`` with ``normal(0, std)`` drawn in fp32 on the CPU (so every dtype and device
    sees the same numbers), then cast and copy; a tensor-parallel shard draws its master tensor
    and keeps its slice. A ``meta`` tensor (a model built for its shapes only) is left as is."""
    if param.is_meta:
        return
    values = torch.empty(master_shape(param), dtype=torch.float32, device="cpu").normal_(
        0.0, std, generator=generator)
    param.copy_(shard_of_master(param, values).to(device=param.device, dtype=param.dtype))


def scaled_init_std(std: float, num_layers: int) -> float:
    """Megatron's std for output layers (attention ``dense``, ``dense_4h_to_h``): std/sqrt(2L)."""
    return std / math.sqrt(2.0 * num_layers)


@torch.no_grad()
def init_linear_(linear: torch.nn.Module, std: float, generator: torch.Generator) -> None:
    """Normal(0, std) weight, zero bias."""
    init_normal_(linear.weight, std, generator)
    if getattr(linear, "bias", None) is not None:
        linear.bias.zero_()
