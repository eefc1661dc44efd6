"""Tensor and sequence parallelism with Megatron-core's names (``megatron.core.tensor_parallel``).

Modules: ``layers`` (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding),
``mappings`` (the autograd communication at tensor- and sequence-parallel boundaries),
``cross_entropy`` (vocab_parallel_cross_entropy), ``random`` (the RNG tracker and checkpoint),
``weight_grad`` (the deferrable linear function shared with ``model.linear``), ``utils``
(parameter attributes, ``param_is_not_tensor_parallel_duplicate``), ``grads`` (sequence-parallel
gradient all-reduce), ``checkpoint_shards`` (joining and splitting shards for checkpoints).
The groups come from :mod:`megatron_chimera.parallel_state`; with T = 1 everything is the identity.
"""

from megatron_chimera.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_chimera.tensor_parallel.grads import (
    allreduce_sequence_parallel_grads,
    is_sequence_parallel,
    sequence_parallel_params,
)
from megatron_chimera.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from megatron_chimera.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron_chimera.tensor_parallel.random import (
    CudaRNGStatesTracker,
    checkpoint,
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)
from megatron_chimera.tensor_parallel.utils import (
    VocabUtility,
    param_is_not_tensor_parallel_duplicate,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)

__all__ = [
    "ColumnParallelLinear", "CudaRNGStatesTracker", "RowParallelLinear", "VocabParallelEmbedding",
    "VocabUtility", "allreduce_sequence_parallel_grads", "checkpoint",
    "copy_to_tensor_model_parallel_region", "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region", "get_cuda_rng_tracker", "is_sequence_parallel",
    "model_parallel_cuda_manual_seed", "param_is_not_tensor_parallel_duplicate",
    "reduce_from_tensor_model_parallel_region", "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region", "scatter_to_tensor_model_parallel_region",
    "sequence_parallel_params", "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes", "vocab_parallel_cross_entropy",
]
