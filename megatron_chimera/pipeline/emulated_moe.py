"""Emulated MoE stages for the paired runtime's benchmark and tests (issue 41).

:class:`EmulatedMoEStage` has ``layers`` MoE layers, each attention (compute), dispatch
all-to-all, experts (compute), combine all-to-all; an F's time and its all-to-all time are cut
into 2 x layers equal pieces, a B runs the reverse. Compute pieces do tiny real work and queue
their time on the rank's emulated device (the host waits for it at the end of each action); an
all-to-all (:class:`EmulatedAllToAll`) is a real gloo ``all_to_all_single`` of one int64 per
EP peer (the label check that proves every EP rank issued the same all-to-all) whose duration is
emulated. The dense emulated stages and the shared clocks are in
:mod:`megatron_chimera.pipeline.emulated`; docs/CHIMERA_EP.md, "What is emulated".
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from megatron_chimera.model.linear import Linear
from megatron_chimera.model.moe.expert_comm import ExpertComm
from megatron_chimera.pipeline.emulated import EmulatedCosts, sleep_until_yielding
from megatron_chimera.pipeline.transport import Transport
from megatron_chimera.schedules.lowering import SEND


class _EmulatedAllToAllWork:
    """An issued emulated all-to-all: the real exchange of label codes, then the emulated
    link's time."""

    def __init__(self, work: dist.Work | None, received: torch.Tensor | None, code: int,
                 label: str, done_at: float, device: EmulatedAllToAll) -> None:
        self.work, self.received, self.code = work, received, code
        self.label, self.done_at, self.device = label, done_at, device

    def wait(self) -> bool:
        """Wait for the exchange, checking that every peer issued the same all-to-all; the
        device's compute waits until the emulated transfer is through (as a compute stream
        waits on a communication stream's event), the host does not."""
        if self.work is not None:
            self.work.wait()
            if bool((self.received != self.code).any()):
                raise RuntimeError(
                    f"expert-parallel all-to-all issued in different orders: this rank's "
                    f"{self.label} met another all-to-all of a peer (codes "
                    f"{self.received.tolist()}, expected {self.code})")
        self.device.compute_free_at = max(self.device.compute_free_at, self.done_at)
        return True


class EmulatedAllToAll:
    """The dispatch/combine all-to-all of emulated MoE layers on one rank, and the rank's
    emulated device (:meth:`piece_start`, :meth:`sync`).

    What is real: an ``all_to_all_single`` on the expert-parallel ``group`` (gloo, async) that
    carries one int64 per peer: the CRC of the all-to-all's label (compute action, layer,
    dispatch/combine, direction), checked on receipt -- a rank whose peer issued a different
    all-to-all at the same position raises, so a run proves the issue order is one on every EP
    rank. What is emulated: its duration -- the transfer ends ``seconds`` after it starts, and it
    starts when the half's previous piece has ended, this rank's previous all-to-all is through
    and the host has issued it (one link per rank, as the simulator assumes).

    **The device is a queue.** A compute piece or all-to-all starts at its ideal time (the end
    of what it waits for: the rank's previous compute piece, the half's own previous piece) or,
    when the host issues it later, at the issue: the host runs ahead of the emulated device, as
    it does of a GPU's streams, and its per-piece work (autograd, the paired runtime's
    switches) is hidden while it stays ahead and added when it falls behind. Waiting for an
    all-to-all holds the device's compute, not the host. The host waits for the device only at
    the end of an action (:meth:`sync`), before the action's result leaves the rank -- or, with
    :attr:`sync_each_action` off, at the end of the iteration (:meth:`sync_device`), the
    pipeline messages carrying the device time (:class:`DeviceTimedTransport`). ``issued`` (a
    list, when set) records every label in issue order."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.issued: list[str] | None = None
        self._link_free_at = 0.0
        self.compute_free_at = 0.0  # ideal end of the rank's last compute piece
        self.comm = ExpertComm()  # how the all-to-alls are issued (set_expert_comm)
        #: whether each action ends with the host waiting for its device work (False only with
        #: a :class:`DeviceTimedTransport`, whose messages carry the device time instead)
        self.sync_each_action = True
        self._ready: dict = {}  # per action: the ideal end of its half's last piece
        self._inputs: dict = {}  # per action: when its received input is on the device

    def _half_ready_at(self) -> float:
        """Ideal end of the calling half's previous piece, or when its input arrived (-inf at a
        new action without one)."""
        action = self.action()
        return max(self._ready.get(action, -math.inf), self._inputs.get(action, -math.inf))

    def ready_at(self, action) -> float:
        """When ``action``'s last queued piece ends on the device (now if none is known)."""
        return self._ready.get(action, time.perf_counter())

    def input_arrives(self, action, at: float) -> None:
        """``action``'s input is on this rank's device at ``at`` (a received message)."""
        self._inputs[action] = at

    def sync_device(self) -> None:
        """The host waits until everything queued on the device has ended."""
        sleep_until_yielding(max(self.compute_free_at, self._link_free_at))

    def action(self):
        """The compute action running now (the paired runtime's, None outside one)."""
        return getattr(self.comm, "action", None)

    def piece_start(self, seconds: float) -> float:
        """Queue a compute piece of ``seconds`` for the current half: its end on the device."""
        start = max(self.compute_free_at, self._half_ready_at(), time.perf_counter())
        self.compute_free_at = self._ready[self.action()] = start + seconds
        return start + seconds

    def sync(self) -> None:
        """The end of an action: the host waits until the current half's queued pieces have
        ended on the device (unless :attr:`sync_each_action` is off)."""
        if self.sync_each_action:
            sleep_until_yielding(self._half_ready_at())

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
        start = max(self._half_ready_at(), self._link_free_at, time.perf_counter())
        self._link_free_at = self._ready[self.action()] = start + seconds
        code = zlib.crc32(label.encode())
        work = received = None
        if self.size > 1:
            sent = torch.full((self.size,), code, dtype=torch.int64)
            received = torch.empty_like(sent)
            work = dist.all_to_all_single(received, sent, group=self.group, async_op=True)
        return _EmulatedAllToAllWork(work, received, code, label, self._link_free_at, self)


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


class _BackwardPieceStarts(torch.autograd.Function):
    """Identity whose backward queues one compute piece of ``seconds()`` of an emulated backward
    on the rank's device ``exchange``; it sits *after* the piece's real work in the forward
    graph, so in the backward that work (the layer's backward, its gradient accumulation) is
    host work done while the piece runs -- as a forward piece's is."""

    @staticmethod
    def forward(ctx, x, seconds: Callable[[], float],  # type: ignore[override]
                exchange: EmulatedAllToAll):
        ctx.seconds, ctx.exchange = seconds, exchange
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.exchange.piece_start(ctx.seconds())
        return grad, None, None


class _BackwardEnds(torch.autograd.Function):
    """Identity on a stage's input whose backward (the backward's last step, after the first
    piece's real work) waits until the backward's pieces have ended on the device."""

    @staticmethod
    def forward(ctx, x, exchange: EmulatedAllToAll):  # type: ignore[override]
        ctx.exchange = exchange
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.exchange.sync()
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
    and queues its time on the device (:class:`EmulatedAllToAll`); all state of a running
    action lives in its autograd graph and locals, so the two halves of a pair (even of one
    stage) interleave."""

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
                linear.weight.emulated_device = exchange
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
            # piece (_BackwardEnds on the input) is in the graph
            hidden = hidden.detach().requires_grad_()
        piece_s = self.costs.forward_s / self.pieces
        a2a_s = self.all_to_all_s / self.pieces
        communicate = a2a_s > 0 or self.exchange.size > 1
        hidden = _BackwardEnds.apply(hidden, self.exchange)
        for i, linear in enumerate(self.linears):
            self.exchange.piece_start(piece_s)
            hidden = linear(hidden)
            if self.post_process and i == self.pieces - 1:
                hidden = hidden.pow(2).mean(dim=-1).t()
            hidden = _BackwardPieceStarts.apply(hidden, self._backward_piece_s, self.exchange)
            if communicate:
                name = f"{'dispatch' if i % 2 == 0 else 'combine'}{i // 2}"
                if self.exchange.comm.tape is not None:
                    hidden = self.exchange.cut(hidden, name, a2a_s)
                else:
                    hidden = _AllToAllPoint.apply(hidden, self.exchange, name, a2a_s)
        self.exchange.sync()
        return hidden


def emulated_moe_forward_step(batch: torch.Tensor | None, model: EmulatedMoEStage):
    """``forward_step_func`` for :class:`EmulatedMoEStage` (loss = mean of the last stage's
    output)."""
    output = model(batch)

    def loss_func(per_token: torch.Tensor):
        loss = per_token.mean()
        return loss, {"loss": loss.detach()}

    return output, loss_func


class _Stamped:
    """The work of one message and of its device-time stamp (both waited for)."""

    __slots__ = ("work", "stamp_work", "stamp")

    def __init__(self, work, stamp_work, stamp: torch.Tensor) -> None:
        self.work, self.stamp_work, self.stamp = work, stamp_work, stamp

    def wait(self) -> bool:
        self.work.wait()
        self.stamp_work.wait()
        return True


class DeviceTimedTransport(Transport):
    """Pipeline messages between emulated MoE stages that carry the device time: each message is
    followed by a float64 stamp, when its data was ready on the sender's emulated device
    (:meth:`EmulatedAllToAll.ready_at` of the action that produced it); the receiver's consumer
    action starts no earlier than the stamp plus ``latency_s`` (the simulator's per-message
    cost). With it no action ends with a host sync (``device.sync_each_action`` off): the hosts
    run ahead of their emulated devices across actions, as they do of GPUs, and wait only for
    real messages. An output handed over on one rank carries no stamp: use it for schedules
    without such hand-overs."""

    def __init__(self, topology, tag_of, device: EmulatedAllToAll, latency_s: float) -> None:
        super().__init__(topology, tag_of)
        self.device, self.latency_s = device, latency_s

    def post(self, op, messages, tensors):  # noqa: D102 - see the base class
        works = []
        for message, tensor in zip(messages, tensors):
            group, peer, tag = self.address(message)
            if op == SEND:
                stamp = torch.tensor([self.device.ready_at(message.producer())],
                                     dtype=torch.float64)
                works.append(_Stamped(group.send([tensor], peer, tag),
                                      group.send([stamp], peer, tag), stamp))
            else:
                stamp = torch.empty(1, dtype=torch.float64)
                works.append(_Stamped(group.recv([tensor], peer, tag),
                                      group.recv([stamp], peer, tag), stamp))
        return works

    def wait(self, work, message) -> None:  # noqa: D102 - see the base class
        work.wait()  # (connect's probes come from isend / irecv, unstamped)
        if isinstance(work, _Stamped) and self.topology.pipeline_rank == message.dst:
            self.device.input_arrives(message.consumer(),
                                      float(work.stamp) + self.latency_s)
