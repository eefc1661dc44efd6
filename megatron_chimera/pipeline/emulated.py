"""Emulated-compute stage modules: pipeline stages that *wait* instead of computing.

A forward takes ``forward_s``, a backward ``backward_s``; with split backward, B takes the
input-gradient time ``backward_s - weight_s`` and W takes ``weight_s``. Each action does tiny real
tensor work and waits *until its deadline*, so the work is part of the emulated time rather than
added to it (a stage with more tiny layers is not slower), and a time of zero never waits. All of
an action's real work comes before its wait -- the last stage's loss (its loss function ends the
forward's wait) and a backward's gradient accumulation (its last wait is an engine callback at the
end of the pass) included: on the development VM whatever follows a long wait runs cache-cold,
10-20x slower than in a loop, which a device computing for exactly the emulated time would not
add. A wait sleeps, then spins its last :data:`SPIN_S` (the OS wakes a sleeper late, a device
does not finish late). Sleeping ranks do not compete for cores, so 8 ranks on 2 cores behave like
8 devices and the measured iteration time exposes the schedule plus the runtime's overheads.

* :class:`EmulatedStage` runs in our executor: its :class:`Linear` layers take the
  weight-gradient time through :class:`SleepingWeightGradStore` (pass it as the executor's
  ``weight_grad_store_factory``).
* :class:`EmulatedCollectives` gives the gradient reduction a cost: each rank's buckets cross
  one emulated link, overlapping the (sleeping) compute.
* :class:`EmulatedMoEStage` is a stage of emulated MoE layers whose dispatch and combine
  all-to-alls (:class:`EmulatedAllToAll`) take their own time and, inside a paired F&B action,
  overlap the other half's compute (:mod:`.overlap`).
* :class:`EmulatedTorchStage` runs in ``torch.distributed.pipelining``: the input-gradient and
  weight-gradient sleeps sit on separate autograd branches, so torch's split backward (which
  differentiates w.r.t. inputs and weights separately) takes each time once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from megatron_chimera.distributed.grad_sync import Collectives
from megatron_chimera.model.linear import Linear, WeightGradStore
from megatron_chimera.pipeline.trace import Timeline


@dataclass(frozen=True)
class EmulatedCosts:
    """Seconds per micro-batch and stage: forward, whole backward, and its weight-gradient part."""

    forward_s: float
    backward_s: float
    weight_s: float = 0.0

    def __post_init__(self) -> None:
        if min(self.forward_s, self.backward_s, self.weight_s) < 0:
            raise ValueError("emulated times must be >= 0")
        if self.weight_s > self.backward_s:
            raise ValueError(
                f"--weight-ms ({self.weight_s * 1e3:g}) must not exceed --backward-ms "
                f"({self.backward_s * 1e3:g}): W is part of the backward"
            )

    @property
    def input_grad_s(self) -> float:
        """Time of B when the backward is split."""
        return self.backward_s - self.weight_s

    def scaled(self, factor: float) -> EmulatedCosts:
        """Costs of a stage ``factor`` times as large (e.g. 1/v for v chunks per rank)."""
        return EmulatedCosts(self.forward_s * factor, self.backward_s * factor,
                             self.weight_s * factor)


#: the last part of every emulated wait is spun, not slept: ``time.sleep`` wakes 0.1-0.2 ms late
#: on the 2-core development VM (more under load), which a device that computes for exactly the
#: emulated time does not add. Kept short, since a spinning rank holds one of the 2 cores that 8
#: ranks share at the step boundaries they reach together: 0.1 ms measured 0.3-2.1 % closer to
#: the simulator than 0.5 ms in 19 of 20 rows of two alternating pairs of runs (0 ms: further)
SPIN_S = 0.0001


def sleep_until(deadline: float) -> None:
    """Wait until ``time.perf_counter()`` reaches ``deadline``: sleep until :data:`SPIN_S`
    before it, then spin (no call when it has passed)."""
    remaining = deadline - time.perf_counter()
    if remaining > SPIN_S:
        time.sleep(remaining - SPIN_S)
    while time.perf_counter() < deadline:
        pass


def sleep_until_yielding(deadline: float) -> None:
    """:func:`sleep_until` whose spin yields the processor at every turn (8 ranks share this
    VM's 2 cores, and gloo's own threads run the rank's communication meanwhile)."""
    remaining = deadline - time.perf_counter()
    if remaining > SPIN_S:
        time.sleep(remaining - SPIN_S)
    while time.perf_counter() < deadline:
        time.sleep(0)


class _Deadlines:
    """The clock of one emulated backward that sleeps in ``parts`` pieces (one per layer): piece
    ``k`` ends at ``start + k/parts`` of the backward's time, so the real work between the pieces
    is absorbed instead of added. The last piece is waited at the end of the backward pass (an
    engine callback), after the gradients of the stage's inputs are accumulated: what follows a
    wait runs cache-cold on this VM, far slower than the work itself, so no real work of the
    action is left after its wait."""

    def __init__(self, parts: int) -> None:
        self.parts = parts
        self.timeline: Timeline | None = None  # records the backward's start and end if set
        self._start = 0.0
        self._seconds = 0.0
        self._done = 0

    def begin(self, seconds: float) -> None:
        """The backward starts now and lasts ``seconds``."""
        self._start, self._seconds, self._done = time.perf_counter(), seconds, 0
        if self.timeline is not None:
            self.timeline.compute_starts()

    def node_done(self, seconds: float = 0.0) -> None:
        """A layer's backward node ran: wait until the end of its piece (``seconds`` is unused:
        :meth:`begin` was given the whole time)."""
        self._done += 1
        deadline = self._start + self._seconds * self._done / self.parts
        if self._done < self.parts:
            if self._seconds > 0:
                sleep_until(deadline)
        elif self._seconds > 0 or self.timeline is not None:
            Variable._execution_engine.queue_callback(lambda: self._end(deadline))

    def _end(self, deadline: float) -> None:
        sleep_until(deadline)
        if self.timeline is not None:
            self.timeline.compute_ends()


class _WaitAtBackwardEnd:
    """The clock of a stage whose backward nodes each take ``seconds`` (torch's stages): the
    times of the nodes one backward pass runs add up from its first node and are waited at the
    pass's end (an engine callback), after its gradient accumulation, as :class:`_Deadlines`
    does -- so torch's rows and ours emulate a backward alike."""

    def __init__(self) -> None:
        self._deadline: float | None = None

    def node_done(self, seconds: float) -> None:
        """A node of ``seconds`` ran in the current backward pass."""
        if seconds <= 0:
            return
        if self._deadline is None:
            self._deadline = time.perf_counter() + seconds
            Variable._execution_engine.queue_callback(self._wait)
        else:
            self._deadline += seconds

    def _wait(self) -> None:
        deadline, self._deadline = self._deadline, None
        sleep_until(deadline)

    def reset(self) -> None:
        """Forget a pass that failed before its end (its callback never ran); called by each
        forward, which never runs inside a backward pass."""
        self._deadline = None


class _SleepInBackward(torch.autograd.Function):
    """Identity whose backward tells ``clock`` that a node of ``seconds()`` ran (the clock
    decides when to wait); ``anchor`` keeps it in the graph at stage 0."""

    @staticmethod
    def forward(ctx, x, anchor, clock: _Deadlines | _WaitAtBackwardEnd,  # type: ignore[override]
                seconds: Callable[[], float]):
        ctx.clock, ctx.seconds = clock, seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.clock.node_done(ctx.seconds())
        return grad.contiguous(), None, None, None


class _BackwardBegins(torch.autograd.Function):
    """Identity on a stage's output whose backward (the stage's first) starts its deadlines."""

    @staticmethod
    def forward(ctx, x, deadlines: _Deadlines, seconds: Callable[[], float]):  # type: ignore[override]
        ctx.deadlines, ctx.seconds = deadlines, seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.deadlines.begin(ctx.seconds())
        return grad, None, None


class _TimedForward(nn.Module):
    """A module whose forward takes ``costs.forward_s``: :meth:`start_forward` starts its clock,
    :meth:`finish_forward` waits until the time is over (the caller does all of the forward's
    real work in between: what follows a wait runs cache-cold on this VM)."""

    costs: EmulatedCosts
    forward_deadline = 0.0  # when the running forward's time is over
    timeline: Timeline | None = None  # records each action's start and end if set

    def start_forward(self) -> None:
        """The forward starts now."""
        self.forward_deadline = time.perf_counter() + self.costs.forward_s
        if self.timeline is not None:
            self.timeline.compute_starts()

    def finish_forward(self) -> None:
        """Wait until the forward's time is over."""
        sleep_until(self.forward_deadline)
        if self.timeline is not None:
            self.timeline.compute_ends()


class SleepingWeightGradStore(WeightGradStore):
    """WeightGradStore whose flush (the W action) also sleeps each queued layer's W time, entry
    by entry (in a pair the W computes one entry per piece: ``overlap.py``). An entry whose
    weight names an ``emulated_device`` (an emulated MoE stage's, ``emulated_moe.py``) queues its
    time there instead, and the W's last entry waits for the device."""

    def __init__(self, timeline: Timeline | None = None) -> None:
        super().__init__()
        self._seconds: list[float] = []
        self._devices: list = []
        self.timeline = timeline  # records the W's start and end if set

    def put(self, weight, bias, inputs, grad_output,  # noqa: D102 - see base class
            sequence_sharded: bool = False) -> None:
        self._seconds.append(getattr(weight, "emulated_weight_seconds", 0.0))
        self._devices.append(getattr(weight, "emulated_device", None))
        super().put(weight, bias, inputs, grad_output, sequence_sharded)

    def pieces(self) -> Iterator[None]:
        """Each entry: compute its (tiny) real gradients, then sleep until its weight-gradient
        time has passed since it started (one entry per step, see the base class)."""
        if self.timeline is not None:
            self.timeline.compute_starts()
        yield from super().pieces()
        self._seconds.clear()
        self._devices.clear()
        if self.timeline is not None:
            self.timeline.compute_ends()

    def _flush_entry(self, index: int) -> None:
        device = self._devices[index]
        if device is None:
            deadline = time.perf_counter() + self._seconds[index]
            super()._flush_entry(index)
            sleep_until_yielding(deadline)
            return
        device.piece_start(self._seconds[index])
        super()._flush_entry(index)
        if index == len(self._devices) - 1:
            device.sync()


class EmulatedStage(_TimedForward):
    """A pipeline stage for our executor: ``[s, b, h] -> [s, b, h]`` (the loss ``[b, s]`` last).

    ``layers`` tiny linear layers share the stage's times; in backward each layer's parameters
    receive their gradients after its share of the time, so gradient buckets of a layer become
    final one after another, as in a real stage (what ``--overlap-grad-reduce`` exploits).
    """

    def __init__(self, costs: EmulatedCosts, pre_process: bool, post_process: bool,
                 hidden: int = 4, seed: int = 0, layers: int = 1) -> None:
        super().__init__()
        if layers < 1:
            raise ValueError(f"an emulated stage needs at least one layer, got {layers}")
        self.costs = costs
        self.pre_process, self.post_process = pre_process, post_process
        self.num_layers = layers
        self.linears = nn.ModuleList(Linear(hidden, hidden) for _ in range(layers))
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for linear in self.linears:
                linear.weight.copy_(torch.randn(hidden, hidden, generator=g) * hidden**-0.5)
                linear.bias.zero_()
                linear.weight.emulated_weight_seconds = costs.weight_s / layers
        self.anchor = nn.Parameter(torch.zeros(()))
        self.input_tensor: torch.Tensor | None = None
        self._backward_deadlines = _Deadlines(layers)

    @property
    def linear(self) -> Linear:
        """The first layer."""
        return self.linears[0]

    def trace_into(self, timeline: Timeline | None) -> None:
        """Record every forward's and backward's start and end into ``timeline`` (None: stop)."""
        self.timeline = self._backward_deadlines.timeline = timeline

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """Input activations of a non-first stage."""
        self.input_tensor = tensor

    def _backward_seconds(self) -> float:
        deferred = self.linear.weight_grad_store is not None
        return self.costs.input_grad_s if deferred else self.costs.backward_s

    def forward(self, batch: torch.Tensor | None, loss_follows: bool = False) -> torch.Tensor:
        """The tiny layers (loss per token at the last stage), done when the forward time is;
        with ``loss_follows`` the wait is left to :meth:`finish_forward`, called once the loss
        is computed, so that the loss is inside the forward's time too."""
        self.start_forward()
        hidden = batch if self.pre_process else self.input_tensor
        for linear in self.linears:
            hidden = _SleepInBackward.apply(hidden, self.anchor, self._backward_deadlines,
                                            self._backward_seconds)
            hidden = linear(hidden)
        if self.post_process:
            hidden = hidden.pow(2).mean(dim=-1).t()
        output = _BackwardBegins.apply(hidden, self._backward_deadlines, self._backward_seconds)
        if not loss_follows:
            self.finish_forward()
        return output


class _DelayedWork:
    """A collective's work that also waits until the emulated link has carried its bytes."""

    def __init__(self, work: dist.Work, done_at: float) -> None:
        self.work, self.done_at = work, done_at

    def wait(self) -> bool:
        """Wait for the real collective, then for the emulated transfer."""
        self.work.wait()
        sleep_until(self.done_at)
        return True

    def is_completed(self) -> bool:
        """Both the collective and the emulated transfer are done."""
        return self.work.is_completed() and time.perf_counter() >= self.done_at


class EmulatedCollectives(Collectives):
    """Real collectives that complete as if each rank's buckets crossed one link of
    ``seconds_per_element``: a bucket starts when issued or when the previous one is through,
    whichever is later (so reductions overlap compute, which sleeps, but not each other)."""

    def __init__(self, seconds_per_element: float) -> None:
        if seconds_per_element < 0:
            raise ValueError("the emulated reduction time must be >= 0")
        self.seconds_per_element = seconds_per_element
        self._link_free_at = 0.0

    def _delayed(self, work: dist.Work, elements: int) -> _DelayedWork:
        start = max(time.perf_counter(), self._link_free_at)
        self._link_free_at = start + elements * self.seconds_per_element
        return _DelayedWork(work, self._link_free_at)

    def all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> _DelayedWork:
        """All-reduce taking the emulated time of ``tensor``'s elements."""
        return self._delayed(super().all_reduce(tensor, group), tensor.numel())

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor,
                       group: dist.ProcessGroup) -> _DelayedWork:
        """Reduce-scatter taking the emulated time of ``tensor``'s elements."""
        return self._delayed(super().reduce_scatter(output, tensor, group), tensor.numel())


def emulated_forward_step(batch: torch.Tensor | None, model: EmulatedStage):
    """``forward_step_func`` for :class:`EmulatedStage` (loss = mean of the last stage's output)."""
    output = model(batch, loss_follows=model.post_process)

    def loss_func(per_token: torch.Tensor):
        loss = per_token.mean()
        stats = {"loss": loss.detach()}
        model.finish_forward()
        return loss, stats

    return output, loss_func


class EmulatedTorchStage(_TimedForward):
    """The same emulated stage for ``torch.distributed.pipelining`` (``[b, s, h]`` in and out).

    The last stage (``is_last``) leaves the end of its forward's wait to the loss
    (:func:`mse_then_wait`), so that the loss is inside the forward's time, as in our rows."""

    def __init__(self, costs: EmulatedCosts, is_first: bool, hidden: int = 4,
                 is_last: bool = False) -> None:
        super().__init__()
        self.costs = costs
        self.is_last = is_last
        self.weight = nn.Parameter(torch.randn(hidden, hidden) * hidden**-0.5)
        self.anchor = nn.Parameter(torch.zeros(())) if is_first else None
        self._clock = _WaitAtBackwardEnd()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Input-gradient and weight-gradient sleeps on separate branches, done when the forward
        time is (the last stage: when the loss is computed)."""
        self.start_forward()
        self._clock.reset()
        h = _SleepInBackward.apply(x, self.anchor, self._clock, lambda: self.costs.input_grad_s)
        w = _SleepInBackward.apply(self.weight, None, self._clock, lambda: self.costs.weight_s)
        out = h + w.sum() * 0.0
        if not self.is_last:
            self.finish_forward()
        return out


def mse_then_wait(last_stage: EmulatedTorchStage | None, out: torch.Tensor,
                  target: torch.Tensor) -> torch.Tensor:
    """torch's loss function over emulated stages: the mean squared error, then the rest of the
    last stage's forward time (``last_stage`` is None on ranks that do not hold it)."""
    loss = (out - target).pow(2).mean()
    if last_stage is not None:
        last_stage.finish_forward()
    return loss


def emulated_stage_costs(costs: EmulatedCosts, num_stages: int, num_ranks: int,
                         end_factor: float = 1.0, split: bool = True) -> list[EmulatedCosts]:
    """Per-stage emulated times of a schedule with ``num_stages`` stages on ``num_ranks`` ranks:
    each stage ``num_ranks / num_stages`` of ``costs``, plus (end_factor - 1) x ``costs`` on the
    first and the last stage (embedding, LM head); no W time when the backward is not split."""
    base = costs.scaled(num_ranks / num_stages)
    extra = costs.scaled(end_factor - 1)
    out = []
    for stage in range(num_stages):
        c = base
        if stage in (0, num_stages - 1):
            c = EmulatedCosts(c.forward_s + extra.forward_s, c.backward_s + extra.backward_s,
                              c.weight_s + extra.weight_s)
        out.append(c if split else EmulatedCosts(c.forward_s, c.backward_s, 0.0))
    return out
