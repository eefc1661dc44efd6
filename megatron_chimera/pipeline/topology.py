"""Where a rank sits in the pipeline layout, injected into the executor and the communicator.

The executor only needs its pipeline rank, its data-parallel rank (to label the losses it
gathers), the global rank of every pipeline rank of its data-parallel replica, and the group a
message between two global ranks travels on. :meth:`PipelineTopology.from_parallel_state` reads
them from :mod:`megatron_chimera.parallel_state`; tests and tools without model-parallel groups
use :meth:`PipelineTopology.standalone` (pipeline rank = global rank, default group).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from megatron_chimera import parallel_state

GroupOf = Callable[[int, int], "dist.ProcessGroup | None"]


def _identity(rank: int) -> int:
    return rank


def _default_group(src: int, dst: int) -> None:
    return None


@dataclass(frozen=True)
class PipelineTopology:
    """This rank's pipeline rank, data-parallel rank and how to reach its pipeline peers."""

    pipeline_rank: int
    data_parallel_rank: int = 0
    to_global_rank: Callable[[int], int] = _identity  # pipeline rank -> global rank
    p2p_group: GroupOf = _default_group  # (src, dst) global ranks -> group (None: default)

    @classmethod
    def from_parallel_state(cls) -> PipelineTopology:
        """The topology of this rank in the initialised model-parallel groups."""
        return cls(
            pipeline_rank=parallel_state.get_pipeline_model_parallel_rank(),
            data_parallel_rank=parallel_state.get_data_parallel_rank(),
            to_global_rank=parallel_state.pipeline_rank_to_global_rank,
            p2p_group=parallel_state.get_p2p_group,
        )

    @classmethod
    def standalone(cls, pipeline_rank: int) -> PipelineTopology:
        """One pipeline over the whole world: pipeline rank = global rank, default group."""
        return cls(pipeline_rank=pipeline_rank)

    @property
    def global_rank(self) -> int:
        """This rank's global rank."""
        return self.to_global_rank(self.pipeline_rank)
