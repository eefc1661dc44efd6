"""Exact attention of one block of queries against one block of keys, with its log-sum-exp, and
the gradient of a block given the *final* output and log-sum-exp (FlashAttention's recurrence).

Shapes: queries ``[b, groups, g, sq, d]`` (``g`` query heads share one key/value head: grouped-
query attention), keys and values ``[b, groups, 1, sk, d]``, masks ``[b or 1, 1, sq, sk]``
(True: may attend; broadcast over heads).

Each block runs through a fused attention kernel that returns its log-sum-exp, so no score matrix
is materialised: on CPU ``aten._scaled_dot_product_flash_attention_for_cpu`` (any float dtype,
float64 included; masks as an additive bias; the ``g`` query heads against a stride-0 view of
their key/value head, no copy) and its backward, which takes the *final* output and log-sum-exp;
on CUDA ``aten._scaled_dot_product_flash_attention`` for 16-bit blocks without a mask or with the
causal (diagonal) one, and ``aten._scaled_dot_product_efficient_attention`` (which takes an
additive bias and float32) for 16-bit and float32 blocks with a document mask, each where a
one-time probe shows it runs and matches the explicit math. Elsewhere (float32 blocks without a
document mask and float64 on CUDA, a kernel whose probe failed) the explicit math below, with
scores in float32 for 16-bit inputs and in the input's precision otherwise (exact to rounding in
float64).
"""

from __future__ import annotations

import functools

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for 16-bit inputs, else ``dtype``."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _scores(query: torch.Tensor, key: torch.Tensor, allowed: torch.Tensor | bool,
            scale: float) -> torch.Tensor:
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    if not isinstance(allowed, bool):
        scores = scores.masked_fill(~allowed[:, :, None], float("-inf"))
    return scores


def block_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  allowed: torch.Tensor | bool, scale: float, causal: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``: the block's softmax-normalised output ``[b, groups, g, sq, d]`` and the
    log-sum-exp of its scores ``[b, groups, g, sq]`` (-inf on a row that may see no key).
    ``causal``: ``allowed`` is the top-left causal mask (query i sees keys 0..i)."""
    kernel = fused_kernel(query, allowed, causal)
    if kernel is not None:
        return _fused_forward(kernel, query, key, value, allowed, scale, causal)
    query, key, value = (t.to(compute_dtype(t.dtype)) for t in (query, key, value))
    scores = _scores(query, key, allowed, scale)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.clamp_min(torch.finfo(scores.dtype).min)[..., None])
    return torch.matmul(probs, value), lse


def merge(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial results over disjoint keys merged by their log-sum-exp (rows that saw no key
    in one of them keep the other's)."""
    if out is None:
        return block_out, block_lse
    new_lse = torch.logaddexp(lse, block_lse)
    finite = torch.isfinite(new_lse)
    safe = torch.where(finite, new_lse, torch.zeros_like(new_lse))
    w_old = torch.where(finite, torch.exp(lse - safe), torch.zeros_like(lse))[..., None]
    w_new = torch.where(finite, torch.exp(block_lse - safe), torch.zeros_like(lse))[..., None]
    return out * w_old + block_out * w_new, new_lse


def block_backward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   allowed: torch.Tensor | bool, scale: float, grad_out: torch.Tensor,
                   lse: torch.Tensor, delta: torch.Tensor, out: torch.Tensor | None = None,
                   causal: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of one block: ``lse`` is the final log-sum-exp of the queries' rows over
    all keys, ``out`` the final output and ``delta = rowsum(grad_out * out)``. ``dk``, ``dv`` are
    summed over the ``g`` query heads of each group (``[b, groups, 1, sk, d]``)."""
    kernel = fused_kernel(query, allowed, causal) if out is not None else None
    if kernel is not None:
        return _fused_backward(kernel, query, key, value, allowed, scale, causal, grad_out,
                               out, lse)
    query, key, value, grad_out = (t.to(compute_dtype(t.dtype))
                                   for t in (query, key, value, grad_out))
    scores = _scores(query, key, allowed, scale)
    probs = torch.exp(scores - lse.clamp_min(torch.finfo(scores.dtype).min)[..., None])
    grad_value = torch.matmul(probs.transpose(-1, -2), grad_out).sum(2, keepdim=True)
    grad_probs = torch.matmul(grad_out, value.transpose(-1, -2))
    grad_scores = probs * (grad_probs - delta[..., None])
    grad_query = torch.matmul(grad_scores, key) * scale
    grad_key = (torch.matmul(grad_scores.transpose(-1, -2), query) * scale).sum(2, keepdim=True)
    return grad_query, grad_key, grad_value


# ---------------------------------------------------------------------------- fused kernels
def fused_kernel(query: torch.Tensor, allowed: torch.Tensor | bool, causal: bool
                 ) -> str | None:
    """``"cpu"`` / ``"flash"`` / ``"efficient"``: the fused kernel that runs this block, or None
    (explicit math)."""
    if query.device.type == "cpu":
        return "cpu" if _cpu_flash_runs() else None
    if query.device.type != "cuda":
        return None
    masked = not (allowed is True or causal)
    half = query.dtype in (torch.float16, torch.bfloat16)
    if half and not masked and _cuda_flash_runs():
        return "flash"
    if masked and (half or query.dtype == torch.float32) and _cuda_efficient_runs(query.dtype):
        return "efficient"
    return None


@functools.cache
def _cpu_flash_runs() -> bool:
    """Whether this torch has the CPU flash-attention op and its backward."""
    ops = torch.ops.aten
    return all(hasattr(ops, n) for n in ("_scaled_dot_product_flash_attention_for_cpu",
                                         "_scaled_dot_product_flash_attention_for_cpu_backward"))


@functools.cache
def _cuda_flash_runs() -> bool:
    """Whether CUDA flash attention runs forward and backward here and matches the explicit
    math on a tiny causal problem (probed once)."""
    try:
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 1, 2, 16, 64, generator=gen).to("cuda", torch.bfloat16)
                   for _ in range(3))
        k, v = k[:, :, :1], v[:, :, :1]
        out, lse = _fused_forward("flash", q, k, v, True, 0.125, True)
        ref, ref_lse = block_forward(q.float(), k.float(), v.float(), _tril(16, q.device), 0.125)
        grads = _fused_backward("flash", q, k, v, True, 0.125, True, torch.ones_like(q),
                                out.to(q.dtype), lse)
        return bool((out - ref).abs().max() < 0.05 and (lse - ref_lse).abs().max() < 0.05
                    and all(torch.isfinite(g).all() for g in grads))
    except (RuntimeError, TypeError, AttributeError, NotImplementedError):
        return False


@functools.cache
def _cuda_efficient_runs(dtype: torch.dtype) -> bool:
    """Whether CUDA memory-efficient attention runs forward and backward here with a document
    mask (a row that sees no key included) and matches the explicit math (probed once per
    dtype)."""
    try:
        gen = torch.Generator().manual_seed(0)
        q, k, v, grad = (torch.randn(1, 1, 2, 24, 64, generator=gen).to("cuda", dtype)
                         for _ in range(4))
        k, v = k[:, :, :1], v[:, :, :1]
        doc = torch.arange(24, device="cuda") // 10
        allowed = (doc[:, None] == doc[None, :])[None, None]
        allowed[..., 3, :] = False  # a row that sees nothing
        out, lse = _fused_forward("efficient", q, k, v, allowed, 0.125, False)
        ref, ref_lse = block_forward(q.float(), k.float(), v.float(), allowed, 0.125)
        delta = (grad.float() * ref).sum(-1)
        got = _fused_backward("efficient", q, k, v, allowed, 0.125, False, grad, out, lse)
        want = block_backward(q.float(), k.float(), v.float(), allowed, 0.125, grad.float(),
                              ref_lse, delta)
        tol = 1e-3 if dtype == torch.float32 else 0.05
        same_lse = torch.isclose(lse, ref_lse, atol=tol, rtol=0) | (lse == ref_lse)
        return bool((out - ref).abs().max() < tol and same_lse.all()
                    and all((a - b).abs().max() < tol * max(1.0, float(b.abs().max()))
                            for a, b in zip(got, want, strict=True)))
    except (RuntimeError, TypeError, AttributeError, NotImplementedError):
        return False


def _tril(n: int, device: torch.device) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()[None, None]


def _kernel_layout(kernel: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[b x groups, g, s, d]`` views: each group's ``g`` query heads against its key/value head
    expanded with stride 0 (copied only for the CUDA kernel, which wants real heads)."""
    g = query.shape[2]
    key, value = (t.expand(-1, -1, g, -1, -1).flatten(0, 1) for t in (key, value))
    if kernel != "cpu":
        key, value = key.contiguous(), value.contiguous()
    return query.flatten(0, 1), key, value


def _bias(allowed: torch.Tensor | bool, causal: bool, groups: int, dtype: torch.dtype,
          heads: int = 1) -> torch.Tensor | None:
    """The mask as the additive bias ``[b x groups or 1, 1, sq, sk]`` the CPU kernel takes
    (a large finite negative where hidden: a row hidden entirely stays finite, fixed after);
    ``heads`` > 1 (CUDA's memory-efficient kernel): stored with its rows padded to a multiple
    of 16 elements, as that kernel needs, and expanded over the ``heads`` (no copy)."""
    if causal or allowed is True:
        return None
    if allowed.shape[0] > 1:
        allowed = allowed.repeat_interleave(groups, dim=0)
    sk = allowed.shape[-1]
    width = sk if heads == 1 else -(-sk // 16) * 16
    bias = torch.zeros((*allowed.shape[:-1], width), dtype=dtype, device=allowed.device)
    bias = bias[..., :sk].masked_fill_(~allowed, torch.finfo(dtype).min)
    return bias if heads == 1 else bias.expand(-1, heads, -1, -1)


def _fused_forward(kernel: str, query, key, value, allowed, scale: float, causal: bool
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    b, groups, g, sq, d = query.shape
    q, k, v = _kernel_layout(kernel, query, key, value)
    if kernel == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=_bias(allowed, causal, groups, q.dtype),
            scale=scale)
    elif kernel == "efficient":
        bias = _bias(allowed, causal, groups, q.dtype, g).expand(q.shape[0], -1, -1, -1)
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, 0.0, causal, scale=scale)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)[:2]
    out = out.reshape(b, groups, g, sq, d).to(compute_dtype(query.dtype))
    lse = lse[..., :sq].reshape(b, groups, g, sq).to(compute_dtype(query.dtype))
    if not (causal or isinstance(allowed, bool)):  # rows that may see no key of this block
        sees = allowed.any(-1)[:, :, None]  # [b or 1, 1, 1, sq]
        lse = lse.masked_fill(~sees, float("-inf"))
        out = out.masked_fill(~sees[..., None], 0.0)
    return out, lse


def _fused_backward(kernel: str, query, key, value, allowed, scale: float, causal: bool,
                    grad_out, out, lse) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, groups, g, sq, d = query.shape
    q, k, v = _kernel_layout(kernel, query, key, value)
    dtype = query.dtype
    grad_out = grad_out.to(dtype).flatten(0, 1)
    out = out.to(dtype).flatten(0, 1)
    # a row that sees no key at all: +inf makes its probabilities exp(s - inf) = 0
    lse = torch.where(torch.isfinite(lse), lse, float("inf")).flatten(0, 1)
    if kernel == "cpu":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse.to(torch.float32 if dtype != torch.float64 else dtype),
            0.0, causal, attn_mask=_bias(allowed, causal, groups, dtype), scale=scale)
    elif kernel == "efficient":
        bias = _bias(allowed, causal, groups, dtype, g).expand(q.shape[0], -1, -1, -1)
        # its log-sum-exp rows padded to a multiple of 32, as its forward returns them
        padded = torch.nn.functional.pad(lse.float(), (0, -sq % 32)).contiguous()
        seed = torch.empty((), dtype=torch.int64)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            grad_out.contiguous(), q.contiguous(), k, v, bias, out.contiguous(), padded, seed,
            seed, 0.0, [True, True, True, False], causal, scale=scale)
    else:
        empty = torch.empty(0, device=q.device)
        lse = lse.float().contiguous()
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out.contiguous(), q.contiguous(), k, v, out.contiguous(), lse, empty, empty,
            sq, k.shape[2], 0.0, causal, empty, empty, scale=scale)
    compute = compute_dtype(dtype)
    dq = dq.reshape(b, groups, g, sq, d).to(compute)
    dk = dk.reshape(b, groups, g, -1, d).to(compute).sum(2, keepdim=True)
    dv = dv.reshape(b, groups, g, -1, d).to(compute).sum(2, keepdim=True)
    return dq, dk, dv
