"""Real megatron-core (when installed) as the oracle, run in a subprocess (it needs CUDA shims):

    python -m tests.helpers.megatron_oracle save gpt|llama OUT [T P]  # torch_dist + legacy
    python -m tests.helpers.megatron_oracle load gpt|llama DIR OUT.pt  # strict load of DIR

``save`` builds Megatron's ``GPTModel`` (local spec, ``use_cpu_initialization``, T x P gloo ranks)
with the shapes of tests/helpers/megatron_checkpoints.py, writes ``OUT/torch_dist`` with
``dist_checkpointing.save``, ``OUT/legacy`` as Megatron-LM's legacy save does (``state_dict()`` per
rank with ``args``), and at T=1 x P=1 ``OUT/logits.pt`` (Megatron's forward on fixed tokens).
``load`` reads a checkpoint with ``dist_checkpointing.load(strict=RAISE_ALL)`` (a missing or
unexpected key raises) and saves the model's state dict. Never imported by the package.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys

import torch


def _cpu_shims() -> None:
    """megatron-core 0.16.1 on a CPU machine: no-op synchronize, device 'cuda' -> cpu."""
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: 0
    torch.Tensor.cuda = lambda self, *a, **k: self

    def fix(dev):
        if isinstance(dev, int) or (isinstance(dev, str) and dev.startswith("cuda")):
            return "cpu"
        return torch.device("cpu") if isinstance(dev, torch.device) and dev.type == "cuda" \
            else dev

    def wrap(fn):
        @functools.wraps(fn)
        def inner(*a, **k):
            if "device" in k:
                k["device"] = fix(k["device"])
            return fn(*a, **k)
        return inner

    to = torch.Tensor.to

    def tensor_to(self, *a, **k):
        a = tuple(fix(x) if isinstance(x, (str, torch.device, int)) and not isinstance(x, bool)
                  else x for x in a)
        if "device" in k:
            k["device"] = fix(k["device"])
        return to(self, *a, **k)

    torch.Tensor.to = tensor_to
    for name in ("tensor", "zeros", "ones", "empty", "full", "arange", "randn", "rand",
                 "zeros_like", "empty_like", "ones_like", "as_tensor"):
        setattr(torch, name, wrap(getattr(torch, name)))


def _build(kind: str, tensor: int = 1, pipeline: int = 1):
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from tests.helpers.megatron_checkpoints import megatron_args

    args = megatron_args(kind, tensor=tensor, pipeline=pipeline)
    llama = kind == "llama"
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if llama else None,
        ffn_hidden_size=args.ffn_hidden_size, kv_channels=args.kv_channels,
        use_cpu_initialization=True, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=tensor, pipeline_model_parallel_size=pipeline,
        normalization=args.normalization, gated_linear_unit=llama,
        activation_func=F.silu if llama else F.gelu, add_bias_linear=args.add_bias_linear,
        hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=args.norm_epsilon)
    model = GPTModel(config, get_gpt_layer_local_spec(normalization=args.normalization),
                     vocab_size=args.padded_vocab_size,
                     max_sequence_length=args.max_position_embeddings,
                     position_embedding_type=args.position_embedding_type,
                     share_embeddings_and_output_weights=not llama,
                     pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage())
    return args, model


def _save(kind: str, out: str, tensor: int, pipeline: int) -> None:
    import argparse

    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as tp_random

    torch.manual_seed(1234)
    args, model = _build(kind, tensor, pipeline)
    with torch.no_grad():  # norms start at 1 / 0: perturb them so a swapped norm shows
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn(param.shape) * 0.1)
    path = os.path.join(out, "torch_dist", "iter_0000007")
    os.makedirs(path, exist_ok=True)
    dist_checkpointing.save({"model": model.sharded_state_dict(), "args": args, "iteration": 7,
                             "checkpoint_version": 3.0}, path)
    t, p = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pipeline > 1 else "")
    legacy = os.path.join(out, "legacy", "iter_0000007", name)
    os.makedirs(legacy)
    torch.save({"args": argparse.Namespace(**{**vars(args), "ckpt_format": "torch"}),
                "checkpoint_version": 3.0, "iteration": 7, "model": model.state_dict()},
               os.path.join(legacy, "model_optim_rng.pt"))
    if torch.distributed.get_rank() == 0:
        for fmt in ("torch_dist", "legacy"):
            with open(os.path.join(out, fmt, "latest_checkpointed_iteration.txt"), "w") as handle:
                handle.write("7")
    if tensor * pipeline > 1:
        return
    tp_random.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    tokens = torch.randint(0, args.padded_vocab_size, (2, 12),
                           generator=torch.Generator().manual_seed(5))
    model.eval()
    with torch.no_grad():
        logits = model(tokens, torch.arange(12).expand(2, 12), None)
    torch.save({"tokens": tokens, "logits": logits}, os.path.join(out, "logits.pt"))


def _load(kind: str, path: str, out: str) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    _, model = _build(kind)
    sharded = model.sharded_state_dict()
    iteration = open(os.path.join(path, "latest_checkpointed_iteration.txt")).read().strip()
    loaded = dist_checkpointing.load(sharded, os.path.join(path, f"iter_{int(iteration):07d}"),
                                     strict=StrictHandling.RAISE_ALL)
    model.load_state_dict({k: v for k, v in loaded.items() if k in sharded}, strict=True)
    torch.save({k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}, out)


def _rank(rank: int, world: int, argv: list[str]) -> None:
    _cpu_shims()
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29655")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state as ps

    if argv[0] == "save":
        tensor, pipeline = (int(argv[3]), int(argv[4])) if len(argv) > 3 else (1, 1)
        ps.initialize_model_parallel(tensor, pipeline)
        _save(argv[1], argv[2], tensor, pipeline)
    else:
        ps.initialize_model_parallel(1, 1)
        _load(argv[1], argv[2], argv[3])
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    """Run ``save`` (on T x P gloo ranks) or ``load`` (one rank)."""
    argv = sys.argv[1:]
    world = int(argv[3]) * int(argv[4]) if argv[0] == "save" and len(argv) > 3 else 1
    if world == 1:
        _rank(0, 1, argv)
        return
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(world, argv), nprocs=world)


if __name__ == "__main__":
    main()
