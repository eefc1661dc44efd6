"""The model's validated error for the nearest published configuration family, for
``tools/autotune.py --predict`` to print next to every prediction.

Families and the published rows that score them (``tools/validate_perf_model.py --published``):
``pure PP`` (Qi et al. ICLR'24 Table 4: pipeline only), ``3D`` (Narayanan et al. SC'21 Tables 1
and 2: tensor x pipeline x data), ``FP8`` (:mod:`megatron_chimera.tuning.published_fp8`),
``Chimera`` and ``MoE`` (no published rows yet: the nearest structural family -- pure PP or 3D --
stands in, and the line says so).

The errors are computed by the validation tool (about a minute) and cached in
``published_errors.json`` with a fingerprint of the files that decide them (the cost model, the
schedules, the FLOP and memory counts); :func:`load_errors` reports a stale cache and
``tests/unit/test_fp8_model.py`` fails on one. Refresh: ``python tools/validate_perf_model.py
--published --write-error-cache``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from megatron_chimera.atomic import atomic_write
from megatron_chimera.tuning.analytic_costs import ModelSpec
from megatron_chimera.tuning.training_plan import TrainingPlan

FAMILIES = ("pure PP", "3D", "Chimera", "MoE", "FP8")
CACHE = Path(__file__).with_name("published_errors.json")
PACKAGE = Path(__file__).resolve().parents[1]
# the files whose change can move a validated error (relative to the package)
FINGERPRINTED = ("tuning/*.py", "schedules/*.py", "model/flops.py", "model/memory.py",
                 "model/partition.py", "model/presets.py", "model/family.py",
                 "model/stage_split.py", "config/model.py")
NOT_FINGERPRINTED = ("tuning/autotune.py", "tuning/command.py", "tuning/playground.py",
                     "tuning/profile.py", "tuning/emulated_validation.py", "tuning/error_bars.py")
REFRESH = "python tools/validate_perf_model.py --published --write-error-cache"


def fingerprint() -> str:
    """SHA-256 over the fingerprinted files' paths and contents."""
    digest = hashlib.sha256()
    paths = sorted({p for pattern in FINGERPRINTED for p in PACKAGE.glob(pattern)})
    for path in paths:
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in NOT_FINGERPRINTED:
            continue
        digest.update(rel.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def family_record(source: str, errors: list[float]) -> dict[str, object]:
    """One family's entry: its source, row count, mean and worst relative error."""
    return {"source": source, "rows": len(errors), "mean_error": sum(errors) / len(errors),
            "worst_error": max(errors)}


def write_errors(families: dict[str, dict[str, object]]) -> None:
    """Write the cache (atomically) with the current fingerprint."""
    record = {"fingerprint": fingerprint(), "refresh": REFRESH, "families": families}
    atomic_write(str(CACHE), lambda f: json.dump(record, f, indent=1, sort_keys=True), mode="w")


def load_errors() -> tuple[dict[str, dict[str, object]], bool]:
    """(families, stale): the cached errors and whether the model changed since they were
    computed ({} and True without a cache)."""
    if not CACHE.is_file():
        return {}, True
    record = json.loads(CACHE.read_text())
    return record["families"], record["fingerprint"] != fingerprint()


def structural_family(layout: TrainingPlan) -> str:
    """``pure PP`` (one pipeline, no T / CP / W) or ``3D``."""
    return "pure PP" if layout.T == 1 and layout.CP == 1 and layout.W == 1 else "3D"


def nearest_family(spec: ModelSpec, layout: TrainingPlan) -> str:
    """The family a prediction belongs to: FP8, MoE, Chimera, or its structural family."""
    if spec.fp8 is not None:
        return "FP8"
    if spec.config.moe.enabled:
        return "MoE"
    if layout.schedule.startswith("chimera"):
        return "Chimera"
    return structural_family(layout)


def describe_error(spec: ModelSpec, layout: TrainingPlan) -> str:
    """One line: the validated error of the prediction's family (or of the nearest family that
    has published rows), and whether the cache is stale."""
    families, stale = load_errors()
    family = nearest_family(spec, layout)
    used, note = family, ""
    entry = families.get(family)
    if not entry or not entry.get("rows"):
        used = structural_family(layout)
        entry = families.get(used)
        note = f"no published {family} rows validated; nearest family {used}: "
    if not entry:
        return f"validated error: unknown (no error cache; run {REFRESH})"
    line = (f"validated error ({note or f'family {used}: '}{entry['source']}, {entry['rows']} "
            f"rows): mean {100 * float(entry['mean_error']):.1f}%, worst "
            f"{100 * float(entry['worst_error']):.1f}%")
    return line + (f" [stale cache: the model changed; run {REFRESH}]" if stale else "")
