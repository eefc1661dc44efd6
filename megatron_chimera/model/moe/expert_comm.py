"""Where the MoE layer's expert-parallel all-to-alls meet the pipeline runtime (issue 41).

The ``alltoall`` token dispatcher issues every collective of its dispatch and combine -- the
per-expert counts, the tokens, the outputs, and in the backward the gradients' all-to-alls --
through :func:`expert_all_to_all` as a callable that *starts* it (``async_op=True``) and returns
its handle. By default the call waits for it at once (the all-to-all is exposed).

The paired runtime (``pipeline/overlap.py``, a layer above the model) installs its own runner
with :func:`set_all_to_all_runner` when it is imported: inside one half of a paired F&B action
the runner issues the all-to-all while that half holds the pair's baton, lets the other half
compute while it is in flight, and waits for it when the baton comes back; outside a pair it
issues and waits, as the default does. The model therefore knows nothing of pairs, and every
rank of an expert-parallel group issues its collectives in the one order the baton fixes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class Waitable(Protocol):
    """A started collective (``torch.distributed.Work``)."""

    def wait(self) -> Any:
        """Block until it is complete."""


#: ``runner(name, issue)``: issue the collective (``issue()`` starts it and returns its
#: handle) and return once it is complete; ``name`` labels it (``dispatch``, ``combine.bwd``..)
Runner = Callable[[str, Callable[[], Waitable]], None]


def issue_and_wait(name: str, issue: Callable[[], Waitable]) -> None:
    """The default runner: start the collective and wait for it at once."""
    del name
    issue().wait()


_runner: Runner = issue_and_wait


def set_all_to_all_runner(runner: Runner | None) -> None:
    """Route every later :func:`expert_all_to_all` through ``runner`` (None: the default)."""
    global _runner
    _runner = issue_and_wait if runner is None else runner


def expert_all_to_all(name: str, issue: Callable[[], Waitable]) -> None:
    """Run the expert-parallel collective ``name`` that ``issue()`` starts, through the
    installed runner; it is complete when this returns."""
    _runner(name, issue)
