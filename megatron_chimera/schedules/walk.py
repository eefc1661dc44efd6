"""The one in-order walk over per-rank action lists.

Each rank executes its list in order and blocks on the input of its next action (the dependency
rule :func:`~.actions.input_of`); outputs are buffered, so a finished action never waits for its
consumer. The validator (deadlock check), the simulator (timeline) and the Chimera-ZB list
scheduler (replay of an emitted order) all walk a schedule this way, through :func:`run_in_order`.

A paired action (``pairs``, see :class:`~.actions.Schedule`) is one step: it starts only when the
inputs of *both* halves are there, then both halves run.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator, Sequence

from megatron_chimera.schedules.actions import Action, input_of

OnRun = Callable[[int, Action, "Action | None"], None]
Step = tuple[Action, "Action | None"]
OnPair = Callable[[int, Step, Step], None]


@contextlib.contextmanager
def no_cyclic_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector: a search or a walk allocates millions of tuples (no
    cycles, so reference counting frees them) and the collector's passes over them cost ~40% of
    a Chimera-ZB search at D=64 and ~30% of a simulation."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def run_in_order(
    lists: Sequence[Sequence[Action]], num_stages: int, on_run: OnRun | None = None,
    pairs: Sequence[frozenset[int]] | None = None, on_pair: OnPair | None = None,
) -> list[int]:
    """Execute ``lists[rank]`` in order, each rank blocking on the input of its next action.

    Calls ``on_run(rank, action, input)`` as each action runs (after its input) and returns, per
    rank, how many of its actions ran (all of them unless the lists deadlock). ``pairs[rank]``:
    indices where a paired action starts; it runs when both halves' inputs are done, reported
    by ``on_pair(rank, (first, input), (second, input))`` (default: ``on_run`` for each half).
    """
    with no_cyclic_gc():
        return _walk(lists, num_stages, on_run, pairs, on_pair)


def _walk(
    lists: Sequence[Sequence[Action]], num_stages: int, on_run: OnRun | None,
    pairs: Sequence[frozenset[int]] | None, on_pair: OnPair | None,
) -> list[int]:
    steps = [[(a, input_of(a, num_stages)) for a in actions] for actions in lists]
    starts = pairs or [frozenset()] * len(steps)
    done: set[Action] = set()
    heads = [0] * len(steps)
    progress = True
    while progress:
        progress = False
        for rank, rank_steps in enumerate(steps):
            head = heads[rank]
            paired = starts[rank]
            while head < len(rank_steps):
                a, dep = rank_steps[head]
                if dep is not None and dep not in done:
                    break
                if head in paired:
                    b, dep_b = rank_steps[head + 1]
                    if dep_b is not None and dep_b not in done:
                        break
                    if on_pair is not None:
                        on_pair(rank, (a, dep), (b, dep_b))
                    elif on_run is not None:
                        on_run(rank, a, dep)
                        on_run(rank, b, dep_b)
                    done.add(a)
                    done.add(b)
                    head += 2
                else:
                    if on_run is not None:
                        on_run(rank, a, dep)
                    done.add(a)
                    head += 1
                progress = True
            heads[rank] = head
    return heads


def stalled(lists: Sequence[Sequence[Action]], heads: Sequence[int]) -> bool:
    """Whether a walk that returned ``heads`` left some rank with actions it could not run."""
    return any(h < len(actions) for h, actions in zip(heads, lists))
