"""Tokens to their experts and back (Megatron-core's token dispatchers).

``dispatch`` permutes a rank's routed tokens ``[T, h]`` into rows grouped by the experts of this
rank and returns a :class:`Dispatched` record; ``combine`` brings the experts' outputs back and
adds them into ``[T, h]``, each weighted by its routing probability
(``out[t] = sum_k p[t, e_k] x expert_{e_k}(x[t])``). The record, not the dispatcher, carries the
state between the two, so several micro-batches may be in flight.

The experts are split over the expert-parallel (EP) group: rank r holds experts
``r x L .. (r + 1) x L - 1`` (``L = experts / EP``).

- ``alltoall``: each rank sends every routed token once per chosen expert to the rank holding the
  expert (one all-to-all of the per-expert counts, one of the tokens), regroups the received rows
  from (source rank, local expert) to (local expert, source rank) order, and the combine reverses
  both steps. The backward of an all-to-all is the all-to-all with the splits swapped. Every
  one of these collectives (counts, tokens, outputs, gradients) runs through
  the dispatcher's :class:`~.expert_comm.ExpertComm` (``self.comm``, handed by the pipeline):
  issued asynchronously, then waited for -- at once, or inside a paired F&B action after the
  other half has computed a piece (``pipeline/overlap.py``).
- ``allgather``: every rank gathers the tokens, probabilities and routing maps of the whole EP
  group, runs its experts on the rows routed to them, and a reduce-scatter sums the outputs back
  to the rank that owns each token (its backward is the all-gather, and the reverse).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from megatron_chimera.config import MOE_TOKEN_DISPATCHERS, ConfigError
from megatron_chimera.model.moe.expert_comm import ExpertComm
from megatron_chimera.model.moe.router import expert_capacity


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits, run through the layer's
    :class:`~.expert_comm.ExpertComm` (a paired F&B action overlaps it with the other half's
    compute); the backward is the all-to-all with the splits swapped, run the same way
    (``name`` + ``.bwd``). With a backward tape on the comm the graph is cut here instead
    (:func:`all_to_all`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup,  # noqa: D102
                output_splits: list[int], input_splits: list[int], name: str,
                comm: ExpertComm) -> torch.Tensor:
        ctx.group, ctx.splits, ctx.name, ctx.comm = group, (output_splits, input_splits), name, comm
        out = x.new_empty(sum(output_splits), *x.shape[1:])
        x = x.contiguous()
        comm.exchange(name, lambda: dist.all_to_all_single(
            out, x, output_splits, input_splits, group=group, async_op=True))
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        output_splits, input_splits = ctx.splits
        return (_AllToAll.apply(grad, ctx.group, input_splits, output_splits,
                                f"{ctx.name}.bwd", ctx.comm), None, None, None, None, None)


def _issuer(group: dist.ProcessGroup, output_splits: list[int], input_splits: list[int]):
    """``issue(x) -> (work, out)``: the async all-to-all of ``x`` with these splits."""
    def issue(x: torch.Tensor):
        out = x.new_empty(sum(output_splits), *x.shape[1:])
        return dist.all_to_all_single(out, x, output_splits, input_splits, group=group,
                                      async_op=True), out
    return issue


def all_to_all(comm: ExpertComm, x: torch.Tensor, group: dist.ProcessGroup,
               output_splits: list[int], input_splits: list[int], name: str) -> torch.Tensor:
    """The all-to-all ``name`` of ``x`` through ``comm``: an autograd op, or with a backward
    tape on ``comm`` a cut of the graph whose gradient all-to-all the tape issues."""
    tape = comm.tape
    if tape is None:
        return _AllToAll.apply(x, group, output_splits, input_splits, name, comm)
    return tape.all_to_all(x, name, comm, _issuer(group, output_splits, input_splits),
                           _issuer(group, input_splits, output_splits))


class _GatherFromGroup(torch.autograd.Function):
    """All-gather along dim 0 (equal shares); the backward reduce-scatters (sums) the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: D102
        ctx.group = group
        out = x.new_empty(x.shape[0] * dist.get_world_size(group), *x.shape[1:])
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        return _ReduceScatterToGroup.apply(grad, ctx.group), None


class _ReduceScatterToGroup(torch.autograd.Function):
    """Sum over the group and keep this rank's share of dim 0; the backward all-gathers."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: D102
        ctx.group = group
        out = x.new_empty(x.shape[0] // dist.get_world_size(group), *x.shape[1:])
        dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        return _GatherFromGroup.apply(grad, ctx.group), None


class Dispatched(NamedTuple):
    """One micro-batch between ``dispatch`` and ``combine``."""

    tokens: torch.Tensor  # [N, h] rows for this rank's experts, grouped by local expert
    counts: torch.Tensor  # [L] rows per local expert (on the tokens' device)
    token_index: torch.Tensor  # [M] source token of each locally permuted row (expert-major)
    probs: torch.Tensor  # [M] routing probability of each locally permuted row (0: padding)
    num_tokens: int  # rows of the combined output (T, or EP x T for allgather)
    send_splits: list[int]  # alltoall: rows sent to each EP rank
    recv_splits: list[int]  # alltoall: rows received from each EP rank
    recv_counts: list[list[int]]  # alltoall: [source rank][local expert] rows received
    host_counts: list[int] | None = None  # ``counts`` on the host where known without a sync


def host_ints(values: torch.Tensor) -> list[int]:
    """``values`` as Python ints: the one device-to-host synchronisation of a MoE layer's
    forward (on CUDA a non-blocking copy into pinned memory, then a wait for the stream)."""
    if values.device.type != "cuda":
        return values.tolist()
    pinned = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    pinned.copy_(values, non_blocking=True)
    torch.cuda.current_stream(values.device).synchronize()
    return pinned.tolist()


def permute(tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
            num_rows: int | None = None, rows_per_expert: int | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of ``tokens`` ``[T, h]`` once per routed expert, grouped by expert (ascending) and
    by token within an expert: (rows, source token of each row, probability of each row,
    rows per expert ``[E]``). A stable sort of the routing map, no ``nonzero``: ``num_rows``
    routed pairs in all (``T x k`` when no token is dropped; None: counted, one host sync),
    or with ``rows_per_expert`` (capacity: drop and pad) exactly that many rows per expert, the
    expert's tokens first and padding rows of probability 0 after them."""
    num_tokens, num_experts = routing_map.shape
    unrouted = (~routing_map.t()).to(torch.uint8)  # [E, T]: 0 where routed (sorted first)
    per_expert = routing_map.sum(dim=0)
    if rows_per_expert is not None:
        order = torch.sort(unrouted, dim=1, stable=True).indices[:, :rows_per_expert]
        token_index = order.reshape(-1)
        expert_index = torch.arange(num_experts, device=tokens.device).repeat_interleave(
            rows_per_expert)
        valid = (torch.arange(rows_per_expert, device=tokens.device)
                 < per_expert.unsqueeze(1)).reshape(-1)
        row_probs = probs[token_index, expert_index] * valid
        counts = torch.full_like(per_expert, rows_per_expert)
        return tokens.index_select(0, token_index), token_index, row_probs, counts
    if num_rows is None:
        num_rows = int(host_ints(per_expert.sum().reshape(1))[0])
    order = torch.sort(unrouted.reshape(-1), stable=True).indices[:num_rows]
    expert_index, token_index = order // num_tokens, order % num_tokens
    return (tokens.index_select(0, token_index), token_index,
            probs[token_index, expert_index], per_expert)


def unpermute(rows: torch.Tensor, token_index: torch.Tensor, probs: torch.Tensor,
              num_tokens: int) -> torch.Tensor:
    """``out[t] = sum of probs[i] x rows[i]`` over the rows ``i`` of token ``t``: ``[T, h]``."""
    weighted = rows * probs.to(rows.dtype).unsqueeze(-1)
    out = rows.new_zeros(num_tokens, rows.shape[-1])
    return out.index_add(0, token_index, weighted)


class TokenDispatcher:
    """Dispatches to and combines from the ``num_experts / ep_size`` experts of EP rank
    ``ep_rank`` (``group``: the expert-parallel process group; None with one EP rank).
    ``topk`` / ``capacity_factor``: the router's, so that the permutation has static shapes
    (``T x k`` rows dropless; ``capacity`` rows per expert, padded, with a capacity factor);
    without ``topk`` the routed rows are counted (one more host sync)."""

    def __init__(self, kind: str, num_experts: int, ep_size: int, ep_rank: int,
                 group: dist.ProcessGroup | None, topk: int | None = None,
                 capacity_factor: float | None = None) -> None:
        if kind not in MOE_TOKEN_DISPATCHERS:
            raise ConfigError(f"--moe-token-dispatcher-type must be one of "
                              f"{MOE_TOKEN_DISPATCHERS}, got {kind!r}")
        if num_experts % ep_size:
            raise ConfigError(f"--num-experts {num_experts} is not divisible by "
                              f"--expert-model-parallel-size {ep_size}")
        self.kind, self.num_experts = kind, num_experts
        self.ep_size, self.ep_rank, self.group = ep_size, ep_rank, group
        self.num_local = num_experts // ep_size
        self.first_local = ep_rank * self.num_local
        self.comm = ExpertComm()  # how the all-to-alls are issued (MoELayer.set_expert_comm)
        self.topk, self.capacity_factor = topk, capacity_factor

    def _shape(self, num_tokens: int) -> tuple[int | None, int | None]:
        """(routed rows, or None; padded rows per expert, or None) for ``num_tokens`` tokens
        of this rank."""
        if self.topk is None:
            return None, None
        if self.capacity_factor is None:
            return num_tokens * self.topk, None
        capacity = expert_capacity(num_tokens, self.topk, self.num_experts,
                                   self.capacity_factor)
        return None, min(capacity, num_tokens)

    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor,
                 routing_map: torch.Tensor) -> Dispatched:
        """``[T, h]`` tokens, ``[T, E]`` probabilities and routing map -> this rank's expert
        inputs."""
        if self.ep_size == 1:
            num_rows, padded = self._shape(tokens.shape[0])
            rows, index, row_probs, per_expert = permute(tokens, probs, routing_map, num_rows,
                                                         padded)
            host = None if padded is None else [padded] * self.num_experts
            return Dispatched(rows, per_expert, index, row_probs, tokens.shape[0],
                              [], [], [], host)
        if self.kind == "allgather":
            return self._dispatch_allgather(tokens, probs, routing_map)
        return self._dispatch_alltoall(tokens, probs, routing_map)

    def combine(self, expert_output: torch.Tensor, state: Dispatched) -> torch.Tensor:
        """The experts' outputs ``[N, h]`` (order of ``state.tokens``) -> ``[T, h]``."""
        if self.ep_size == 1:
            return unpermute(expert_output, state.token_index, state.probs, state.num_tokens)
        if self.kind == "allgather":
            out = unpermute(expert_output, state.token_index, state.probs, state.num_tokens)
            return _ReduceScatterToGroup.apply(out, self.group)
        rows = self._regroup(expert_output, state.recv_counts, by_expert=False)
        rows = all_to_all(self.comm, rows, self.group, state.send_splits, state.recv_splits,
                          "combine")
        return unpermute(rows, state.token_index, state.probs, state.num_tokens)

    # ------------------------------------------------------------------ alltoall
    def _dispatch_alltoall(self, tokens: torch.Tensor, probs: torch.Tensor,
                           routing_map: torch.Tensor) -> Dispatched:
        num_rows, padded = self._shape(tokens.shape[0])
        rows, index, row_probs, per_expert = permute(tokens, probs, routing_map, num_rows,
                                                     padded)
        counts = torch.empty_like(per_expert)  # [source rank][local expert]
        # a collective like the tokens': in a pair it is one more step of the baton's order
        self.comm.exchange("dispatch.counts", lambda: dist.all_to_all_single(
            counts, per_expert, group=self.group, async_op=True))
        if padded is not None:  # static shapes: every (rank, expert) chunk is `padded` rows
            sent = [[padded] * self.num_local] * self.ep_size
            recv_counts = sent
        else:  # the layer's one host sync: both count tables in one copy
            both = host_ints(torch.stack([per_expert, counts]).view(2, self.ep_size,
                                                                    self.num_local))
            sent, recv_counts = both
        send_splits = [sum(c) for c in sent]
        recv_splits = [sum(c) for c in recv_counts]
        received = all_to_all(self.comm, rows, self.group, recv_splits, send_splits, "dispatch")
        grouped = self._regroup(received, recv_counts, by_expert=True)
        per_local = [sum(c[e] for c in recv_counts) for e in range(self.num_local)]
        local_counts = counts.view(self.ep_size, self.num_local).sum(dim=0)
        if padded is not None:
            local_counts = torch.full_like(local_counts, padded * self.ep_size)
        return Dispatched(grouped, local_counts, index, row_probs, tokens.shape[0],
                          send_splits, recv_splits, recv_counts, per_local)

    def _regroup(self, rows: torch.Tensor, recv_counts: list[list[int]],
                 by_expert: bool) -> torch.Tensor:
        """Rows in (source rank, local expert) order -> (local expert, source rank) order
        (``by_expert``), or back."""
        if self.num_local == 1:
            return rows
        ranks, experts = range(self.ep_size), range(self.num_local)
        if by_expert:
            chunks = rows.split([n for c in recv_counts for n in c])
            return torch.cat([chunks[r * self.num_local + e] for e in experts for r in ranks])
        chunks = rows.split([recv_counts[r][e] for e in experts for r in ranks])
        return torch.cat([chunks[e * self.ep_size + r] for r in ranks for e in experts])

    # ------------------------------------------------------------------ allgather
    def _dispatch_allgather(self, tokens: torch.Tensor, probs: torch.Tensor,
                            routing_map: torch.Tensor) -> Dispatched:
        all_tokens = _GatherFromGroup.apply(tokens, self.group)
        all_probs = _GatherFromGroup.apply(probs, self.group)
        all_map = torch.empty(routing_map.shape[0] * self.ep_size, routing_map.shape[1],
                              dtype=torch.uint8, device=routing_map.device)
        dist.all_gather_into_tensor(all_map, routing_map.to(torch.uint8), group=self.group)
        local = slice(self.first_local, self.first_local + self.num_local)
        # the local experts' share of the routed rows is data-dependent: dropless, it is
        # counted (the layer's one host sync); with a capacity, each rank's tokens fill at most
        # `padded` rows of an expert, so EP x padded rows per expert are static
        _, padded = self._shape(tokens.shape[0])
        padded = None if padded is None else padded * self.ep_size
        local_map = all_map[:, local].bool()
        host = (host_ints(local_map.sum(dim=0)) if padded is None
                else [padded] * self.num_local)
        rows, index, row_probs, per_expert = permute(
            all_tokens, all_probs[:, local], local_map,
            sum(host) if padded is None else None, padded)
        return Dispatched(rows, per_expert, index, row_probs, all_tokens.shape[0],
                          [], [], [], host)
