"""The tensors of a ``torch_dist`` checkpoint: every rank writes and reads only its own pieces.

Megatron's ``torch_dist`` format on torch.distributed.checkpoint (:mod:`.dcp_io`). Every tensor is
stored at its layout-independent master shape under one name:

* ``model/<global name>`` -- a weight or buffer; a rank writes its tensor-parallel shard (a
  stage's replicas offer the same chunks and DCP writes each once, spread over the holders);
* ``optim/<global name>/<key>`` -- the optimizer state of a parameter (Adam's moments,
  ``main_param``) as the flattened ranges each rank holds (the distributed optimizer's fragments,
  the whole shard otherwise), cut into rectangles of the master tensor; per-parameter scalars
  (``step``) under the same prefix, 0-dimensional;
* the tied word embedding (and its state) under ``tied_word_embeddings`` wherever it is held;
* an MoE layer's experts (and their state) as the whole layer's ``[num_experts, ...]`` stacks,
  each expert-parallel rank writing and reading the rows of its own experts (any EP loads).

A load asks, per tensor, for the rectangles of this rank's shards and fragments in the new
layout; DCP reads only the saved chunks overlapping them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from megatron_chimera.checkpoint.chunks import master_chunks, spec_of
from megatron_chimera.checkpoint.dcp_io import (
    ChunkKey,
    SaveChunk,
    check_requests,
    load_chunks,
)
from megatron_chimera.checkpoint.safe_reader import read_metadata
from megatron_chimera.checkpoint.stages import (
    StageSlice,
    global_name,
    shared_embedding_name,
    stage_named_parameters,
)
from megatron_chimera.optimizer.param_state import ParamFragments

TIED_NAME = "tied_word_embeddings"
FORMAT = "torch_dist"


def stored_names(stage: StageSlice) -> dict[str, str]:
    """Global name -> stored name of every tensor of the stage's state dict."""
    tied, start = shared_embedding_name(stage), stage.layer_range[0]
    names = {}
    for local in stage.module.state_dict(keep_vars=True):
        name = global_name(local, start)
        names[name] = TIED_NAME if name == tied else name
    return names


def _host(tensor: torch.Tensor, copy: bool) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True) if copy else tensor.detach().cpu()


def collect_save_chunks(stages: list[StageSlice], optimizer: Any | None, copy: bool = False
                        ) -> dict[ChunkKey, SaveChunk]:
    """This rank's chunks: its stages' weights and, with ``optimizer``, its optimizer state, on
    the host (``copy``: in memory of their own, not views of the live tensors)."""
    chunks: dict[ChunkKey, SaveChunk] = {}

    def _add_chunks(chunks: dict[ChunkKey, SaveChunk], fqn: str, spec, values: torch.Tensor,
                    lo: int) -> None:
        for (offsets, _sizes), view in master_chunks(spec, values, lo, lo + values.numel()):
            if (fqn, offsets) not in chunks:
                chunks[(fqn, offsets)] = SaveChunk(spec.master_shape, _host(view, copy))

    for stage in stages:
        names, params = stored_names(stage), stage_named_parameters(stage)
        start = stage.layer_range[0]
        for local, tensor in stage.module.state_dict(keep_vars=True).items():
            name = global_name(local, start)
            spec = spec_of(params.get(name, tensor))
            _add_chunks(chunks, f"model/{names[name]}", spec, tensor.detach().reshape(-1), 0)
        if optimizer is None:
            continue
        for name, fragments in optimizer.state_fragments(params).items():
            base, spec = f"optim/{names[name]}", spec_of(params[name])
            for key, value in fragments.scalars.items():
                value = _host(torch.as_tensor(value), copy).reshape(())
                chunks.setdefault((f"{base}/{key}", ()), SaveChunk((), value))
            for offset, values in fragments.ranges.items():
                for key, flat in values.items():
                    _add_chunks(chunks, f"{base}/{key}", spec, flat, offset)
    return chunks


# ---------------------------------------------------------------------------- load
class _Requests:
    """Destination pieces by chunk key; a key wanted twice (the tied embedding held by two
    stages of this rank) is read once and copied."""

    def __init__(self) -> None:
        self.chunks: dict[ChunkKey, torch.Tensor] = {}
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def want(self, fqn: str, spec, values: torch.Tensor, lo: int) -> None:
        for (offsets, _sizes), view in master_chunks(spec, values, lo, lo + values.numel()):
            key = (fqn, offsets)
            if key in self.chunks:
                self.copies.append((self.chunks[key], view))
            else:
                self.chunks[key] = view

    def finish(self) -> None:
        for source, target in self.copies:
            target.copy_(source)


def _optimizer_keys(metadata, fqn: str) -> dict[str, Any]:
    prefix = f"optim/{fqn}/"
    return {k[len(prefix):]: md for k, md in metadata.state_dict_metadata.items()
            if k.startswith(prefix)}


def _want_optimizer(requests: _Requests, metadata, stage: StageSlice, names: dict[str, str],
                    optimizer: Any) -> dict[str, ParamFragments]:
    params = stage_named_parameters(stage)
    wanted: dict[str, ParamFragments] = {}
    for name, ranges in optimizer.state_ranges(params).items():
        base, spec = f"optim/{names[name]}", spec_of(params[name])
        entry = ParamFragments(ranges={offset: {} for offset, _ in ranges})
        for key, md in _optimizer_keys(metadata, names[name]).items():
            if len(md.size) == 0:
                value = torch.zeros((), dtype=md.properties.dtype)
                requests.want(f"{base}/{key}", spec_of(value), value.reshape(-1), 0)
                entry.scalars[key] = value
                continue
            for offset, length in ranges:
                flat = torch.zeros(length, dtype=md.properties.dtype)
                requests.want(f"{base}/{key}", spec, flat, offset)
                entry.ranges[offset][key] = flat
        wanted[name] = entry
    return wanted


def load_sharded_tensors(path: str, stages: list[StageSlice], optimizer: Any | None,
                         owned_only: bool = False
                         ) -> tuple[dict[int, dict[str, torch.Tensor]],
                                    dict[int, dict[str, ParamFragments]], int]:
    """Collectively read this rank's pieces from ``path`` into its stages' modules and, with
    ``optimizer``, its parameters' optimizer fragments. Returns per stage the state-dict entries
    that could not be read in place (by local name), the fragments, and the bytes read.
    ``owned_only``: of each parameter read only the optimizer's ranges (the rest stays zero; the
    distributed optimizer gathers it). A missing or uncovered tensor raises KeyError on every
    rank."""
    metadata = read_metadata(path)
    requests = _Requests()
    direct: list[torch.Tensor] = []
    models: dict[int, dict[str, torch.Tensor]] = {}
    optims: dict[int, dict[str, ParamFragments]] = {}
    for stage in stages:
        names, params = stored_names(stage), stage_named_parameters(stage)
        start, local_state = stage.layer_range[0], {}
        owned = optimizer.state_ranges(params) if owned_only else {}
        for local, tensor in stage.module.state_dict(keep_vars=True).items():
            name = global_name(local, start)
            dest = tensor.detach()
            if dest.is_contiguous():  # read straight into the module: no copy of the model
                direct.append(dest)
            else:
                dest = torch.zeros(tensor.shape, dtype=tensor.dtype)
                local_state[local] = dest
            spec, flat = spec_of(params.get(name, tensor)), dest.view(-1)
            if owned_only and name in params:
                for offset, length in owned.get(name, []):
                    requests.want(f"model/{names[name]}", spec,
                                  flat[offset:offset + length], offset)
            else:
                requests.want(f"model/{names[name]}", spec, flat, 0)
        models[stage.stage] = local_state
        if optimizer is not None:
            optims[stage.stage] = _want_optimizer(requests, metadata, stage, names, optimizer)
    _agree_on_errors(path, metadata, requests.chunks)
    with torch.no_grad():
        for tensor in direct:  # what no chunk covers (T's vocabulary padding) stays zero
            tensor.zero_()
    read = load_chunks(path, requests.chunks)
    requests.finish()
    return models, optims, read


def _agree_on_errors(path: str, metadata, chunks: dict[ChunkKey, torch.Tensor]) -> None:
    """Raise the first rank's request error on every rank (a lone raise would hang the
    collective load)."""
    try:
        check_requests(path, metadata, chunks)
        error = None
    except KeyError as exc:
        error = str(exc.args[0])
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, error)
        error = next((e for e in everyone if e is not None), None)
    if error is not None:
        raise KeyError(error)


def read_full_tensors(path: str, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every stored tensor whose name starts with ``prefix``, whole, one at a time (this process
    alone; peak memory about the largest tensor): for tools and tests."""
    metadata = read_metadata(path)
    for fqn in sorted(metadata.state_dict_metadata):
        md = metadata.state_dict_metadata[fqn]
        if not fqn.startswith(prefix) or not hasattr(md, "chunks"):
            continue
        tensor = torch.zeros(tuple(md.size), dtype=md.properties.dtype)
        offsets = tuple(0 for _ in md.size)
        load_chunks(path, {(fqn, offsets): tensor}, collective=False, metadata=metadata)
        yield fqn, tensor
