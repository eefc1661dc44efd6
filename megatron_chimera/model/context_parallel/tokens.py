"""What attention may see across context-parallel ranks: every rank's token positions and
document ids, gathered once per micro-batch (:class:`ContextTokens`).

Query token ``i`` may attend to key token ``j`` when (causal) ``position_j <= position_i`` and
(with ``--reset-attention-mask``) both lie in the same document. Positions are global indices in
the whole sequence, so the rule holds whatever split of the tokens the ranks hold (zigzag by
default, see :mod:`.zigzag`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class ContextTokens:
    """Positions ``[CP, s/CP]`` and document ids ``[CP, b, s/CP]`` (or None) of every rank of a
    context-parallel group, ``rank`` this rank's index in it, ``causal`` the attention kind.

    Both are kept on the host, where the masks are decided (which block pairs are empty, full or
    masked) once per micro-batch and cached; the masks live on ``device`` (the activations')."""

    def __init__(self, positions: torch.Tensor, document_ids: torch.Tensor | None, rank: int,
                 causal: bool, device: torch.device | str | None = None) -> None:
        self.positions = positions.to("cpu", torch.int64)
        self.document_ids = None if document_ids is None else document_ids.to("cpu")
        self.rank = rank
        self.causal = causal
        self.size = positions.shape[0]
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self._masks: dict[object, torch.Tensor | bool | None] = {}

    @classmethod
    def gather(cls, group: dist.ProcessGroup | None, positions: torch.Tensor,
               document_ids: torch.Tensor | None, causal: bool,
               device: torch.device | str | None = None) -> ContextTokens:
        """All-gather this rank's ``positions`` ``[s/CP]`` and ``document_ids`` ``[b, s/CP]``
        over ``group`` (None: one rank, nothing to gather) on ``device`` (default: the document
        ids', else the positions'), the device of the masks."""
        if device is None:
            device = positions.device if document_ids is None else document_ids.device
        if group is None or dist.get_world_size(group) == 1:
            docs = None if document_ids is None else document_ids[None]
            return cls(positions[None], docs, 0, causal, device)
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        local = positions.to(device, torch.int64)
        if document_ids is not None:  # one message: positions then document ids
            local = torch.cat([local, document_ids.to(device, torch.int64).flatten()])
        gathered = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(gathered, local, group=group)
        s = positions.numel()
        all_positions = torch.stack([g[:s] for g in gathered])
        docs = None
        if document_ids is not None:
            docs = torch.stack([g[s:].view(document_ids.shape) for g in gathered])
        return cls(all_positions, docs, rank, causal, device)

    def allowed(self, query_rank: int, key_rank: int, query_rows: slice = slice(None),
                key_rows: slice = slice(None)) -> torch.Tensor | bool:
        """Boolean ``[b or 1, 1, sq, sk]`` (True: may attend) of ``query_rank``'s tokens
        ``query_rows`` against ``key_rank``'s tokens ``key_rows``; ``True`` when everything is
        allowed, ``False`` when nothing is (so the caller can skip or drop the mask). Decided on
        the host once per block pair, cached, the mask on :attr:`device`."""
        key = (query_rank, key_rank, query_rows.start, query_rows.stop, key_rows.start,
               key_rows.stop)
        if key not in self._masks:
            mask = self._decide(query_rank, key_rank, query_rows, key_rows)
            self._masks[key] = mask if isinstance(mask, bool) else mask.to(self.device)
        return self._masks[key]

    def _decide(self, query_rank: int, key_rank: int, query_rows: slice, key_rows: slice
                ) -> torch.Tensor | bool:
        q_pos = self.positions[query_rank, query_rows]
        k_pos = self.positions[key_rank, key_rows]
        mask = None
        if self.causal:
            first_q, last_q = int(q_pos.min()), int(q_pos.max())
            first_k, last_k = int(k_pos.min()), int(k_pos.max())
            if first_k > last_q:
                return False
            if last_k > first_q:  # some key after some query: a real mask
                mask = (k_pos[None, :] <= q_pos[:, None])[None, None]
        if self.document_ids is not None:
            q_doc = self.document_ids[query_rank][:, query_rows]
            k_doc = self.document_ids[key_rank][:, key_rows]
            same = (q_doc[:, :, None] == k_doc[:, None, :])[:, None]
            mask = same if mask is None else (mask & same)
        if mask is None:
            return True
        if not bool(mask.any()):
            return False
        if bool(mask.all()):
            return True
        return mask

    def gathered_allowed(self) -> torch.Tensor | None:
        """Boolean ``[b or 1, 1, s/CP, s]``: this rank's queries against every rank's keys in
        rank order (as an all-gather lays them out); None when everything is allowed (cached)."""
        if "gathered" not in self._masks:
            parts = []
            for key_rank in range(self.size):
                a = self.allowed(self.rank, key_rank)
                if isinstance(a, bool):
                    b = 1 if self.document_ids is None else self.document_ids.shape[1]
                    sq, sk = self.positions.shape[1], self.positions.shape[1]
                    a = torch.full((b, 1, sq, sk), a, dtype=torch.bool, device=self.device)
                parts.append(a)
            batch = max(p.shape[0] for p in parts)
            mask = torch.cat([p.expand(batch, -1, -1, -1) for p in parts], dim=-1)
            self._masks["gathered"] = None if bool(mask.all()) else mask
        return self._masks["gathered"]

    def natural_order(self) -> torch.Tensor:
        """Indices that sort the rank-ordered concatenation of every rank's tokens into the
        sequence's order (positions are a permutation of ``0..s-1``)."""
        return torch.argsort(self.positions.flatten())

    def natural_document_ids(self) -> torch.Tensor | None:
        """The whole sequence's document ids ``[b, s]`` in natural order (None without)."""
        if self.document_ids is None:
            return None
        b = self.document_ids.shape[1]
        flat = self.document_ids.permute(1, 0, 2).reshape(b, -1)
        return flat[:, self.natural_order()].to(self.device)
