"""Tensor-parallel layers with Megatron-core's names and semantics.

* :class:`ColumnParallelLinear` -- ``Y = X A + b`` with ``A`` split by columns (output features):
  rank t holds ``A_t`` and computes ``Y_t``; ``gather_output`` all-gathers ``Y``.
* :class:`RowParallelLinear` -- ``A`` split by rows (input features): rank t computes
  ``X_t A_t`` and the partial sums are all-reduced (or reduce-scattered along the sequence under
  sequence parallelism); ``input_is_parallel`` says ``X`` arrives already split. With T = 1 the
  bias is added inside the matmul (there is nothing to reduce first).
* :class:`VocabParallelEmbedding` -- the (padded) vocabulary split over the ranks.

Both linears compute through :class:`~.weight_grad.LinearWithDeferrableWeightGrad` with the
communication in separate autograd functions around it, so split-backward schedules defer their
weight gradients exactly like ``model.linear.Linear``. Parameters are allocated uninitialised
(the model draws them layout-independently, see ``model.utils.init_normal_``) and carry Megatron's
attributes (:mod:`.utils`). ``skip_bias_add`` returns the bias instead of adding it, as Megatron.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_chimera import parallel_state
from megatron_chimera.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron_chimera.tensor_parallel.utils import (
    VocabUtility,
    divide,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)
from megatron_chimera.tensor_parallel.weight_grad import (
    WeightGradStore,
    bias_add_with_deferrable_grad,
    linear_with_deferrable_weight_grad,
)


def _world() -> int:
    return parallel_state.get_tensor_model_parallel_world_size()


class ColumnParallelLinear(nn.Module):
    """Linear layer split along its output features; ``forward`` returns ``(output, bias)``.

    The input is replicated over the tensor-parallel ranks (its gradient is all-reduced --
    asynchronously, overlapped with the weight gradient, unless ``async_allreduce`` is off:
    Megatron's ``--no-async-tensor-model-parallel-allreduce``), or with ``sequence_parallel``
    split along the sequence (all-gathered forward, gradient reduce-scattered -- overlapped with
    the weight gradient, as Megatron does under sequence parallelism).
    ``gather_output`` all-gathers the output features; ``skip_bias_add`` returns the bias (this
    rank's shard) for the caller to add.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True,
                 gather_output: bool = False, skip_bias_add: bool = False,
                 sequence_parallel: bool = False, stride: int = 1,
                 dtype: torch.dtype | None = None, async_allreduce: bool = True) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.tensor_parallel_size = _world()  # the weights are shaped for it
        self.output_size_per_partition = divide(output_size, self.tensor_parallel_size,
                                                "output size")
        self.gather_output = gather_output
        self.async_allreduce = async_allreduce
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel = sequence_parallel and _world() > 1
        if self.sequence_parallel and gather_output:
            raise ValueError("ColumnParallelLinear: gather_output with sequence_parallel")
        self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, input_size,
                                               dtype=dtype))
        set_tensor_model_parallel_attributes(self.weight, True, 0, stride)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition, dtype=dtype))
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
        self.weight_grad_store: WeightGradStore | None = None
        self.weight_grad_deferrable = True  # see weight_grad.set_weight_grad_deferral

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[s(/T), b, in] -> ([s, b, out/T] or [s, b, out] gathered, bias or None)``."""
        bias = None if self.skip_bias_add else self.bias
        if self.tensor_parallel_size == 1:  # nothing to gather or reduce
            return linear_with_deferrable_weight_grad(input_, self, bias), (
                self.bias if self.skip_bias_add else None)
        if self.sequence_parallel:  # gathered inside; its gradient reduce-scattered, overlapped
            output = linear_with_deferrable_weight_grad(input_, self, bias,
                                                        sequence_parallel=True)
        elif self.async_allreduce:  # the input-gradient all-reduce inside
            output = linear_with_deferrable_weight_grad(
                input_, self, bias, parallel_state.get_tensor_model_parallel_group())
        else:
            input_parallel = copy_to_tensor_model_parallel_region(input_)
            output = linear_with_deferrable_weight_grad(input_parallel, self, bias)
        if self.gather_output:
            output = gather_from_tensor_model_parallel_region(output)
        return output, (self.bias if self.skip_bias_add else None)


class RowParallelLinear(nn.Module):
    """Linear layer split along its input features; ``forward`` returns ``(output, bias)``.

    ``input_is_parallel``: the input arrives split along its last dimension (the output of a
    column-parallel layer); otherwise it is scattered here. The partial outputs are all-reduced,
    or with ``sequence_parallel`` reduce-scattered along the sequence. The bias is replicated and
    added after the reduction, its gradient deferrable like the weight's (under sequence
    parallelism it is partial per rank, hence ``sequence_parallel``-marked).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True,
                 input_is_parallel: bool = False, skip_bias_add: bool = False,
                 sequence_parallel: bool = False, stride: int = 1,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.tensor_parallel_size = _world()  # the weights are shaped for it
        self.input_size_per_partition = divide(input_size, self.tensor_parallel_size,
                                               "input size")
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel = sequence_parallel and _world() > 1
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel")
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_partition,
                                               dtype=dtype))
        set_tensor_model_parallel_attributes(self.weight, True, 1, stride)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, dtype=dtype))
            set_defaults_if_not_set_tensor_model_parallel_attributes(self.bias)
            self.bias.sequence_parallel = self.sequence_parallel
        self.weight_grad_store: WeightGradStore | None = None
        self.weight_grad_deferrable = True  # see weight_grad.set_weight_grad_deferral

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[s, b, in/T] (or in) -> ([s(/T), b, out], bias or None)``."""
        input_parallel = (input_ if self.input_is_parallel
                          else scatter_to_tensor_model_parallel_region(input_))
        if self.tensor_parallel_size == 1 and not self.skip_bias_add:
            # nothing to reduce: the bias goes into the matmul (one kernel, one autograd node)
            return linear_with_deferrable_weight_grad(input_parallel, self, self.bias), None
        output_parallel = linear_with_deferrable_weight_grad(input_parallel, self, None)
        if self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(output_parallel)
        else:
            output = reduce_from_tensor_model_parallel_region(output_parallel)
        if self.skip_bias_add or self.bias is None:
            return output, self.bias if self.skip_bias_add else None
        return bias_add_with_deferrable_grad(output, self), None


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (the vocabulary, padded to ``num_embeddings``, a multiple of T) are
    split over the tensor-parallel ranks; the looked-up vectors are all-reduced.

    ``master_size`` is the layout-independent vocabulary padding (rows beyond it are Megatron's
    T-dependent padding, zero, never looked up). The parameter is ``weight`` as in
    ``nn.Embedding``, so state-dict names do not change.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, master_size: int | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        world = _world()
        self.vocab_start_index, self.vocab_end_index = (
            VocabUtility.vocab_range_from_global_vocab_size(
                num_embeddings, parallel_state.get_tensor_model_parallel_rank(), world))
        rows = self.vocab_end_index - self.vocab_start_index
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim, dtype=dtype))
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1,
                                             master_size=master_size or num_embeddings)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        """Token ids ``[...]`` -> embeddings ``[..., h]`` (summed over the ranks)."""
        if _world() == 1:
            return F.embedding(input_, self.weight)
        outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
        local = (input_ - self.vocab_start_index).masked_fill(outside, 0)
        output = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(output)
