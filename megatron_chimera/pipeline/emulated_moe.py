"""Emulated MoE stages for the paired runtime's benchmark and tests (issue 41).

:class:`EmulatedMoEStage` has ``layers`` MoE layers, each attention (compute), dispatch
all-to-all, experts (compute), combine all-to-all; an F's time and its all-to-all time are cut
into 2 x layers equal pieces, a B runs the reverse. Compute pieces do tiny real work and sleep;
an all-to-all (:class:`EmulatedAllToAll`) is a real gloo ``all_to_all_single`` of one int64 per
EP peer (the label check that proves every EP rank issued the same all-to-all) whose duration is
emulated. The dense emulated stages and the shared clocks are in
:mod:`megatron_chimera.pipeline.emulated`; docs/CHIMERA_EP.md, "What is emulated".
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from megatron_chimera.model.linear import Linear
from megatron_chimera.model.moe.expert_comm import ExpertComm
from megatron_chimera.pipeline.emulated import EmulatedCosts, sleep_until_yielding


class _EmulatedAllToAllWork:
    """An issued emulated all-to-all: the real exchange of label codes, then the emulated
    link's time."""

    def __init__(self, work: dist.Work | None, received: torch.Tensor | None, code: int,
                 label: str, done_at: float) -> None:
        self.work, self.received, self.code = work, received, code
        self.label, self.done_at = label, done_at

    def wait(self) -> bool:
        """Wait for the exchange (checking that every peer issued the same all-to-all), then
        until the emulated transfer is through."""
        if self.work is not None:
            self.work.wait()
            if bool((self.received != self.code).any()):
                raise RuntimeError(
                    f"expert-parallel all-to-all issued in different orders: this rank's "
                    f"{self.label} met another all-to-all of a peer (codes "
                    f"{self.received.tolist()}, expected {self.code})")
        sleep_until_yielding(self.done_at)
        return True


#: a piece of an emulated MoE action (compute or all-to-all) that the host reaches at most this
#: late after its ideal start (the end of the rank's previous compute piece, or of the half's
#: own all-to-all or compute piece before it) starts at the ideal time, as on a device whose
#: queue the host keeps ahead of: the host's per-piece work (autograd, the baton's thread
#: hand-over) is absorbed, not added; a later start (a wait for a message) is real
ABSORB_S = 0.0003


class EmulatedAllToAll:
    """The dispatch/combine all-to-all of emulated MoE layers on one rank, and the rank's
    emulated device clock (:meth:`piece_start`).

    What is real: an ``all_to_all_single`` on the expert-parallel ``group`` (gloo, async) that
    carries one int64 per peer: the CRC of the all-to-all's label (compute action, layer,
    dispatch/combine, direction), checked on receipt -- a rank whose peer issued a different
    all-to-all at the same position raises, so a run proves the issue order is one on every EP
    rank. What is emulated: its duration -- the transfer ends ``seconds`` after it starts, and it
    starts when issued or when this rank's previous all-to-all is through (one link per rank, as
    the simulator's pair cost ``max(C_F + C_B, A_F + A_B)`` assumes). The wait is real time
    spent off the compute path: inside a pair the other half computes meanwhile. ``issued``
    (a list, when set) records every label in issue order."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.issued: list[str] | None = None
        self._link_free_at = 0.0
        self.compute_free_at = 0.0  # ideal end of the rank's last compute piece
        self.comm = ExpertComm()  # how the all-to-alls are issued (set_expert_comm)
        self._ready: dict = {}  # per action: the ideal end of its half's last piece

    def _half_ready_at(self) -> float:
        """Ideal end of the calling half's previous piece (-inf at a new action)."""
        return self._ready.get(self.action(), float("-inf"))

    def action(self):
        """The compute action running now (the paired runtime's, None outside one)."""
        return getattr(self.comm, "action", None)

    def piece_start(self, seconds: float) -> float:
        """A compute piece of ``seconds`` starts now: its deadline (see :data:`ABSORB_S`)."""
        now = time.perf_counter()
        ideal = max(self.compute_free_at, self._half_ready_at())
        start = ideal if now - ideal <= ABSORB_S else now
        self.compute_free_at = self._ready[self.action()] = start + seconds
        return start + seconds

    def __call__(self, name: str, seconds: float) -> None:
        """Run the all-to-all ``name`` of the current action, taking ``seconds``."""
        self.comm.exchange(name, lambda: self._issue(self._label(name), seconds))

    def _label(self, name: str) -> str:
        action = self.action()
        return f"{action.short() if action is not None else '-'}:{name}"

    def cut(self, x: torch.Tensor, name: str, seconds: float) -> torch.Tensor:
        """The all-to-all ``name`` as a cut of the running forward's backward tape."""
        def forward(t):
            return self._issue(self._label(f"{name}.fwd"), seconds), t

        def backward(g):
            return self._issue(self._label(f"{name}.bwd"), seconds), g

        return self.comm.tape.all_to_all(x, name, self.comm, forward, backward)

    def _issue(self, label: str, seconds: float) -> _EmulatedAllToAllWork:
        if self.issued is not None:
            self.issued.append(label)
        now = time.perf_counter()
        ready = self._half_ready_at()
        start = max(ready if now - ready <= ABSORB_S else now, self._link_free_at)
        self._link_free_at = self._ready[self.action()] = start + seconds
        code = zlib.crc32(label.encode())
        work = received = None
        if self.size > 1:
            sent = torch.full((self.size,), code, dtype=torch.int64)
            received = torch.empty_like(sent)
            work = dist.all_to_all_single(received, sent, group=self.group, async_op=True)
        return _EmulatedAllToAllWork(work, received, code, label, self._link_free_at)


class _AllToAllPoint(torch.autograd.Function):
    """Identity whose forward and backward each run one emulated all-to-all (the backward's:
    the gradient of the forward's, same volume and time)."""

    @staticmethod
    def forward(ctx, x, exchange: EmulatedAllToAll, name: str,  # type: ignore[override]
                seconds: float):
        ctx.exchange, ctx.name, ctx.seconds = exchange, name, seconds
        exchange(f"{name}.fwd", seconds)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.exchange(f"{ctx.name}.bwd", ctx.seconds)
        return grad, None, None, None


class _PieceDeadline:
    """The deadline of one backward compute piece, shared by its two ends (a mutable holder
    made per forward, so the halves of a pair, even of one stage, never share one)."""

    __slots__ = ("at",)

    def __init__(self) -> None:
        self.at = 0.0


class _BackwardPieceStarts(torch.autograd.Function):
    """Identity whose backward starts one compute piece of ``seconds()`` of an emulated backward
    (its start and deadline from the rank's clock ``exchange``); it sits *after* the piece's
    real work in the forward graph, so in the backward that work (the layer's backward, its
    gradient accumulation) runs inside the piece's time, before :class:`_BackwardPieceEnds`
    waits for the deadline -- as the forward's pieces do their work before their wait."""

    @staticmethod
    def forward(ctx, x, seconds: Callable[[], float],  # type: ignore[override]
                exchange: EmulatedAllToAll, deadline: _PieceDeadline):
        ctx.seconds, ctx.exchange, ctx.deadline = seconds, exchange, deadline
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.deadline.at = ctx.exchange.piece_start(ctx.seconds())
        return grad, None, None, None


class _BackwardPieceEnds(torch.autograd.Function):
    """Identity whose backward waits until the deadline its :class:`_BackwardPieceStarts` set
    (it sits before the piece's real work in the forward graph)."""

    @staticmethod
    def forward(ctx, x, deadline: _PieceDeadline):  # type: ignore[override]
        ctx.deadline = deadline
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        sleep_until_yielding(ctx.deadline.at)
        return grad, None


class EmulatedMoEStage(nn.Module):
    """A pipeline stage of ``layers`` emulated MoE layers for our executor (``[s, b, h]`` in and
    out, the loss ``[b, s]`` last), each: attention (compute), dispatch all-to-all, experts
    (compute), combine all-to-all. A forward's ``costs.forward_s`` is cut into 2 x ``layers``
    equal compute pieces, its all-to-all time ``all_to_all_s`` (per direction: all dispatches
    and combines of the stage) into 2 x ``layers`` equal all-to-alls; a backward runs the
    reverse (combine's gradient all-to-all, experts, dispatch's gradient all-to-all, attention)
    with its time (B's, when the weight gradients are deferred) cut alike. Each compute piece
    does tiny real work (a :class:`Linear`; W's share goes to :class:`SleepingWeightGradStore`)
    then waits until the piece's time is over; all state of a running action lives in its
    autograd graph and locals, so the two halves of a pair (even of one stage) interleave."""

    def __init__(self, costs: EmulatedCosts, all_to_all_s: float, exchange: EmulatedAllToAll,
                 pre_process: bool, post_process: bool, hidden: int = 4, seed: int = 0,
                 layers: int = 1) -> None:
        super().__init__()
        if layers < 1:
            raise ValueError(f"an emulated stage needs at least one layer, got {layers}")
        if all_to_all_s < 0:
            raise ValueError("the emulated all-to-all time must be >= 0")
        self.costs, self.exchange = costs, exchange
        self.pre_process, self.post_process = pre_process, post_process
        self.num_layers = layers
        self.pieces = 2 * layers
        self.all_to_all_s = all_to_all_s
        self.linears = nn.ModuleList(Linear(hidden, hidden) for _ in range(self.pieces))
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for linear in self.linears:
                linear.weight.copy_(torch.randn(hidden, hidden, generator=g) * hidden**-0.5)
                linear.bias.zero_()
                linear.weight.emulated_weight_seconds = costs.weight_s / self.pieces
        self.input_tensor: torch.Tensor | None = None

    def set_expert_comm(self, comm: ExpertComm) -> None:
        """Issue the all-to-alls through ``comm`` (the pipeline's paired runtime)."""
        self.exchange.comm = comm

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """Input activations of a non-first stage."""
        self.input_tensor = tensor

    def backward_compute_s(self) -> float:
        """The compute time of a backward run now: B's when the weight gradients are deferred,
        else the whole backward's."""
        deferred = self.linears[0].weight_grad_store is not None
        return self.costs.input_grad_s if deferred else self.costs.backward_s

    def _backward_piece_s(self) -> float:
        return self.backward_compute_s() / self.pieces

    def forward(self, batch: torch.Tensor | None) -> torch.Tensor:
        """The emulated MoE layers (the loss per token at the last stage)."""
        hidden = batch if self.pre_process else self.input_tensor
        if torch.is_grad_enabled() and not hidden.requires_grad:
            # the first stage's batch: a leaf that takes a gradient, so that the backward's last
            # piece (_BackwardPieceEnds on the input) is in the graph
            hidden = hidden.detach().requires_grad_()
        piece_s = self.costs.forward_s / self.pieces
        a2a_s = self.all_to_all_s / self.pieces
        communicate = a2a_s > 0 or self.exchange.size > 1
        for i, linear in enumerate(self.linears):
            deadline = self.exchange.piece_start(piece_s)
            backward_deadline = _PieceDeadline()
            hidden = linear(_BackwardPieceEnds.apply(hidden, backward_deadline))
            if self.post_process and i == self.pieces - 1:
                hidden = hidden.pow(2).mean(dim=-1).t()
            hidden = _BackwardPieceStarts.apply(hidden, self._backward_piece_s, self.exchange,
                                                backward_deadline)
            sleep_until_yielding(deadline)
            if communicate:
                name = f"{'dispatch' if i % 2 == 0 else 'combine'}{i // 2}"
                if self.exchange.comm.tape is not None:
                    hidden = self.exchange.cut(hidden, name, a2a_s)
                else:
                    hidden = _AllToAllPoint.apply(hidden, self.exchange, name, a2a_s)
        return hidden


def emulated_moe_forward_step(batch: torch.Tensor | None, model: EmulatedMoEStage):
    """``forward_step_func`` for :class:`EmulatedMoEStage` (loss = mean of the last stage's
    output)."""
    output = model(batch)

    def loss_func(per_token: torch.Tensor):
        loss = per_token.mean()
        return loss, {"loss": loss.detach()}

    return output, loss_func
