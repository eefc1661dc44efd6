"""Loss scalers for fp16 training (Megatron's ``ConstantGradScaler`` and ``DynamicGradScaler``)."""

from __future__ import annotations

from typing import Any


class MegatronGradScaler:
    """A loss scale; ``update(found_inf)`` is called once per optimizer step."""

    def __init__(self, initial_scale: float) -> None:
        if initial_scale <= 0:
            raise ValueError(f"loss scale must be positive, got {initial_scale}")
        self._scale = float(initial_scale)

    @property
    def scale(self) -> float:
        """The current loss scale."""
        return self._scale

    @property
    def inv_scale(self) -> float:
        """1 / scale, applied to the gradients before the optimizer step."""
        return 1.0 / self._scale

    def update(self, found_inf: bool) -> None:
        """Adjust the scale after a step (no-op for a constant scale)."""

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state."""
        return {"scale": self._scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict`."""
        self._scale = float(state["scale"])


class ConstantGradScaler(MegatronGradScaler):
    """A fixed loss scale (``--loss-scale``)."""


class DynamicGradScaler(MegatronGradScaler):
    """Megatron's dynamic scale: x``growth_factor`` after ``growth_interval`` clean steps in a
    row; the ``hysteresis``-th overflow since the last growth (not necessarily in a row) and
    every one after it multiply the scale by ``backoff_factor``, never below ``min_scale``."""

    def __init__(self, initial_scale: float = 2.0**32, min_scale: float = 1.0,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 1000, hysteresis: int = 2) -> None:
        super().__init__(initial_scale)
        if not 0 < min_scale <= initial_scale:
            raise ValueError(f"--min-loss-scale {min_scale} must be in (0, initial scale]")
        if growth_factor <= 1.0 or not 0.0 < backoff_factor < 1.0:
            raise ValueError("growth factor must be > 1 and backoff factor in (0, 1)")
        if growth_interval < 1:
            raise ValueError(f"--loss-scale-window must be >= 1, got {growth_interval}")
        if hysteresis < 1:
            raise ValueError(f"--hysteresis must be >= 1, got {hysteresis}")
        self.min_scale = float(min_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        """Megatron's state machine: back off on overflow once hysteresis is used up, grow after a
        window of clean steps (which also restores the hysteresis)."""
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale *= self.growth_factor

    def state_dict(self) -> dict[str, Any]:
        """Scale and both trackers."""
        return {"scale": self._scale, "growth_tracker": self._growth_tracker,
                "hysteresis_tracker": self._hysteresis_tracker}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict`."""
        self._scale = float(state["scale"])
        self._growth_tracker = int(state["growth_tracker"])
        self._hysteresis_tracker = int(state["hysteresis_tracker"])
