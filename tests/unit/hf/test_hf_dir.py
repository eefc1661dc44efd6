"""hf/hf_dir.py: the streaming safetensors writer against the safetensors library's reader."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from megatron_chimera.hf.common import HFError
from megatron_chimera.hf.hf_dir import SAFETENSORS_FILE, safetensors_writer, write_dir


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 4, generator=generator)
    return {
        "fp32": weight,
        "transposed": weight.t(),  # not contiguous, and shares the storage of "fp32"
        "row": weight[2],  # a view into the same storage, at an offset
        "bf16": torch.randn(3, 5, generator=generator).to(torch.bfloat16),
        "fp16": torch.randn(7, generator=generator).half(),
        "int64": torch.arange(-3, 9, dtype=torch.int64).view(3, 4),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(2.5),
    }


def test_streamed_file_reads_back_with_the_library(tmp_path):
    tensors = _tensors()
    write_dir(str(tmp_path / "hf"), {SAFETENSORS_FILE: safetensors_writer(tensors)})
    path = tmp_path / "hf" / SAFETENSORS_FILE
    loaded = load_file(str(path))
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape, name
        assert torch.equal(loaded[name], tensor), name
    with safe_open(str(path), framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}  # what transformers checks
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    assert length % 8 == 0  # the data starts 8-byte aligned
    header = json.loads(raw[8:8 + length])
    ends = sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
    assert ends[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ends, ends[1:]))
    assert len(raw) == 8 + length + ends[-1][1]  # no holes, nothing after the last tensor


def test_a_dtype_safetensors_cannot_name_is_one_error():
    with pytest.raises(HFError, match="complex"):
        safetensors_writer({"z": torch.zeros(2, dtype=torch.complex64)})
