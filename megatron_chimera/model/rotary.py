"""Rotary position embeddings (RoPE) as Megatron-LM and transformers compute them.

The rotate-half convention: the first ``rot = head_dim x --rotary-percent`` channels of each query
and key head are rotated as ``x cos + rotate_half(x) sin``, with ``rotate_half([a, b]) = [-b, a]``
and the angle of position ``p`` and channel ``i < rot/2`` equal to ``p / base^(2i/rot)`` (the
same angle for ``i`` and ``i + rot/2``); the other channels pass through. ``--use-rope-scaling``
rescales the inverse frequencies as Llama 3.1 does (factor, low/high-frequency factors 1 and 4,
original context 8192). The fp32 cos/sin tables are computed once per device and grown only when
a longer sequence arrives: a micro-batch costs a slice, or one gather with per-sample positions
(``--reset-position-ids``), and no host work.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from megatron_chimera.config import ModelConfig
from megatron_chimera.model.fused import compiled_elementwise, compiler_errors, compiler_failed

# Llama 3.1's frequency scaling constants (its config.json's rope_scaling, besides the factor).
LLAMA3_LOW_FREQ_FACTOR = 1.0
LLAMA3_HIGH_FREQ_FACTOR = 4.0
LLAMA3_ORIGINAL_MAX_POSITIONS = 8192


class RotaryTables(NamedTuple):
    """cos and sin of the rotation angles (computed in fp32), ``[s, rot]`` (shared by the batch)
    or ``[b, 1, s, rot]`` (per-sample positions); they broadcast against
    ``[b, heads, s, head_dim]``. ``signed_sin`` is ``sin`` with its first half negated, so that
    ``rotate_half(x) * sin == roll(x, rot/2) * signed_sin`` (one kernel instead of a negation
    and a concatenation)."""

    cos: torch.Tensor
    sin: torch.Tensor
    signed_sin: torch.Tensor


def rotary_dim(config: ModelConfig) -> int:
    """Channels of each head that RoPE rotates (Megatron: kv channels x rotary percent)."""
    return int(config.head_dim * config.rotary_percent)


def llama3_scaled(inv_freq: torch.Tensor, factor: float,
                  low_freq_factor: float = LLAMA3_LOW_FREQ_FACTOR,
                  high_freq_factor: float = LLAMA3_HIGH_FREQ_FACTOR,
                  original_max_positions: int = LLAMA3_ORIGINAL_MAX_POSITIONS) -> torch.Tensor:
    """Llama 3.1's inverse frequencies: wavelengths longer than ``original / low_freq_factor``
    are divided by ``factor``, shorter than ``original / high_freq_factor`` kept, and the band
    between interpolated linearly in ``original / wavelength``."""
    wavelength = 2 * math.pi / inv_freq
    low_wavelength = original_max_positions / low_freq_factor
    high_wavelength = original_max_positions / high_freq_factor
    smooth = ((original_max_positions / wavelength - low_freq_factor)
              / (high_freq_factor - low_freq_factor))
    between = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelength > low_wavelength, inv_freq / factor, inv_freq)
    in_band = (wavelength >= high_wavelength) & (wavelength <= low_wavelength)
    return torch.where(in_band, between, scaled)


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """``1 / base^(2i/rot)`` for ``i < rot/2`` (fp32), Llama-3-scaled with --use-rope-scaling."""
    dim = rotary_dim(config)
    inv_freq = 1.0 / (config.rotary_base
                      ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if config.use_rope_scaling:
        inv_freq = llama3_scaled(inv_freq, config.rope_scaling_factor)
    return inv_freq


class RotaryEmbedding:
    """The cos/sin tables of one model configuration, cached per device (no parameters, nothing
    in the state dict)."""

    def __init__(self, config: ModelConfig) -> None:
        self.inv_freq = inverse_frequencies(config)
        self.max_positions = max(config.max_positions, config.seq_length)
        self._tables: dict[torch.device, RotaryTables] = {}

    def _table(self, length: int, device: torch.device) -> RotaryTables:
        table = self._tables.get(device)
        if table is None or table.cos.shape[0] < length:
            positions = torch.arange(length, dtype=torch.float32)
            angles = torch.outer(positions, self.inv_freq)
            angles = torch.cat((angles, angles), dim=-1)
            sin = angles.sin()
            signed = torch.cat((-sin[:, :sin.shape[-1] // 2], sin[:, sin.shape[-1] // 2:]), -1)
            table = RotaryTables(angles.cos().to(device), sin.to(device), signed.to(device))
            self._tables[device] = table
        return table

    def tables(self, seq_length: int, position_ids: torch.Tensor | None,
               device: torch.device, dtype: torch.dtype = torch.float32) -> RotaryTables:
        """The tables for positions ``0..seq_length-1``, or for ``position_ids`` ``[b, s]``, in
        ``dtype`` (the activations': cast once per micro-batch, not per layer)."""
        if position_ids is None:
            table = self._table(seq_length, device)
            return RotaryTables(*(t[:seq_length].to(dtype) for t in table))
        # gathered from a table of every position the model takes (no host sync on the ids):
        # training positions stay below the sequence length, generation's below
        # --max-position-embeddings
        table = self._table(max(seq_length, self.max_positions), device)
        return RotaryTables(*(t[position_ids].unsqueeze(1).to(dtype) for t in table))


def apply_rotary_pos_emb(x: torch.Tensor, tables: RotaryTables) -> torch.Tensor:
    """Rotate the first ``rot`` channels of ``x`` ``[b, heads, s, head_dim]`` (rotate-half
    convention); cos/sin are cast to ``x``'s dtype, as Megatron and transformers do
    (:func:`_rotate`)."""
    return _rotate(x, tables.cos.to(x.dtype), tables.signed_sin.to(x.dtype))


def rotate_sequence_first(x: torch.Tensor, tables: RotaryTables, fused: bool = False
                          ) -> torch.Tensor:
    """:func:`apply_rotary_pos_emb` for ``x`` laid out ``[s, b, ...heads..., head_dim]`` (any
    number of head dimensions: a layer's queries and keys, grouped, in one call), in the layout
    of the layer's QKV buffer -- the output stays sequence-first, so the attention output it
    leads to is too, and going back to ``[s, b, h]`` after attention is a view. ``fused`` (the
    layers pass it on CUDA with ``--bias-dropout-fusion``): the rotation is one
    ``torch.compile``d kernel forward and one backward where the compiler runs
    (:func:`~.fused.compiled_elementwise`), else the eager kernels of :func:`_rotate`."""
    heads = x.dim() - 3

    def laid_out(table: torch.Tensor) -> torch.Tensor:
        if table.dim() == 2:  # [s, rot]
            return table.view(table.shape[0], *([1] * (heads + 1)), table.shape[-1])
        # per-sample [b, 1, s, rot] -> [s, b, 1.., rot]
        return table[:, 0].transpose(0, 1).reshape(table.shape[2], table.shape[0],
                                                   *([1] * heads), table.shape[-1])

    cos, signed_sin = laid_out(tables.cos.to(x.dtype)), laid_out(tables.signed_sin.to(x.dtype))
    kernel = compiled_elementwise(_rotate, x.device, x.dtype) if fused else None
    if kernel is not None:
        try:
            return kernel(x, cos, signed_sin)
        except compiler_errors() as exc:  # a recompile (new shape) the compiler failed
            compiler_failed(exc)
    return _rotate(x, cos, signed_sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x cos + rotate_half(x) sin`` on the first ``rot`` channels in three kernels, each one
    pass over ``x``: ``roll`` (the halves swapped), ``x * cos``, and ``addcmul`` adding
    ``roll(x) * signed_sin`` -- where the unfused composition runs a negation, a concatenation,
    two products and a sum. The same values: ``rotate_half``'s negation is folded into the table
    (exact), and the sum rounds once instead of after each product too."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return torch.addcmul(x * cos, x.roll(rot // 2, -1), signed_sin)
    x_rot = x[..., :rot]
    out = torch.addcmul(x_rot * cos, x_rot.roll(rot // 2, -1), signed_sin)
    return torch.cat((out, x[..., rot:]), dim=-1)
