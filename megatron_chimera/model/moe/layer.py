"""The MoE layer: a transformer layer's MLP replaced by routed experts (plus an optional shared
expert), Megatron-core's ``MoELayer``.

``[s, b, h] -> ([s, b, h], None)`` like ``ParallelMLP`` (``[s/T, b, h]`` with sequence
parallelism: each tensor rank routes its own positions): route the ``s x b`` tokens, dispatch them
to the experts of their expert-parallel ranks, run this rank's experts, combine, and add the
shared expert's output (a dense MLP of ``--moe-shared-expert-intermediate-size`` every token
takes; with ``--moe-shared-expert-gate`` scaled per token by ``sigmoid(x w_g)``, as Qwen2-MoE
does). The expert-parallel group comes from ``parallel_state`` when the model is built (one
rank and no group before ``initialize_model_parallel``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from megatron_chimera import parallel_state
from megatron_chimera.config import ConfigError, ModelConfig
from megatron_chimera.model.moe.expert_comm import BackwardTape, ExpertComm
from megatron_chimera.model.moe.experts import Experts
from megatron_chimera.model.moe.router import TopKRouter
from megatron_chimera.model.moe.token_dispatcher import TokenDispatcher
from megatron_chimera.model.utils import init_normal_, layer_key, make_generator
from megatron_chimera.tensor_parallel.utils import mark_sequence_parallel


def check_moe(tensor_parallel: int, expert_tensor_parallel: int | None = None,
              sequence_parallel: bool = False) -> None:
    """ConfigError naming the flag for MoE parallel settings this build cannot run."""
    if expert_tensor_parallel not in (None, 1):
        raise ConfigError(f"--expert-tensor-parallel-size {expert_tensor_parallel}: only 1 is "
                          "supported (experts are not tensor-split)")
    if tensor_parallel > 1 and not sequence_parallel:
        raise ConfigError("--num-experts with --tensor-model-parallel-size > 1 needs "
                          "--sequence-parallel (each tensor rank routes its share of the tokens)")


class MoELayer(nn.Module):
    """Router, this rank's experts, token dispatcher and optional shared expert of the MoE layer
    ``layer_number`` (1-based, global). ``shared_experts``: the dense MLP of
    ``--moe-shared-expert-intermediate-size`` (``transformer.moe_layer`` builds it), or None.
    Its output ``(out, bias)`` is added to the routed experts'."""

    def __init__(self, config: ModelConfig, layer_number: int, seed: int,
                 shared_experts: nn.Module | None = None) -> None:
        super().__init__()
        tensor = parallel_state.get_tensor_model_parallel_world_size()
        check_moe(tensor, sequence_parallel=config.sequence_parallel)
        moe = config.moe
        ep_size = parallel_state.get_expert_model_parallel_world_size()
        ep_rank = parallel_state.get_expert_model_parallel_rank()
        self.dispatcher = TokenDispatcher(
            moe.moe_token_dispatcher_type, moe.num_experts, ep_size, ep_rank,
            parallel_state.get_expert_model_parallel_group() if ep_size > 1 else None,
            topk=moe.moe_router_topk, capacity_factor=moe.moe_expert_capacity_factor)
        # with sequence parallelism each tensor rank routes its s/T positions: the router's
        # gradient is partial (summed over the tensor ranks) and the auxiliary losses count the
        # tokens of the whole sequence
        split = tensor > 1
        self.router = TopKRouter(config, layer_number, seed,
                                 parallel_state.get_tensor_model_parallel_group() if split
                                 else None)
        mark_sequence_parallel(self.router, split)
        self.experts = Experts(config, layer_number, self.dispatcher.first_local,
                               self.dispatcher.num_local, seed)
        self.shared_experts = shared_experts
        if moe.moe_shared_expert_gate:
            self._add_shared_expert_gate(config, layer_number, seed, split)

    def _add_shared_expert_gate(self, config: ModelConfig, layer_number: int, seed: int,
                                split: bool) -> None:
        """Megatron's ``--moe-shared-expert-gate``: ``shared_experts.gate_weight`` ``[1, h]``
        (replicated; with sequence parallelism its gradient is partial per tensor rank), the
        shared expert's output scaled by ``sigmoid(x gate_weight^T)`` per token."""
        if self.shared_experts is None:
            raise ConfigError("--moe-shared-expert-gate needs "
                              "--moe-shared-expert-intermediate-size (a shared expert to gate)")
        gate = nn.Parameter(torch.empty(1, config.hidden_size, dtype=config.torch_dtype))
        init_normal_(gate, config.init_method_std,
                     make_generator(seed, f"{layer_key(layer_number - 1)}.shared_expert_gate"))
        gate.sequence_parallel = split
        self.shared_experts.gate_weight = gate

    def set_expert_comm(self, comm: ExpertComm) -> None:
        """Issue this layer's all-to-alls through ``comm`` (the pipeline's paired runtime)."""
        self.dispatcher.comm = comm

    def paused_tape(self) -> contextlib.AbstractContextManager:
        """No backward cuts in this layer within the block (a recomputed region)."""
        return self.dispatcher.comm.paused()

    def backward_tape(self) -> BackwardTape | None:
        """The tape the running forward records its cuts on (``alltoall`` over EP > 1 only:
        the only dispatcher whose all-to-alls overlap), else None."""
        dispatcher = self.dispatcher
        if dispatcher.kind != "alltoall" or dispatcher.ep_size == 1:
            return None
        return dispatcher.comm.tape

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, None]:
        """``[s, b, h] -> ([s, b, h], None)`` (biases are added inside)."""
        s, b, h = hidden.shape
        tokens = hidden.reshape(s * b, h)
        probs, routing_map = self.router(tokens, s)
        tape = self.backward_tape()
        start = tape.segment if tape is not None else 0
        dispatched = self.dispatcher.dispatch(tokens, probs, routing_map)
        expert_output = self.experts(dispatched.tokens, dispatched.counts, dispatched.host_counts)
        if tape is not None:  # what the combine reads of the segment before the dispatch
            dispatched = dispatched._replace(probs=tape.cut(dispatched.probs, start))
            hidden = tape.cut(hidden, start)
        out = self.dispatcher.combine(expert_output, dispatched).view(s, b, h)
        if self.shared_experts is not None:
            shared, bias = self.shared_experts(hidden)
            shared = shared if bias is None else shared + bias
            gate = getattr(self.shared_experts, "gate_weight", None)
            if gate is not None:
                shared = shared * torch.sigmoid(F.linear(hidden, gate))
            out = out + shared
        return out, None
