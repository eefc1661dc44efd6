"""Saved activation bytes of one transformer layer per tensor rank under sequence parallelism
(run by ``test_sequence_parallel_memory.py`` on T gloo ranks; ``python -m
tests.distributed.sequence_parallel_memory`` prints the figure)."""

from __future__ import annotations

import datetime

import torch

from megatron_chimera import parallel_state
from megatron_chimera.config import ModelConfig
from megatron_chimera.model.fused import FusedBackend
from megatron_chimera.model.transformer import ParallelTransformerLayer
from megatron_chimera.tensor_parallel.random import model_parallel_cuda_manual_seed

# Korthikanti et al.'s layer: 16-bit activations, dropout on, unfused softmax (the s x s scores
# and their dropout mask are stored); a GPT-2 layer (LayerNorm, GeLU, 4h MLP)
SEQ, MICRO_BATCH, HIDDEN, HEADS = 64, 2, 64, 4
LAYER = dict(hidden_size=HIDDEN, num_attention_heads=HEADS, seq_length=SEQ, vocab_size=128,
             num_layers=1, hidden_dropout=0.1, attention_dropout=0.1, params_dtype="bf16",
             masked_softmax_fusion=False, sequence_parallel=True)


def korthikanti_bytes(tensor_parallel: int, mask_bytes: int = 1) -> float:
    """``s*b*h*(34 + 5*a*s/h)/T`` (tensor and sequence parallelism, 16-bit activations, 1-byte
    dropout masks), with ``mask_bytes`` per element of the three dropout masks instead (torch's
    CPU dropout keeps its mask in the activation dtype, 2 bytes): ``sbh`` per hidden-dropout
    mask and ``a*s*s*b`` for the attention one."""
    s, b, h, a = SEQ, MICRO_BATCH, HIDDEN, HEADS
    extra = (mask_bytes - 1) * (2 * s * b * h + a * s * s * b)
    return (s * b * h * (34 + 5 * a * s / h) + extra) / tensor_parallel


def saved_bytes(layer: torch.nn.Module, hidden: torch.Tensor) -> int:
    """Bytes of the distinct non-parameter storages autograd saves in ``layer``'s forward."""
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params and storage.data_ptr() != hidden.data_ptr():
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(hidden, None)
    out.float().sum().backward()  # the saved tensors were right for a backward
    return sum(saved.values())


def measure_rank(rank: int, world_size: int, results: str | None = None) -> int:
    """This rank's saved bytes for one layer at T = ``world_size`` (sequence parallel)."""
    parallel_state.initialize_model_parallel(1, [[0]], 1, world_size,
                                             timeout=datetime.timedelta(seconds=60))
    model_parallel_cuda_manual_seed(1234)
    try:
        config = ModelConfig(**LAYER)
        layer = ParallelTransformerLayer(config, 1, True, FusedBackend(apex=False), seed=1)
        layer.train()
        torch.manual_seed(rank)
        hidden = torch.randn(SEQ // world_size, MICRO_BATCH, HIDDEN, dtype=torch.bfloat16,
                             requires_grad=True)
        measured = saved_bytes(layer, hidden)
    finally:
        parallel_state.destroy_model_parallel()
    if results is not None:
        with open(f"{results}/rank{rank}", "w") as out:
            out.write(str(measured))
    return measured


def main() -> None:
    """Print the per-rank saved bytes at T = 4 against the paper's figure."""
    import tempfile
    from pathlib import Path

    from tests.distributed.harness import spawn_world

    with tempfile.TemporaryDirectory() as results:
        spawn_world(measure_rank, 4, results, timeout_s=100)
        measured = int((Path(results) / "rank0").read_text())
    paper = korthikanti_bytes(4, mask_bytes=2)
    print(f"T=4 saved bytes per rank: {measured}, Korthikanti et al. (2-byte CPU masks): "
          f"{paper:.0f}, ratio {measured / paper:.3f}")


if __name__ == "__main__":
    main()
