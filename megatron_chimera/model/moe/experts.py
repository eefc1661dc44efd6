"""The experts one rank holds: ``L = experts / EP`` MLPs as stacked weights.

``weight1`` ``[L, h, g x f]`` (g = 2 with ``--swiglu``: Megatron's fused ``[gate | up]``),
``weight2`` ``[L, f, h]``, and with biases (``--add-bias-linear``) ``bias1`` ``[L, g x f]``,
``bias2`` ``[L, h]``. Expert ``e`` (global index) is initialised from its own key, so every
expert-parallel size builds the same experts. The tokens arrive grouped by local expert; with
``--moe-grouped-gemm`` one grouped matmul per projection (``torch._grouped_mm`` where this torch
and device run it -- it needs 16-byte-aligned rows), else a loop over the experts.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from megatron_chimera.config import ModelConfig
from megatron_chimera.model.fused import gelu, swiglu
from megatron_chimera.model.utils import layer_key, make_generator, scaled_init_std


@functools.cache
def grouped_mm_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` exists and runs forward and backward on this device type
    and dtype (probed once on a tiny aligned problem)."""
    grouped_mm = getattr(torch, "_grouped_mm", None)
    if grouped_mm is None:
        return False
    try:
        a = torch.ones(4, 8, dtype=dtype, device=device_type, requires_grad=True)
        b = torch.ones(2, 8, 8, dtype=dtype, device=device_type, requires_grad=True)
        offsets = torch.tensor([1, 4], dtype=torch.int32, device=device_type)
        grouped_mm(a, b, offs=offsets).backward(torch.ones(4, 8, dtype=dtype, device=device_type))
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (the grouped matmul's backward
    rejects broadcast gradients)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return grad.contiguous()


def grouped_matmul(x: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor | list[int],
                   grouped: bool, host_counts: list[int] | None = None) -> torch.Tensor:
    """Rows of ``x`` ``[N, k]`` in groups of ``counts`` times ``weights[i]`` ``[k, n]``:
    ``[N, n]``. ``grouped``: one ``torch._grouped_mm`` whose offsets are the cumulated counts
    on the device (no host sync; with rows: its backward rejects an empty gradient); else one
    matmul per group (``host_counts``, or the counts copied to the host)."""
    if grouped and x.shape[0]:
        if not isinstance(counts, torch.Tensor):
            counts = torch.tensor(counts)
        offsets = counts.to(x.device).cumsum(0).to(torch.int32)
        return _ContiguousGrad.apply(torch._grouped_mm(x, weights, offs=offsets))
    if host_counts is None:
        host_counts = counts.tolist() if isinstance(counts, torch.Tensor) else counts
    outs = [chunk @ weights[i] for i, chunk in enumerate(x.split(host_counts))]
    return torch.cat(outs) if outs else x.new_zeros(0, weights.shape[-1])


def expand_bias(bias: torch.Tensor, counts: torch.Tensor | list[int], num_rows: int
                ) -> torch.Tensor:
    """Per-expert bias ``[L, n]`` repeated for each expert's rows: ``[num_rows, n]`` (the
    output size given, so no host sync)."""
    if not isinstance(counts, torch.Tensor):
        counts = torch.tensor(counts)
    return bias.repeat_interleave(counts.to(bias.device), dim=0, output_size=num_rows)


class Experts(nn.Module):
    """The ``num_local`` experts ``first, first + 1, ...`` of one MoE layer."""

    def __init__(self, config: ModelConfig, layer_number: int, first: int, num_local: int,
                 seed: int) -> None:
        super().__init__()
        h = config.hidden_size
        f = config.moe.moe_ffn_hidden_size or config.ffn_size
        dtype = config.torch_dtype
        self.swiglu = config.swiglu
        self.exact_gelu = config.gelu == "erf"
        self.fused_gelu = config.bias_gelu_fusion
        self.compile_elementwise = config.bias_dropout_fusion  # SwiGLU compiled on CUDA
        gated = 2 if config.swiglu else 1
        self.first, self.num_local, self.ffn_hidden_size = first, num_local, f
        self.weight1 = nn.Parameter(torch.empty(num_local, h, gated * f, dtype=dtype))
        self.weight2 = nn.Parameter(torch.empty(num_local, f, h, dtype=dtype))
        self.bias1 = self.bias2 = None
        if config.add_bias_linear:
            self.bias1 = nn.Parameter(torch.zeros(num_local, gated * f, dtype=dtype))
            self.bias2 = nn.Parameter(torch.zeros(num_local, h, dtype=dtype))
        for p in self.parameters():
            p.is_expert = True  # reduced over the expert-data-parallel replicas
            # this rank's experts are rows [first, first + num_local) of the layer's stacked
            # [num_experts, ...] tensor (checkpoints store that tensor: any EP loads it)
            p.expert_offset, p.num_experts = first, config.moe.num_experts
        self._init(config, layer_number, seed)
        aligned = all(n * torch.finfo(dtype).bits // 8 % 16 == 0 for n in (h, gated * f, f))
        self.grouped = config.moe.moe_grouped_gemm and aligned

    @torch.no_grad()
    def _init(self, config: ModelConfig, layer_number: int, seed: int) -> None:
        std = config.init_method_std
        out_std = scaled_init_std(std, config.num_layers)
        for i in range(self.num_local):
            generator = make_generator(
                seed, f"{layer_key(layer_number - 1)}.expert.{self.first + i}")
            for weight, scale in ((self.weight1, std), (self.weight2, out_std)):
                values = torch.empty(weight.shape[1:], dtype=torch.float32)
                weight[i].copy_(values.normal_(0.0, scale, generator=generator))

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor | list[int],
                host_counts: list[int] | None = None) -> torch.Tensor:
        """``[N, h]`` grouped by local expert (``counts[i]`` rows for expert ``first + i``;
        ``host_counts``: the same on the host, where known) -> the experts' outputs ``[N, h]``,
        same order."""
        grouped = self.grouped and grouped_mm_runs(tokens.device.type, tokens.dtype)
        if not grouped and host_counts is None:  # the loop needs the counts on the host
            host_counts = counts.tolist() if isinstance(counts, torch.Tensor) else counts
        hidden = grouped_matmul(tokens, self.weight1, counts, grouped, host_counts)
        if self.bias1 is not None:
            hidden = hidden + expand_bias(self.bias1, counts, tokens.shape[0])
        if self.swiglu:
            hidden = swiglu(hidden, fused=self.compile_elementwise and hidden.is_cuda)
        elif self.exact_gelu:
            hidden = F.gelu(hidden)
        else:
            hidden = gelu(hidden, fused=self.fused_gelu)
        out = grouped_matmul(hidden, self.weight2, counts, grouped, host_counts)
        if self.bias2 is not None:
            out = out + expand_bias(self.bias2, counts, tokens.shape[0])
        return out
