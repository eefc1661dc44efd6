"""How the MoE layer reaches its expert-parallel all-to-alls, and where its backward is cut.

A MoE layer is *handed* an :class:`ExpertComm` (``MoELayer.set_expert_comm``; the default one
issues every collective and waits for it at once). The pipeline's paired runtime
(``pipeline/overlap.py``) hands its own: inside a paired F&B action its ``exchange`` issues the
all-to-all, lets the other half compute one piece while it is in flight, then waits. Nothing
here is process-wide: no runner, no thread.

**Backward pieces.** While a forward runs with a :class:`BackwardTape` on its comm
(``comm.tape``), the layer cuts its autograd graph at each all-to-all (the output is a fresh
leaf; the tape keeps the input and how to send the gradient back) and at every tensor that
crosses a cut (:meth:`BackwardTape.cut`), so the backward runs as one ``torch.autograd.backward``
per *segment*, last first, with the gradient all-to-alls in between (:meth:`BackwardTape.pieces`,
a generator that yields each issued all-to-all: the runtime computes the other half meanwhile).
Every gradient is the one a single backward gives (a tensor read on both sides of a cut sums
its terms in another order); overlap on and off both run these pieces, so they agree bitwise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch


class Waitable(Protocol):
    """A started collective (``torch.distributed.Work``)."""

    def wait(self) -> Any:
        """Block until it is complete."""


#: ``issue(x) -> (handle, out)``: start the collective on ``x``, return its handle and the
#: tensor it fills
Issue = Callable[[torch.Tensor], tuple[Waitable, torch.Tensor]]


class ExpertComm:
    """The expert-parallel communication of a model's MoE layers: ``exchange`` issues a
    collective and returns once it is complete (this default: at once). ``tape``: the
    :class:`BackwardTape` of the forward running now (None: no cuts). ``issued`` (a list, when
    set) records every collective's label in issue order."""

    def __init__(self) -> None:
        self.tape: BackwardTape | None = None
        self.issued: list[str] | None = None

    def label(self, name: str) -> str:
        """The label ``issued`` records for the collective ``name``."""
        return name

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No cuts within the block (a recomputed region: its forward replays in the backward)."""
        tape, self.tape = self.tape, None
        try:
            yield
        finally:
            self.tape = tape

    def exchange(self, name: str, issue: Callable[[], Waitable]) -> None:
        """Start the collective (``issue()`` returns its handle) and wait for it."""
        self.start(name, issue).wait()

    def start(self, name: str, issue: Callable[[], Waitable]) -> Waitable:
        """Start the collective and return its handle (waited for by the caller)."""
        if self.issued is not None:
            self.issued.append(self.label(name))
        return issue()


class _Boundary:
    """The all-to-all (or plain cut) that ends one segment of a taped forward."""

    __slots__ = ("src", "leaf", "name", "backward")

    def __init__(self, src: torch.Tensor | None, leaf: torch.Tensor | None, name: str,
                 backward: Issue | None) -> None:
        self.src, self.leaf, self.name, self.backward = src, leaf, name, backward


class BackwardTape:
    """The cuts of one forward's graph (module docstring). Segment ``k`` ends at boundary ``k``;
    ``roots[k]`` are the tensors of segment ``k`` that later segments read through leaves."""

    def __init__(self) -> None:
        self.boundaries: list[_Boundary] = []
        self.roots: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[]]

    @property
    def segment(self) -> int:
        """The segment the forward is in now."""
        return len(self.boundaries)

    def cut(self, src: torch.Tensor, segment: int) -> torch.Tensor:
        """A leaf standing for ``src`` (made in ``segment``, an earlier one) in the current
        segment; its gradient flows to ``src`` when ``segment``'s backward runs."""
        if not src.requires_grad or src.grad_fn is None:  # (a leaf needs no cut)
            return src
        if segment >= self.segment:
            raise ValueError(f"cut of a tensor of segment {segment} in segment {self.segment}")
        leaf = src.detach().requires_grad_()
        self.roots[segment].append((src, leaf))
        return leaf

    def split(self, src: torch.Tensor) -> torch.Tensor:
        """End the current segment at ``src`` (no communication): the returned leaf is read by
        later work; ``src``'s backward runs after all of theirs."""
        if src.grad_fn is None:  # a leaf (or no gradient): nothing to cut
            return src
        leaf = src.detach().requires_grad_()
        self.boundaries.append(_Boundary(src, leaf, "split", None))
        self.roots.append([])
        return leaf

    def all_to_all(self, x: torch.Tensor, name: str, comm: ExpertComm, forward: Issue,
                   backward: Issue) -> torch.Tensor:
        """Run the all-to-all ``name`` on ``x`` through ``comm`` and end the segment: the
        output is a leaf; in the backward ``backward`` sends its gradient back (``name.bwd``)."""
        x = x.contiguous()
        box: list[torch.Tensor] = []

        def issue() -> Waitable:
            handle, out = forward(x)
            box.append(out)
            return handle

        comm.exchange(name, issue)
        leaf = box[0].detach().requires_grad_(x.requires_grad)
        self.boundaries.append(_Boundary(x if x.requires_grad else None, leaf, name, backward))
        self.roots.append([])
        return leaf

    def pieces(self, comm: ExpertComm, output: torch.Tensor | None,
               grad: torch.Tensor | None, run_backward: Callable[[list, list], None]
               ) -> Iterator[Waitable]:
        """The backward from ``output`` (with ``grad``), one ``run_backward(tensors, grads)``
        per segment, last first; yields each gradient all-to-all once issued (wait for it
        after the yield) -- the caller computes something else meanwhile."""
        top: list[tuple[torch.Tensor, torch.Tensor]] = []
        if output is not None:
            top.append((output, grad))
        handed: dict[int, torch.Tensor] = {}  # gradients of leaves that are roots themselves
        for k in range(self.segment, -1, -1):
            tensors, grads = [], []
            for src, g in top + [(s, leaf.grad) for s, leaf in self.roots[k]]:
                if g is None or not src.requires_grad:
                    continue
                if src.grad_fn is None:  # a cut's leaf (the stage output may be one)
                    handed[id(src)] = g if id(src) not in handed else handed[id(src)] + g
                    continue
                tensors.append(src)
                grads.append(g)
            if tensors:
                run_backward(tensors, grads)
            top = []
            if k == 0:
                break
            boundary = self.boundaries[k - 1]
            if boundary.src is None:
                continue
            g = boundary.leaf.grad
            if id(boundary.leaf) in handed:
                more = handed.pop(id(boundary.leaf))
                g = more if g is None else g + more
            if boundary.backward is None:  # a plain split
                top = [(boundary.src, g)] if g is not None else []
                continue
            if g is None:  # (every EP rank sends back, whatever reached its leaf)
                g = torch.zeros_like(boundary.leaf)
            box: list[torch.Tensor] = []

            def issue(g=g, b=boundary, box=box) -> Waitable:
                handle, out = b.backward(g.contiguous())
                box.append(out)
                return handle

            handle = comm.start(f"{boundary.name}.bwd", issue)
            yield handle
            handle.wait()
            top = [(boundary.src, box[0])]
        if output is not None and id(output) in handed:  # an output that is an uncut leaf
            g = handed.pop(id(output))
            output.grad = g if output.grad is None else output.grad + g
