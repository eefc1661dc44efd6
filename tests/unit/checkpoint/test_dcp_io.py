"""dcp_io: chunks written as raw bytes (and read back by box), older torch.save chunks still
read, the cached save plan followed when the chunks change."""

from __future__ import annotations

import os
import re

import pytest  # noqa: F401
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from megatron_chimera.checkpoint.dcp_io import (
    RAW,
    ChunkSavePlanner,
    SaveChunk,
    failure_message,
    load_chunks,
    read_metadata,
    save_chunks,
)


def _chunks(seed: int, rows: int = 6) -> dict:
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(rows, 5, generator=g)
    return {("w", (0, 0)): SaveChunk((rows, 5), full[:2].clone()),
            ("w", (2, 0)): SaveChunk((rows, 5), full[2:].clone()),
            ("b", (0,)): SaveChunk((7,), torch.randn(7, generator=g).to(torch.bfloat16)),
            ("step", ()): SaveChunk((), torch.tensor(3.0))}


def _read_back(path: str, chunks: dict) -> dict:
    """Every saved tensor whole, plus a box straddling the two chunks of ``w``."""
    rows = chunks[("w", (0, 0))].global_size[0]
    out = {"w": torch.zeros(rows, 5), "b": torch.zeros(7, dtype=torch.bfloat16),
           "step": torch.zeros(()), "box": torch.zeros(3, 2)}
    load_chunks(path, {("w", (0, 0)): out["w"], ("b", (0,)): out["b"],
                       ("step", ()): out["step"]})
    load_chunks(path, {("w", (1, 2)): out["box"]})
    return out


def _check(out: dict, chunks: dict) -> None:
    full = torch.cat([chunks[("w", (0, 0))].tensor, chunks[("w", (2, 0))].tensor])
    assert torch.equal(out["w"], full)
    assert torch.equal(out["box"], full[1:4, 2:4])
    assert torch.equal(out["b"], chunks[("b", (0,))].tensor)
    assert out["step"].item() == 3.0


def test_chunks_are_raw_bytes_and_read_back_by_box(tmp_path):
    chunks = _chunks(0)
    save_chunks(str(tmp_path), chunks)
    infos = read_metadata(str(tmp_path)).storage_data.values()
    assert all(list(info.transform_descriptors) == [RAW] for info in infos)
    # the file holds the values and nothing else
    assert os.path.getsize(tmp_path / "__0_0.distcp") == \
        sum(c.tensor.numel() * c.tensor.element_size() for c in chunks.values())
    _check(_read_back(str(tmp_path), chunks), chunks)


def test_older_torch_save_chunks_still_load(tmp_path):
    chunks = _chunks(1)
    dcp.save({}, storage_writer=FileSystemWriter(str(tmp_path)),
             planner=ChunkSavePlanner(chunks), no_dist=True)
    assert not any(getattr(i, "transform_descriptors", None)
                   for i in read_metadata(str(tmp_path)).storage_data.values())
    _check(_read_back(str(tmp_path), chunks), chunks)


def test_an_unknown_chunk_encoding_is_refused(tmp_path):
    import pickle

    chunks = _chunks(2)
    save_chunks(str(tmp_path), chunks)
    metadata = read_metadata(str(tmp_path))
    for info in metadata.storage_data.values():
        info.transform_descriptors = ["zstd"]
    with open(tmp_path / ".metadata", "wb") as handle:
        pickle.dump(metadata, handle)
    with pytest.raises(BaseException) as info:  # DCP wraps it in a CheckpointException
        _read_back(str(tmp_path), chunks)
    assert re.search(r"__0_0.distcp: chunk of w .* \(unsupported chunk encoding \['zstd'\]\)",
                     failure_message(info.value))


def test_a_save_like_the_last_reuses_its_plan_and_a_changed_one_is_planned(tmp_path,
                                                                           monkeypatch):
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    planned = []
    real = DefaultSavePlanner._create_global_plan
    monkeypatch.setattr(DefaultSavePlanner, "_create_global_plan",
                        lambda self, plans: planned.append(1) or real(self, plans))
    first, same, other = _chunks(3), _chunks(4), _chunks(5, rows=8)
    counts = []
    for name, chunks in (("a", first), ("b", same), ("c", other), ("d", first)):
        save_chunks(str(tmp_path / name), chunks)
        counts.append(len(planned))
        _check(_read_back(str(tmp_path / name), chunks), chunks)
    # "b" has the chunks of "a" (other values): no plan sent, none made
    assert counts[1] == counts[0] and counts[2] == counts[1] + 1 and counts[3] == counts[2] + 1
