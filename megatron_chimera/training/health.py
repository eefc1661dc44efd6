"""Stop a diverged run: NaN/Inf in the loss or gradients, or too many skipped iterations in a row.

``--check-for-nan-in-loss-and-grad`` (Megatron's flag, on by default; ``--no-...`` turns it
off): after each iteration's forward and backward, every rank looks at what it holds -- the
losses of its last stages, and (fp32/bf16; fp16 overflows are the loss scaler's business) its
reduced gradients -- and one all-reduce tells every rank the lowest rank that found a non-finite
value. That rank raises an error naming the iteration, itself and the value; the others stop
quietly naming it. Without the check a diverged run skips every step and exits 0. The losses
stay device tensors (the executor's ``local_losses``): the finiteness test runs on the device and
the all-reduce's result is the iteration's one host sync for it; the message is built only on
the rank that found the problem.

With gradient clipping on (``--clip-grad`` > 0) and no fp16 loss scaler, the optimizer computes
the global gradient norm anyway (model-parallel all-reduce and host read included), and a NaN or
Inf in any gradient -- or in a loss, through its backward -- makes that norm non-finite on every
rank: the check is then folded into it (:func:`grad_norm_covers_gradients`), costing nothing while
the run is healthy; only a non-finite norm runs the per-value search above, to name the rank and
the value (the optimizer has skipped that step). A non-finite loss whose gradient is finite
(impossible through a loss's own backward, short of a zero-weight NaN) is the one case only the
unfolded check sees.

``--max-consecutive-skipped-iterations K`` (default 100, 0: no bound): a run whose optimizer
skips K iterations in a row (fp16 gradients overflowing at every loss scale, or non-finite
gradients with the check off) stops with an error. Dynamic loss scaling from 2^32 needs at most
about 33 skips (x hysteresis) to reach a scale of 1, so 100 consecutive skips means the run
cannot take a step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from megatron_chimera.errors import StoppedByPeer, UserError

NAN_FLAG = "--check-for-nan-in-loss-and-grad"
SKIP_FLAG = "--max-consecutive-skipped-iterations"


class NonFiniteError(UserError):
    """A NaN or Inf in a loss or gradient; names the iteration, the rank and the value."""


class TrainingStalledError(UserError):
    """Too many consecutive skipped iterations; names the count and the loss scale."""


def _loss_values(local_losses: dict[int, dict[str, Any]], device: torch.device
                 ) -> tuple[list[tuple[int, str]], torch.Tensor | None]:
    """(micro-batch, name) of every loss value and the values as one float tensor on
    ``device`` (device tensors stay where they are: no host sync)."""
    names, values = [], []
    for microbatch in sorted(local_losses):
        for name, value in local_losses[microbatch].items():
            names.append((microbatch, name))
            values.append(value.detach().float().mean().to(device) if torch.is_tensor(value)
                          else torch.tensor(float(value), device=device))
    return names, (torch.stack(values) if values else None)


def _gradients(named_params: Iterable[tuple[str, torch.nn.Parameter]]
               ) -> tuple[list[tuple[str, torch.Tensor]], torch.Tensor | None]:
    # gradients live in the grad buffers' ``main_grad`` (reduced, or this rank's reduced shard
    # beside its own contributions with the distributed optimizer: a non-finite value anywhere
    # shows up on some rank); ``grad`` for parameters outside any buffer
    named = [(name, g) for name, p in named_params
             if (g := getattr(p, "main_grad", p.grad)) is not None]
    if not named:
        return named, None
    return named, torch.stack([g.detach().float().norm() for _, g in named])


def _all_finite(local_losses: dict[int, dict[str, Any]],
                named_params: list[tuple[str, torch.nn.Parameter]], check_grads: bool,
                device: torch.device) -> torch.Tensor:
    """A bool tensor on ``device``: everything this rank holds is finite (no host sync)."""
    finite = torch.ones((), dtype=torch.bool, device=device)
    _, losses = _loss_values(local_losses, device)
    if losses is not None:
        finite &= torch.isfinite(losses).all()
    if check_grads:
        _, norms = _gradients(named_params)
        if norms is not None:
            finite &= torch.isfinite(norms).all().to(device)
    return finite


def local_nonfinite(local_losses: dict[int, dict[str, Any]],
                    named_params: Iterable[tuple[str, torch.nn.Parameter]],
                    check_grads: bool) -> str | None:
    """What this rank holds that is not finite: a micro-batch loss (a float or a tensor), or
    (``check_grads``) a gradient; None when everything is finite."""
    names, losses = _loss_values(local_losses, torch.device("cpu"))
    if losses is not None:
        bad = (~torch.isfinite(losses)).nonzero()
        if len(bad):
            microbatch, name = names[int(bad[0])]
            return f"{name} is {float(losses[int(bad[0])])} in micro-batch {microbatch}"
    if not check_grads:
        return None
    named, norms = _gradients(named_params)
    if norms is None:
        return None
    bad = (~torch.isfinite(norms)).nonzero()
    if len(bad) == 0:
        return None
    name, grad = named[int(bad[0])]
    value = "nan" if torch.isnan(grad).any() else "inf"
    return f"the gradient of {name} has {value} values"


def first_rank_with(problem: bool | torch.Tensor, device: torch.device) -> int | None:
    """The lowest global rank whose ``problem`` is True (a bool, or a bool tensor on
    ``device``; one all-reduce), or None."""
    if not dist.is_initialized():
        return 0 if bool(problem) else None
    world, rank = dist.get_world_size(), dist.get_rank()
    problem = torch.as_tensor(problem, device=device)
    flag = torch.where(problem, rank, world).to(torch.int64).reshape(1)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    first = int(flag.item())
    return None if first >= world else first


def check_loss_and_grad(iteration: int, local_losses: dict[int, dict[str, Any]],
                        named_params: Iterable[tuple[str, torch.nn.Parameter]],
                        check_grads: bool, device: torch.device) -> None:
    """Collective: raise NonFiniteError on the lowest rank that found a NaN/Inf, StoppedByPeer
    on every other rank; return quietly when all is finite. ``local_losses`` are the executor's
    (device tensors) or plain floats."""
    named_params = list(named_params)
    finite = _all_finite(local_losses, named_params, check_grads, device)
    first = first_rank_with(~finite, device)
    if first is None:
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    if first != rank:
        raise StoppedByPeer(first, "found a NaN/Inf")
    problem = local_nonfinite(local_losses, named_params, check_grads)
    raise NonFiniteError(
        f"iteration {iteration}: {problem} on rank {rank} ({NAN_FLAG}: the run diverged; "
        "lower --lr or check the data, or pass --no-check-for-nan-in-loss-and-grad)")


def grad_norm_covers_gradients(optimizer) -> bool:
    """Whether the optimizer's global gradient norm stands in for the per-value NaN/Inf search
    (``optimizer``: the run's optimizer config): clipping computes it, and only without an fp16
    loss scaler (whose overflow steps have no norm)."""
    return optimizer.clip_grad > 0.0 and not optimizer.fp16


def raise_nonfinite_grad_norm(iteration: int, grad_norm: float) -> None:
    """Every rank sees the same non-finite global norm: rank 0 reports it, the others stop
    naming rank 0 (when the per-value search did not name a rank first)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank != 0:
        raise StoppedByPeer(0, "found a NaN/Inf")
    raise NonFiniteError(
        f"iteration {iteration}: the global gradient norm is {grad_norm} on rank 0 ({NAN_FLAG}: "
        "the run diverged; lower --lr or check the data, or pass "
        "--no-check-for-nan-in-loss-and-grad)")


def check_skipped(consecutive: int, bound: int, iteration: int, loss_scale: float) -> None:
    """Every rank (the skip decision is global): rank 0 raises TrainingStalledError, the others
    StoppedByPeer, once ``consecutive`` reaches ``bound`` (0: no bound)."""
    if bound <= 0 or consecutive < bound:
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank != 0:
        raise StoppedByPeer(0, "stopped the run")
    raise TrainingStalledError(
        f"iterations {iteration - consecutive + 1}-{iteration}: {consecutive} consecutive "
        f"iterations skipped (non-finite gradients; loss scale {loss_scale:g}): the run cannot "
        f"take a step ({SKIP_FLAG} {bound}); lower --lr or check the data")
