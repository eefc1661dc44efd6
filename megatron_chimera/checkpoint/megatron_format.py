"""Recognise a Megatron-LM checkpoint directory and open its pickled files without running code.

Megatron-LM writes the same tracker as we do (``latest_checkpointed_iteration.txt``, holding an
iteration or ``release``) over one of two layouts:

* ``torch_dist`` (Megatron-core ``dist_checkpointing``): ``iter_0000007/`` holds ``.metadata``,
  ``__*_*.distcp``, ``common.pt`` (the non-tensor state: ``args``, ``iteration``, ...) and
  ``metadata.json`` (``{"sharded_backend": "torch_dist", ...}``);
* ``torch`` (legacy): ``iter_0000007/mp_rank_TT/model_optim_rng.pt``, or ``mp_rank_TT_PPP`` with
  pipeline parallelism, one file per (tensor, pipeline) rank.

Our own checkpoints never write ``metadata.json`` nor ``mp_rank_*`` directories, which is how the
two are told apart. Their ``.pt`` files pickle an ``argparse.Namespace`` (``args``), numpy's RNG
state, Transformer Engine's ``_extra_state`` and, in newer versions, Megatron enums:
:func:`load_megatron_file` reads them with ``torch.load(weights_only=True)`` and an explicit
allow-list (the enums load as stand-in strings, Megatron need not be installed), so a file that
holds anything else is refused, never executed.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import zipfile
from dataclasses import dataclass
from typing import IO, Any

import numpy as np
import torch

from megatron_chimera.errors import ConfigError, UserError

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
METADATA_JSON = "metadata.json"
LEGACY_FILENAME = "model_optim_rng.pt"
FORMAT_MEGATRON_DIST = "torch_dist"
FORMAT_MEGATRON_LEGACY = "torch"
_MP_RANK = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?")
# Megatron enums a saved Namespace may hold (e.g. ``args.attention_backend``)
_MEGATRON_ENUMS = (
    "megatron.core.transformer.enums.AttnBackend", "megatron.core.transformer.enums.AttnMaskType",
    "megatron.core.transformer.enums.AttnType", "megatron.core.transformer.enums.ModelType",
    "megatron.core.transformer.enums.LayerType", "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.enums.ModelType", "megatron.core.enums.Fp8Recipe",
    "megatron.core.enums.Fp4Recipe",
)


class MegatronCheckpointError(UserError, ValueError):
    """A Megatron-LM checkpoint we cannot read or convert; the message names the file (and the
    tensor or argument) concerned (exit code 2: the tools' input)."""

    exit_code = 2


@dataclass(frozen=True)
class MegatronCheckpoint:
    """Where one iteration of a Megatron-LM checkpoint lies and in which layout."""

    root: str  # the directory given (holding the tracker), or the iteration directory itself
    path: str  # the iteration directory (``iter_0000007`` or ``release``)
    format: str  # FORMAT_MEGATRON_DIST or FORMAT_MEGATRON_LEGACY
    iteration: int | None  # None for a release checkpoint

    @property
    def describe(self) -> str:
        """``Megatron-LM torch_dist checkpoint (iteration 7)``."""
        it = "release" if self.iteration is None else f"iteration {self.iteration}"
        return f"Megatron-LM {self.format} checkpoint ({it})"


def _iteration_layout(path: str) -> str | None:
    """The Megatron layout of an iteration directory, or None when it is not one."""
    meta = os.path.join(path, METADATA_JSON)
    if os.path.isfile(meta):
        try:
            with open(meta) as handle:
                backend = json.load(handle).get("sharded_backend")
        except (OSError, ValueError, AttributeError):
            raise MegatronCheckpointError(f"{meta}: not a readable Megatron-core metadata.json "
                                          "(corrupt or truncated)") from None
        if backend != FORMAT_MEGATRON_DIST:
            raise MegatronCheckpointError(f"{meta}: sharded_backend {backend!r} is not supported "
                                          f"(only {FORMAT_MEGATRON_DIST!r})")
        return FORMAT_MEGATRON_DIST
    if any(name.startswith("mp_rank_") for name in os.listdir(path)):
        return FORMAT_MEGATRON_LEGACY
    return None


def _iteration_of(name: str) -> int | None:
    match = re.fullmatch(r"iter_(\d{7})", name)
    return int(match.group(1)) if match else None


def find_megatron_checkpoint(path: str) -> MegatronCheckpoint | None:
    """The Megatron-LM checkpoint at ``path`` (a directory with Megatron's tracker, or one
    iteration directory), or None when ``path`` is not one (e.g. one of ours)."""
    if not os.path.isdir(path):
        return None
    tracker = os.path.join(path, TRACKER_FILENAME)
    if os.path.isfile(tracker):
        text = open(tracker).read().strip()
        name = "release" if text == "release" else (
            f"iter_{int(text):07d}" if text.isdigit() else None)
        if name is None or not os.path.isdir(os.path.join(path, name)):
            return None
        layout = _iteration_layout(os.path.join(path, name))
        return (MegatronCheckpoint(path, os.path.join(path, name), layout, _iteration_of(name))
                if layout else None)
    layout = _iteration_layout(path)
    if layout is None:
        return None
    return MegatronCheckpoint(path, path, layout, _iteration_of(os.path.basename(
        os.path.normpath(path))))


def conversion_hint(checkpoint: MegatronCheckpoint, flag: str = "--load") -> str:
    """One line: what ``path`` is and the command that converts it."""
    root = checkpoint.root.rstrip("/")
    return (f"{flag} {checkpoint.root} is a {checkpoint.describe}, not one of ours: convert it "
            f"first with `python tools/checkpoint/convert.py import-megatron --load {root} "
            f"--save {root}-chimera`, then pass {flag} {root}-chimera")


def _enum_standin(qualified: str) -> Any:
    """A callable that stands for the Megatron enum ``qualified`` while unpickling: ``Enum(v)``
    becomes the string ``"AttnBackend(5)"``."""
    short = qualified.rsplit(".", 1)[1]

    def standin(value: Any) -> str:
        return f"{short}({value!r})"

    return standin


def _safe_globals() -> list[Any]:
    """The allow-list: ``argparse.Namespace``, ``io.BytesIO`` (Transformer Engine's
    ``_extra_state`` in older versions: bytes, never unpickled here), numpy's array
    reconstruction for the RNG state (both numpy module spellings) and stand-ins for Megatron
    enums."""
    try:
        from numpy._core.multiarray import _reconstruct  # noqa: PLC0415 - numpy >= 2
    except ImportError:  # numpy 1.x
        from numpy.core.multiarray import _reconstruct  # noqa: PLC0415

    dtype_types = [type(np.dtype(t)) for t in (np.uint32, np.int64, np.float64)]
    allowed: list[Any] = [argparse.Namespace, io.BytesIO, np.ndarray, np.dtype, *dtype_types,
                          (_reconstruct, "numpy.core.multiarray._reconstruct"),
                          (_reconstruct, "numpy._core.multiarray._reconstruct")]
    allowed += [(_enum_standin(name), name) for name in _MEGATRON_ENUMS]
    return allowed


def damaged_zip_member(source: str | IO[bytes]) -> str | None:
    """The first record of a ``torch.save`` zip (a file, or the bytes of one DCP chunk) whose
    CRC-32 does not match its data, "(unreadable)" for a broken archive, None when it is intact.
    ``torch.load`` does not check these CRCs, so zeroed or flipped bytes inside a tensor would load
    silently (Megatron's formats carry no other checksum)."""
    try:
        with zipfile.ZipFile(source) as archive:
            return archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError):
        return "(unreadable)"


def load_megatron_file(path: str, mmap: bool = False, check: bool = True) -> Any:
    """``torch.load(weights_only=True)`` of one Megatron ``.pt`` file with the allow-list, after
    checking its records' CRC-32 (``check``: False when this process checked it already); a
    missing, truncated or corrupt file, or one holding an object outside the allow-list, is one
    MegatronCheckpointError line naming the file."""
    if not os.path.isfile(path):
        raise MegatronCheckpointError(f"Megatron checkpoint file {path} is missing")
    damaged = damaged_zip_member(path) if check else None
    if damaged is not None and damaged != "(unreadable)":  # unreadable: torch.load explains
        raise MegatronCheckpointError(f"Megatron checkpoint file {path} is corrupt: record "
                                      f"{damaged} fails its CRC-32 check")
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:  # noqa: BLE001 - torch raises many types for corrupt files
        text = str(exc)
        unsupported = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
        if unsupported:
            raise MegatronCheckpointError(
                f"Megatron checkpoint file {path} holds a Python object of type "
                f"{unsupported.group(1)}, which the converter's allow-list does not cover "
                "(it never runs arbitrary pickled code)") from None
        detail = text.strip().splitlines()[0] if text.strip() else ""
        detail = detail if len(detail) <= 120 else detail[:117] + "..."
        raise MegatronCheckpointError(f"Megatron checkpoint file {path} is corrupt or truncated "
                                      f"({type(exc).__name__}: {detail})") from None


def legacy_rank_files(path: str) -> dict[tuple[int, int], str]:
    """``{(tensor rank, pipeline rank): model_optim_rng.pt}`` of a legacy iteration directory;
    the grid must be complete (T x P files)."""
    found: dict[tuple[int, int], str] = {}
    suffixed = False  # named mp_rank_TT_PPP (pipeline parallel) rather than mp_rank_TT
    expert = sorted(n for n in os.listdir(path) if re.fullmatch(r"mp_rank_\d{2}_\d{3}_\d{3}", n))
    if expert:
        raise MegatronCheckpointError(f"{path}: an expert-parallel (MoE) checkpoint ({expert[0]}, "
                                      "...) is not supported; our GPT model has no experts")
    for name in sorted(os.listdir(path)):
        match = _MP_RANK.fullmatch(name)
        if match:
            rank = (int(match.group(1)), int(match.group(2) or 0))
            suffixed = suffixed or match.group(2) is not None
            found[rank] = os.path.join(path, name, LEGACY_FILENAME)
    if not found:
        raise MegatronCheckpointError(f"{path}: no mp_rank_TT or mp_rank_TT_PPP directories")
    tensor, pipeline = _saved_grid(found[min(found)])
    tensor = max(tensor or 0, 1 + max(t for t, _ in found))
    pipeline = max(pipeline or 0, 1 + max(p for _, p in found))
    missing = [os.path.join(f"mp_rank_{t:02d}" + (f"_{p:03d}" if pipeline > 1 or suffixed else ""),
                            LEGACY_FILENAME)
               for t in range(tensor) for p in range(pipeline) if (t, p) not in found]
    if missing:
        raise MegatronCheckpointError(f"{path}: incomplete legacy checkpoint, missing "
                                      f"{', '.join(missing)} of its T={tensor} x P={pipeline} "
                                      "(tensor x pipeline) grid")
    return found


def _saved_grid(filename: str) -> tuple[int | None, int | None]:
    """(T, P) that the Megatron run which wrote ``filename`` recorded in its ``args`` (None
    where it recorded none), so a missing rank's file is named even at the grid's edge."""
    args = load_megatron_file(filename, mmap=True, check=False).get("args")
    return (getattr(args, "tensor_model_parallel_size", None),
            getattr(args, "pipeline_model_parallel_size", None))


def refuse_megatron_checkpoint(path: str | None, flag: str = "--load") -> None:
    """ConfigError with the converting command when ``path`` is a Megatron-LM checkpoint
    (training reads only ours; ``import-megatron`` converts, any layout)."""
    if path is None:
        return
    found = find_megatron_checkpoint(path)
    if found is not None:
        raise ConfigError(conversion_hint(found, flag))
