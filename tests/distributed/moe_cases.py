"""Rank functions for the expert-parallel tests (imported by the spawned ranks)."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_chimera import parallel_state
from megatron_chimera.config import ModelConfig, MoEConfig
from megatron_chimera.model.moe.aux_loss import set_aux_loss_scale
from megatron_chimera.model.moe.layer import MoELayer

S, B, H, EXPERTS = 4, 2, 8, 8


def moe_config(**moe) -> ModelConfig:
    """Tiny fp32 config: 8 experts of width 8, top-2, load-balancing and z losses."""
    fields = dict(num_experts=EXPERTS, moe_ffn_hidden_size=8, moe_router_topk=2,
                  moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    fields.update(moe)
    swiglu = fields.pop("swiglu", False)
    return ModelConfig(num_layers=1, hidden_size=H, num_attention_heads=2, swiglu=swiglu,
                       hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.5,
                       moe=MoEConfig(**fields))


def rank_tokens(rank: int) -> torch.Tensor:
    """The tokens ``[s, b, h]`` rank ``rank`` routes (distinct per rank)."""
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randn(S, B, H, generator=generator)


def loss_and_grads(layer: MoELayer, hidden: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """A loss of the layer's output (aux losses injected with scale 1), its backward, and the
    gradients of the parameters and of the input."""
    hidden = hidden.clone().requires_grad_(True)
    set_aux_loss_scale([layer], 1.0)
    out, _ = layer(hidden)
    loss = (out * torch.linspace(-1, 1, H)).square().sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    grads["input"] = hidden.grad.clone()
    return loss.detach(), grads


def run_expert_parallel_layer(rank: int, world_size: int, cases: list[tuple[int, dict]]) -> None:
    """For each (EP, MoE fields): this rank's loss and input gradient equal one process's layer
    on the same tokens; the router's gradient summed over the world and each local expert's
    gradient summed over its expert replicas equal one process's, summed over every rank's
    tokens (fp32: loss 1e-6, gradients 1e-5 relative)."""
    for ep, fields in cases:
        cfg = moe_config(**fields)
        reference = MoELayer(cfg, 1, seed=7).train()  # one process: no groups yet
        ref_losses, ref_sum = [], {}
        for r in range(world_size):
            loss, grads = loss_and_grads(reference, rank_tokens(r))
            reference.zero_grad()
            ref_losses.append(loss)
            if r == rank:
                ref_input = grads["input"]
            for n, g in grads.items():
                ref_sum[n] = ref_sum.get(n, 0) + g
        parallel_state.initialize_model_parallel(1, [[0]], 1, timeout=timedelta(seconds=60),
                                                 expert_model_parallel_size=ep)
        try:
            layer = MoELayer(cfg, 1, seed=7).train()
            loss, grads = loss_and_grads(layer, rank_tokens(rank))
            torch.testing.assert_close(loss, ref_losses[rank], rtol=1e-6, atol=0,
                                       msg=f"EP={ep} {fields}: loss")
            torch.testing.assert_close(grads["input"], ref_input, rtol=1e-5, atol=1e-6)
            router = grads["router.weight"]
            dist.all_reduce(router, group=parallel_state.get_stage_replica_group(0))
            torch.testing.assert_close(router, ref_sum["router.weight"], rtol=1e-5, atol=1e-6,
                                       msg=f"EP={ep} {fields}: router gradient")
            first, num = layer.experts.first, layer.experts.num_local
            assert num == EXPERTS // ep and first == parallel_state.get_expert_model_parallel_rank() * num
            for name in ("experts.weight1", "experts.weight2", "experts.bias1", "experts.bias2"):
                grad = grads[name]
                dist.all_reduce(grad, group=parallel_state.get_expert_stage_replica_group(0))
                torch.testing.assert_close(grad, ref_sum[name][first:first + num], rtol=1e-5,
                                           atol=1e-6, msg=f"EP={ep} {fields}: {name}")
        finally:
            parallel_state.destroy_model_parallel()
