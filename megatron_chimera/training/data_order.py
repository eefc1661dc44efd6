"""The data order across a resume: global batch i holds the same samples whatever the layout.

Megatron's bookkeeping makes global batch i the samples ``[c + i·G, c + (i+1)·G)`` after
``c`` consumed samples, whatever the data-parallel size, tensor size, pipeline or schedule
(``data/samplers.py``: a replica's micro-batches interleave by data-parallel rank). The one thing
that changes the grouping is the global batch size G itself: a resume with another G (and no
ramp-up, which plans its sizes from the consumed samples) would train other batches than the
uninterrupted run; it is refused, or allowed and logged with ``--allow-data-order-change``.
"""

from __future__ import annotations

from typing import Any

from megatron_chimera.config import ConfigError, TrainConfig
from megatron_chimera.training.varlen import check_packing_resume


def check_data_order(config: TrainConfig, saved_args: dict[str, Any], path: str
                     ) -> str | None:
    """ConfigError naming both values when resuming ``path`` with another global batch size
    (no ramp-up) or another packing (``--variable-seq-lengths``); with
    ``--allow-data-order-change`` the line to log instead (None: same order)."""
    packing = check_packing_resume(config, saved_args, path)
    if packing is not None:
        return packing
    training = config.training
    saved = (saved_args.get("training") or {}).get("global_batch_size")
    ramp = training.rampup_batch_size or (saved_args.get("training") or {}).get(
        "rampup_batch_size")
    if saved is None or saved == training.global_batch_size or ramp:
        return None
    what = (f"--global-batch-size {training.global_batch_size} differs from the checkpoint's "
            f"{saved} ({path})")
    if not training.allow_data_order_change:
        raise ConfigError(
            f"{what}: global batches after the resume would group the samples differently from "
            f"the uninterrupted run; keep --global-batch-size {saved}, use --rampup-batch-size, "
            "or pass --allow-data-order-change")
    return (f" data order changed on purpose: {what}; training continues after the checkpoint's "
            f"consumed samples, 0 samples skipped or repeated, in batches of "
            f"{training.global_batch_size} instead of {saved}")
