"""Causal attention restricted to each document of a packed sample (GPT ``--reset-attention-mask``).

Megatron builds a dense ``[b, 1, s, s]`` mask for this. Here the attention mask is described by the
document id of every token (:class:`DocumentMask`, built once per micro-batch and stage from the
``document_ids`` the data workers computed) and run by one of four kernels:

* ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention over the documents packed
  back to back; CUDA, fp16/bf16, no attention dropout). No mask exists anywhere.
* ``flex``: ``flex_attention`` with a document ``BlockMask`` (compiled on CUDA; torch 2.13 has no
  flex backward on the CPU, where it runs eagerly and forward-only). No dropout.
* ``loop``: ``scaled_dot_product_attention(is_causal=True)`` once per document: no mask, exact,
  any device, attention dropout supported; Python cost grows with the number of documents.
* ``mask``: the block-diagonal boolean mask through the ordinary attention path (fused SDPA or
  Megatron's unfused masked softmax): the fallback, and the reference the others are tested
  against.

``auto`` picks ``mask`` on the unfused path (``--no-masked-softmax-fusion``), ``varlen`` where
it applies, ``loop`` otherwise.
"""

from __future__ import annotations

import functools
import warnings

import torch

from megatron_chimera.config import DOCUMENT_ATTENTIONS, ConfigError
from megatron_chimera.model.fused import attention, sdpa


class DocumentMask:
    """Which document every token of a ``[b, s]`` micro-batch belongs to (documents are runs of
    equal ids, in order); ``segments`` lists ``(sample, start, end)`` of every document."""

    def __init__(self, document_ids: torch.Tensor, device: torch.device | str | None = None
                 ) -> None:
        ids = document_ids.detach().to("cpu", torch.int64)
        if ids.dim() != 2:
            raise ValueError(f"document_ids must be [b, s], got {tuple(ids.shape)}")
        b, s = ids.shape
        change = torch.ones(b, s, dtype=torch.bool)
        change[:, 1:] = ids[:, 1:] != ids[:, :-1]
        starts = [torch.nonzero(change[i]).flatten().tolist() for i in range(b)]
        self.segments: tuple[tuple[int, int, int], ...] = tuple(
            (i, start, end) for i in range(b)
            for start, end in zip(starts[i], starts[i][1:] + [s]))
        self.shape = (b, s)
        self.document_ids = document_ids.to(device) if device is not None else document_ids
        self._block_mask = None

    @property
    def max_length(self) -> int:
        """Tokens of the longest document."""
        return max(end - start for _, start, end in self.segments)

    def cu_seqlens(self, device: torch.device) -> torch.Tensor:
        """int32 offsets of every document in the flattened ``[b * s]`` tokens, plus the total."""
        s = self.shape[1]
        offsets = [i * s + start for i, start, _ in self.segments] + [self.shape[0] * s]
        return torch.tensor(offsets, dtype=torch.int32, device=device)

    def forbidden(self, device: torch.device) -> torch.Tensor:
        """Bool ``[b, 1, s, s]``, True where query and key are in different documents (the
        causal part is added by the attention call)."""
        ids = self.document_ids.to(device)
        return (ids[:, :, None] != ids[:, None, :])[:, None]

    def block_mask(self, device: torch.device):
        """flex_attention's ``BlockMask`` of causal attention within documents (built once)."""
        if self._block_mask is None:
            from torch.nn.attention.flex_attention import create_block_mask

            ids = self.document_ids.to(device)

            def same_document_causal(b, h, q_idx, kv_idx):
                return (ids[b, q_idx] == ids[b, kv_idx]) & (kv_idx <= q_idx)

            b, s = self.shape
            self._block_mask = create_block_mask(same_document_causal, b, None, s, s,
                                                 device=device)
        return self._block_mask


def choose_implementation(requested: str, query: torch.Tensor, dropout_p: float, fused: bool
                          ) -> str:
    """The kernel ``auto`` stands for (see the module docstring); others are returned as is."""
    if requested not in DOCUMENT_ATTENTIONS:
        raise ConfigError(f"--document-attention must be one of {DOCUMENT_ATTENTIONS}, "
                          f"got {requested!r}")
    if requested != "auto":
        return requested
    if not fused:
        return "mask"
    if _varlen_applies(query, dropout_p):
        return "varlen"
    return "loop"


def _varlen_applies(query: torch.Tensor, dropout_p: float) -> bool:
    return (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and dropout_p == 0.0
            and _varlen_module() is not None)


@functools.cache
def _varlen_module():
    try:
        from torch.nn.attention import varlen
    except ImportError:
        return None
    return varlen


def document_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       mask: DocumentMask, dropout_p: float, training: bool,
                       implementation: str = "auto", fused: bool = True,
                       softmax_in_fp32: bool = False, layer_scale: float = 1.0,
                       flash_only: bool = False) -> torch.Tensor:
    """Causal attention within documents on ``[b, heads, s, head_dim]`` tensors."""
    if tuple(query.shape[:1]) + tuple(query.shape[2:3]) != mask.shape:
        raise ValueError(f"document mask {mask.shape} does not match queries "
                         f"{tuple(query.shape)} ([b, heads, s, head_dim])")
    p = dropout_p if training else 0.0
    impl = choose_implementation(implementation, query, p, fused)
    if impl == "mask":
        return attention(query, key, value, mask.forbidden(query.device), True, dropout_p,
                         training, fused=fused, softmax_in_fp32=softmax_in_fp32,
                         layer_scale=layer_scale, flash_only=flash_only)
    if impl == "loop":
        return _per_document(query, key, value, mask, p, flash_only)
    if p > 0.0:
        raise ConfigError(f"--document-attention {impl} has no attention dropout: use "
                          "--attention-dropout 0, or --document-attention loop / mask")
    if impl == "varlen":
        return _varlen(query, key, value, mask)
    return _flex(query, key, value, mask)


def _per_document(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  mask: DocumentMask, p: float, flash_only: bool) -> torch.Tensor:
    """SDPA with ``is_causal`` on each document's slice; the rows are concatenated back."""
    rows: list[list[torch.Tensor]] = [[] for _ in range(mask.shape[0])]
    for i, start, end in mask.segments:
        q, k, v = (t[i:i + 1, :, start:end] for t in (query, key, value))
        rows[i].append(sdpa(q, k, v, None, p, True, flash_only))
    return torch.cat([torch.cat(row, dim=2) for row in rows], dim=0)


def _varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            mask: DocumentMask) -> torch.Tensor:
    """FlashAttention over the documents packed into ``[b * s, heads, head_dim]``."""
    varlen = _varlen_module()
    if varlen is None or not query.is_cuda or query.dtype not in (torch.float16, torch.bfloat16):
        raise ConfigError("--document-attention varlen needs CUDA, fp16 or bf16 (--fp16/--bf16) "
                          "and torch.nn.attention.varlen; use --document-attention loop")
    b, heads, s, d = query.shape

    def packed(t: torch.Tensor) -> torch.Tensor:
        return t.permute(0, 2, 1, 3).reshape(b * s, heads, d)

    cu = mask.cu_seqlens(query.device)
    length = mask.max_length
    out = varlen.varlen_attn(packed(query), packed(key), packed(value), cu, cu, length, length,
                             window_size=(-1, 0))
    return out.reshape(b, s, heads, d).permute(0, 2, 1, 3)


def _flex(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          mask: DocumentMask) -> torch.Tensor:
    """flex_attention with the document BlockMask: compiled on CUDA, eager (forward only) on CPU."""
    from torch.nn.attention.flex_attention import flex_attention

    if not query.is_cuda and torch.is_grad_enabled() and query.requires_grad:
        raise ConfigError("--document-attention flex has no backward on the CPU in this torch "
                          "version; use --document-attention loop")
    block_mask = mask.block_mask(query.device)
    if query.is_cuda:
        return _compiled_flex()(query, key, value, block_mask=block_mask)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
        return flex_attention(query, key, value, block_mask=block_mask)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)
