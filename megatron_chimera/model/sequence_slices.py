"""Attention over the slices of one sequence that a pipeline stage runs one after another
(sequence-sliced pipelines, ``schedules/slices.py``): the stage keeps the keys and values of a
sequence's earlier slices, and each later slice attends to them plus its own.

A slice's keys and values are cached as detached leaves (:class:`SequenceCache`); the later
slices' backwards accumulate the leaves' ``.grad``. The slice's own keys and values pass through
an identity (:class:`_AddCachedGrad`) whose backward adds that accumulated gradient to what its
own attention returns. This is exact when the backward of slice ``j`` runs after the backwards
of every later slice of the sequence on that stage -- the slice-order rule the schedules keep.
With full recomputation the slice's forward runs twice: the first pass (no autograd graph)
caches the leaves, the replay in the slice's backward reuses them, their ``.grad`` included.

On the CPU (float32/float64, no document mask) a slice attends to the earlier slices' keys and
to its own square causal block with the CPU flash kernels, merged by their log-sum-exp
(:class:`_EarlierAndOwn`), so it skips the hidden half of its own block as the whole sequence's
causal kernel does; otherwise one boolean mask over the concatenated keys.
"""

from __future__ import annotations

import torch

from megatron_chimera.model.context_parallel.gathered import masked_attention
from megatron_chimera.model.loss_normalization import loss_divisor


class _AddCachedGrad(torch.autograd.Function):
    """Identity whose backward adds the gradient the later slices left on ``leaf``."""

    @staticmethod
    def forward(ctx, tensor, leaf):
        ctx.leaf = leaf
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        extra = ctx.leaf.grad
        return (grad if extra is None else grad + extra), None


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_BACKWARD = getattr(torch.ops.aten,
                              "_scaled_dot_product_flash_attention_for_cpu_backward", None)


class _EarlierAndOwn(torch.autograd.Function):
    """Causal attention of a slice's queries to the earlier slices' keys (no mask: all before
    it) and to its own (square causal), with CPU flash kernels that skip the hidden half of the
    own block instead of computing every score under a boolean mask. The two partial results
    are merged by their log-sum-exp; the backward of each block uses the merged output and
    log-sum-exp (FlashAttention's recurrence), so the gradients are those of one softmax."""

    @staticmethod
    def forward(ctx, query, earlier_key, earlier_value, key, value, scale):
        o1, l1 = _FLASH_CPU(query, earlier_key, earlier_value, 0.0, False, scale=scale)
        o2, l2 = _FLASH_CPU(query, key, value, 0.0, True, scale=scale)
        lse = torch.logaddexp(l1, l2)
        out = (o1 * torch.exp(l1 - lse)[..., None] + o2 * torch.exp(l2 - lse)[..., None])
        out = out.to(query.dtype)
        ctx.save_for_backward(query, earlier_key, earlier_value, key, value, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        query, earlier_key, earlier_value, key, value, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        dq1, dk1, dv1 = _FLASH_CPU_BACKWARD(grad, query, earlier_key, earlier_value, out, lse,
                                            0.0, False, scale=ctx.scale)
        dq2, dk2, dv2 = _FLASH_CPU_BACKWARD(grad, query, key, value, out, lse, 0.0, True,
                                            scale=ctx.scale)
        return dq1 + dq2, dk1, dv1, dk2, dv2, None


class SequenceCache:
    """Everything a stage keeps of one sequence's earlier slices: their token positions and
    document ids, and per layer the keys and values (leaves) they produced."""

    def __init__(self) -> None:
        self.positions: list[torch.Tensor] = []
        self.documents: list[torch.Tensor | None] = []
        self.keys_values: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}


class SequenceSlice:
    """What a sliced micro-batch carries besides its tokens: its sequence's ``cache`` (one object
    shared by the sequence's slices on a rank), the slice's tokens ``start`` to ``end`` in the
    sequence, the number of ``slices`` and the sequence's unmasked ``tokens`` (the loss's
    divisor)."""

    def __init__(self, cache: SequenceCache, start: int, end: int, slices: int,
                 tokens: torch.Tensor) -> None:
        self.cache, self.start, self.end = cache, start, end
        self.slices, self.tokens = slices, tokens

    def mask(self, document_ids: torch.Tensor | None, causal: bool = True) -> SliceTokens:
        """This slice's :class:`SliceTokens` (build once per stage)."""
        positions = torch.arange(self.start, self.end)
        return SliceTokens(self.cache, positions, document_ids, causal)

    def loss(self, losses: torch.Tensor, loss_mask: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss, reported)``: the slice's masked loss sum over the whole sequence's unmasked
        tokens (the slices' losses sum to the sequence's token mean), and ``slices`` times it
        (its mean over the slices is that token mean, as the monitor averages units)."""
        mask = loss_mask.reshape(-1).to(losses.dtype)
        loss = torch.sum(losses.reshape(-1) * mask) / loss_divisor(self.tokens)
        return loss, loss.detach() * self.slices


class SliceTokens:
    """The attention mask of one slice: its global ``positions`` ``[s_j]``, ``document_ids``
    ``[b, s_j]`` (``--reset-attention-mask``) or None, and its sequence's ``cache`` (the slice
    registers its tokens there when built: build it once per slice and stage)."""

    def __init__(self, cache: SequenceCache, positions: torch.Tensor,
                 document_ids: torch.Tensor | None = None, causal: bool = True) -> None:
        self.cache, self.causal = cache, causal
        self.index = len(cache.positions)
        cache.positions.append(positions.to("cpu", torch.int64))
        cache.documents.append(None if document_ids is None else document_ids)
        self._allowed: torch.Tensor | None | bool = False  # False: not built yet

    def allowed(self, device: torch.device) -> torch.Tensor | None:
        """Boolean ``[b or 1, 1, s_j, s_0 + .. + s_j]`` (None: everything), built once."""
        if self._allowed is False:
            q_pos = self.cache.positions[self.index]
            k_pos = torch.cat(self.cache.positions[:self.index + 1])
            mask = None
            if self.causal:
                mask = (k_pos[None, :] <= q_pos[:, None])[None, None].to(device)
            docs = self.cache.documents[:self.index + 1]
            if docs[-1] is not None:
                k_doc = torch.cat(docs, dim=1).to(device)
                same = (docs[-1].to(device)[:, :, None] == k_doc[:, None, :])[:, None]
                mask = same if mask is None else (mask & same)
            self._allowed = None if mask is None or bool(mask.all()) else mask
        return self._allowed

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scale: float) -> torch.Tensor:
        """Attention of this slice's queries ``[b, heads, s_j, d]`` to the keys/values
        ``[b, groups, ., d]`` of the earlier slices (cached for ``layer``) and its own; caches
        its own for the later slices."""
        cached = self.cache.keys_values.setdefault(layer, [])
        if len(cached) < self.index:
            raise RuntimeError(f"layer {layer}: slice {self.index} of a sequence after "
                               f"{len(cached)} cached slices (slices must run in order)")
        if len(cached) == self.index:  # the slice's first forward: cache its keys/values
            # (under no_grad -- the first pass of --recompute-granularity full, or evaluation
            # -- the leaves still take the later slices' gradients: the replay reads them)
            grad = not torch.is_grad_enabled()
            cached.append((key.detach().requires_grad_(key.requires_grad or grad),
                           value.detach().requires_grad_(value.requires_grad or grad)))
        # else a replay (full recomputation in this slice's backward): the leaves the later
        # slices attended to, and whose .grad their backwards (run before this one) filled
        leaves = cached[self.index]
        key, value = _AddCachedGrad.apply(key, leaves[0]), _AddCachedGrad.apply(value, leaves[1])
        earlier = cached[:self.index]
        if earlier and self._split_causal(query):
            per_group = query.shape[1] // key.shape[1]
            parts = [torch.cat([k for k, _ in earlier], dim=2),
                     torch.cat([v for _, v in earlier], dim=2), key, value]
            if per_group > 1:
                parts = [t.repeat_interleave(per_group, dim=1) for t in parts]
            return _EarlierAndOwn.apply(query.contiguous(),
                                        *[t.contiguous() for t in parts], scale)
        keys = torch.cat([k for k, _ in earlier] + [key], dim=2)
        values = torch.cat([v for _, v in earlier] + [value], dim=2)
        return masked_attention(query, keys, values, self.allowed(query.device), scale)

    def _split_causal(self, query: torch.Tensor) -> bool:
        """Whether this slice's attention is all of the earlier slices' keys plus its own
        square causal block (causal, no documents, positions following the earlier slices'),
        run by :class:`_EarlierAndOwn` on the CPU (float32 / float64 inputs)."""
        if (_FLASH_CPU is None or _FLASH_CPU_BACKWARD is None or query.device.type != "cpu"
                or not self.causal or query.dtype not in (torch.float32, torch.float64)
                or self.cache.documents[self.index] is not None):
            return False
        first = int(self.cache.positions[self.index][0])
        earlier = sum(len(p) for p in self.cache.positions[:self.index])
        ordered = torch.equal(self.cache.positions[self.index],
                              torch.arange(first, first + len(self.cache.positions[self.index])))
        return ordered and first == earlier and int(self.cache.positions[0][0]) == 0


SLICE = "sequence_slice"  # the SequenceSlice record of a sliced micro-batch


def split_into_slices(batch: dict, slices: int) -> list[dict]:
    """A collated GPT micro-batch as ``slices`` equal consecutive slices of its sequence, in
    order (sequence-sliced pipelines): each holds its share of every per-token field (``text``
    one token more, for the labels) and a :class:`SequenceSlice` sharing one cache."""
    seq = batch["text"].shape[1] - 1
    if seq % slices:
        raise ValueError(f"--seq-length {seq} is not divisible into {slices} equal slices")
    length, cache = seq // slices, SequenceCache()
    tokens = batch["loss_mask"].float().sum()
    parts = []
    for j in range(slices):
        a, b = j * length, (j + 1) * length
        part = {key: value[:, a:b] for key, value in batch.items() if key != "text"}
        part["text"] = batch["text"][:, a:b + 1]
        part[SLICE] = SequenceSlice(cache, a, b, slices, tokens)
        parts.append(part)
    return parts
