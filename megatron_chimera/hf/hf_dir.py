"""Reading a Hugging Face model directory safely, and writing one atomically.

Reading: ``config.json`` plus ``model.safetensors``, ``pytorch_model.bin`` or their sharded
``*.index.json`` forms; ``.bin`` files are opened with ``torch.load(weights_only=True)`` (no code
runs), safetensors with ``safetensors.torch.load_file``. Writing: every file goes into a staging
directory (temp file, fsync, rename each), which is renamed into place only when complete.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
from collections.abc import Callable
from typing import IO, Any

import torch

from megatron_chimera.atomic import atomic_write
from megatron_chimera.hf.common import HFError

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
WEIGHT_FILES = (SAFETENSORS_FILE, "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def require_transformers() -> Any:
    """The ``transformers`` module, or HFError telling how to install it."""
    try:
        import transformers
    except ImportError:
        raise HFError("this needs the `transformers` package: pip install -e '.[hf]'") from None
    return transformers


def read_config(hf_dir: str) -> dict[str, Any]:
    """The parsed ``config.json`` of ``hf_dir``; HFError naming the path when absent or corrupt."""
    if not os.path.isdir(hf_dir):
        raise HFError(f"--hf-dir {hf_dir}: not a directory")
    path = os.path.join(hf_dir, CONFIG_FILE)
    if not os.path.isfile(path):
        raise HFError(f"--hf-dir {hf_dir}: no {CONFIG_FILE} (expected a directory written by "
                      "save_pretrained)")
    try:
        with open(path, encoding="utf-8") as handle:
            raw = json.load(handle)
    except (ValueError, UnicodeDecodeError) as exc:
        raise HFError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise HFError(f"{path}: no model_type field")
    return raw


def _load_safetensors(path: str) -> dict[str, torch.Tensor]:
    try:
        from safetensors import SafetensorError
        from safetensors.torch import load_file
    except ImportError:
        raise HFError("reading safetensors needs the `safetensors` package: "
                      "pip install -e '.[hf]'") from None
    try:
        return load_file(path, device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise HFError(f"{path}: corrupt or truncated safetensors file ({exc})") from None


def _load_bin(path: str) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises many types for corrupt files
        raise HFError(f"{path}: corrupt, truncated or not a weights-only state dict "
                      f"({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
        raise HFError(f"{path}: expected a state dict of tensors")
    return state


def _load_one(path: str) -> dict[str, torch.Tensor]:
    if not os.path.isfile(path):
        raise HFError(f"{path}: missing")
    return _load_safetensors(path) if path.endswith(".safetensors") else _load_bin(path)


def _load_sharded(index_path: str) -> dict[str, torch.Tensor]:
    try:
        with open(index_path, encoding="utf-8") as handle:
            weight_map = json.load(handle)["weight_map"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise HFError(f"{index_path}: not a valid shard index ({exc})") from None
    tensors: dict[str, torch.Tensor] = {}
    folder = os.path.dirname(index_path)
    for shard in sorted(set(weight_map.values())):
        tensors.update(_load_one(os.path.join(folder, shard)))
    missing = sorted(set(weight_map) - set(tensors))
    if missing:
        raise HFError(f"{index_path}: tensors listed but not in the shards: {missing[:5]}")
    return tensors


def read_weights(hf_dir: str) -> tuple[dict[str, torch.Tensor], str]:
    """All tensors of ``hf_dir`` and the file they came from (safetensors preferred)."""
    for name in WEIGHT_FILES:
        path = os.path.join(hf_dir, name)
        if os.path.isfile(path):
            tensors = _load_sharded(path) if name.endswith(".index.json") else _load_one(path)
            return tensors, path
    raise HFError(f"--hf-dir {hf_dir}: no weights (looked for {', '.join(WEIGHT_FILES)})")


# safetensors' names of the dtypes a model holds (its format specification)
_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}


def safetensors_writer(tensors: dict[str, torch.Tensor]) -> Callable[[IO[bytes]], None]:
    """A function writing ``tensors`` to an open binary file as one safetensors file, one tensor
    at a time: the header first (the layout follows from the shapes), then each tensor's bytes.
    Unlike ``safetensors.torch.save``, which returns the whole file as one ``bytes`` (after a
    contiguous copy of every tensor), the writer holds at most one tensor's copy; tensors
    sharing storage are written apart."""
    if sys.byteorder != "little":
        raise HFError("writing safetensors (little-endian) needs a little-endian machine")
    layout: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in _SAFETENSORS_DTYPES:
            raise HFError(f"{name}: safetensors has no dtype {tensor.dtype}")
        size = tensor.numel() * tensor.element_size()
        layout[name] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    header = json.dumps(layout, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the format pads the header to 8 bytes with spaces

    def write(handle: IO[bytes]) -> None:
        handle.write(struct.pack("<Q", len(header)))
        handle.write(header)
        for tensor in tensors.values():
            flat = tensor.detach().cpu().contiguous().reshape(-1)
            if flat.numel():
                handle.write(flat.view(torch.uint8).numpy().data)

    return write


def write_dir(hf_dir: str, files: dict[str, bytes | Callable[[IO[bytes]], None]],
              overwrite: bool = False) -> None:
    """Write ``files`` (name -> bytes, or a function writing them to an open file) as the
    directory ``hf_dir``, atomically: a staging directory renamed into place when complete. An
    existing non-empty ``hf_dir`` is replaced only with ``overwrite``."""
    hf_dir = os.path.abspath(hf_dir)
    if os.path.isdir(hf_dir) and os.listdir(hf_dir) and not overwrite:
        raise HFError(f"--hf-dir {hf_dir} exists and is not empty (pass --overwrite to "
                      "replace it)")
    if os.path.exists(hf_dir) and not os.path.isdir(hf_dir):
        raise HFError(f"--hf-dir {hf_dir} exists and is not a directory")
    parent = os.path.dirname(hf_dir)
    os.makedirs(parent, exist_ok=True)
    staging, previous = f"{hf_dir}.staging{os.getpid()}", f"{hf_dir}.old{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    try:
        for name, data in files.items():
            atomic_write(os.path.join(staging, name),
                         data if callable(data) else lambda handle, d=data: handle.write(d))
        if os.path.isdir(hf_dir):
            os.replace(hf_dir, previous)
        os.replace(staging, hf_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(previous, ignore_errors=True)

