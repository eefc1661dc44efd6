"""Read one of our ``torch_dist`` checkpoints with stock torch only (run as a script, ``python -I``,
so neither this repository nor ``megatron_chimera`` is on ``sys.path``)::

    python -I tests/helpers/stock_dcp_reader.py CHECKPOINT_DIR OUT_DIR

Writes ``OUT_DIR/dcp_to_torch_save.pt`` (``format_utils.dcp_to_torch_save``) and
``OUT_DIR/dcp_load.pt`` (``dcp.load`` into a plain state dict of zero tensors shaped from the
metadata, through the stock ``FileSystemReader``), and fails if ``megatron_chimera`` was
imported on the way.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import TensorStorageMetadata


def main(checkpoint: str, out: str) -> None:
    """Both stock reads of ``checkpoint`` into ``out``."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    dcp_to_torch_save(checkpoint, os.path.join(out, "dcp_to_torch_save.pt"))
    reader = FileSystemReader(checkpoint)
    state = {name: torch.zeros(tuple(md.size), dtype=md.properties.dtype)
             for name, md in reader.read_metadata().state_dict_metadata.items()
             if isinstance(md, TensorStorageMetadata)}
    dcp.load(state, storage_reader=FileSystemReader(checkpoint), no_dist=True)
    torch.save(state, os.path.join(out, "dcp_load.pt"))
    ours = sorted(m for m in sys.modules if m.split(".")[0] == "megatron_chimera")
    if ours:
        raise SystemExit(f"megatron_chimera was imported: {ours[:3]}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
