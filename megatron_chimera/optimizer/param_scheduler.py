"""Learning-rate schedule counted in samples, as Megatron's ``OptimizerParamScheduler``.

Linear warmup from 0 to ``max_lr`` over ``lr_warmup_samples``, then constant, linear or cosine
decay to ``min_lr`` at ``lr_decay_samples`` (and ``min_lr`` after it).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from megatron_chimera.config import ConfigError, OptimizerConfig

logger = logging.getLogger(__name__)

DECAY_STYLES = ("constant", "linear", "cosine")


class OptimizerParamScheduler:
    """Sets ``lr`` on every param group of ``optimizer``; ``step(increment)`` advances by
    ``increment`` samples (the global batch size per iteration)."""

    def __init__(self, optimizer, max_lr: float, min_lr: float, lr_warmup_samples: int,
                 lr_decay_samples: int, lr_decay_style: str) -> None:
        if lr_decay_style not in DECAY_STYLES:
            raise ConfigError(f"--lr-decay-style must be one of {DECAY_STYLES}, "
                              f"got {lr_decay_style!r}")
        if not 0.0 <= min_lr <= max_lr:
            raise ConfigError(f"--min-lr {min_lr} must be in [0, --lr {max_lr}]")
        if lr_decay_samples <= 0:
            raise ConfigError(f"--lr-decay-samples must be positive, got {lr_decay_samples}")
        if not 0 <= lr_warmup_samples < lr_decay_samples and lr_decay_style != "constant":
            raise ConfigError(f"--lr-warmup-samples {lr_warmup_samples} must be in "
                              f"[0, --lr-decay-samples {lr_decay_samples})")
        self.optimizer = optimizer
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        self.lr_warmup_samples = int(lr_warmup_samples)
        self.lr_decay_samples = int(lr_decay_samples)
        self.lr_decay_style = lr_decay_style
        self.num_samples = 0
        self.step(0)

    @classmethod
    def from_config(cls, optimizer, config: OptimizerConfig,
                    train_samples: int) -> OptimizerParamScheduler:
        """Megatron's defaults: decay over ``train_samples`` unless ``--lr-decay-samples`` is set;
        warmup from ``--lr-warmup-fraction`` (of the decay) or ``--lr-warmup-samples``."""
        decay = config.lr_decay_samples or train_samples
        fraction = config.lr_warmup_fraction
        warmup = int(fraction * decay) if fraction is not None else config.lr_warmup_samples
        return cls(optimizer, config.lr, config.min_lr, warmup, decay, config.lr_decay_style)

    def get_lr(self) -> float:
        """Learning rate after ``num_samples`` samples."""
        n = self.num_samples
        if self.lr_warmup_samples > 0 and n <= self.lr_warmup_samples:
            return self.max_lr * n / self.lr_warmup_samples
        if self.lr_decay_style == "constant":
            return self.max_lr
        if n > self.lr_decay_samples:
            return self.min_lr
        ratio = (n - self.lr_warmup_samples) / (self.lr_decay_samples - self.lr_warmup_samples)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def step(self, increment: int) -> float:
        """Advance by ``increment`` samples and set the new LR on the optimizer; returns it."""
        self.num_samples += int(increment)
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def state_dict(self) -> dict[str, Any]:
        """Schedule settings and position."""
        return {"max_lr": self.max_lr, "min_lr": self.min_lr,
                "lr_warmup_samples": self.lr_warmup_samples,
                "lr_decay_samples": self.lr_decay_samples,
                "lr_decay_style": self.lr_decay_style, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the position; the schedule itself comes from this run's flags (a difference
        from the checkpoint's is logged)."""
        for key in ("max_lr", "min_lr", "lr_warmup_samples", "lr_decay_samples",
                    "lr_decay_style"):
            if state.get(key) != getattr(self, key):
                logger.warning("LR schedule: %s is %r in the checkpoint, using %r from the flags",
                               key, state.get(key), getattr(self, key))
        self.num_samples = 0
        self.step(int(state["num_samples"]))
