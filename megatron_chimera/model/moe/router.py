"""Top-k router (Megatron-core's ``TopKRouter`` semantics; formulas from its documentation and the
Switch Transformer / ST-MoE papers).

Tokens are ``[s x b, h]`` in sequence-major order (token ``i x b + j`` is position ``i`` of
sequence ``j``). Routing:

- logits ``= x W_r^T`` (``W_r``: ``[experts, h]``, replicated on every rank);
- z-loss (``--moe-z-loss-coeff c``): ``c x mean(logsumexp(logits)^2)``;
- scores: ``softmax`` -- top-k of the logits then softmax over the k (with
  ``--moe-router-pre-softmax``: softmax over all experts, then top-k); ``sigmoid`` -- top-k of
  ``sigmoid(logits)``, normalised to sum 1 when k > 1;
- capacity (``--moe-expert-capacity-factor f``): each expert keeps at most
  ``ceil(tokens x k / experts x f)`` of its tokens, those with the highest routing probability
  (Megatron's ``probs`` drop policy); the others are dropped (their probability becomes 0);
- load balancing on the scores of *all* experts ``P`` (softmax, or sigmoid normalised per token)
  and the top-k choice before dropping ``f_e`` (tokens per expert): ``aux_loss`` is
  ``c x E / (k x T^2) x sum_e (sum_t P[t, e]) x f_e`` over the T tokens of the micro-batch;
  ``seq_aux_loss`` the same per sequence (T = s) averaged over the b sequences.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_chimera.config import (
    MOE_LOAD_BALANCING_TYPES,
    MOE_ROUTER_SCORE_FUNCTIONS,
    ConfigError,
    ModelConfig,
)
from megatron_chimera.model.moe.aux_loss import AuxLossLog, attach_aux_loss
from megatron_chimera.model.utils import init_normal_, layer_key, make_generator

AUX_LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}


def check_router(config: ModelConfig) -> None:
    """ConfigError naming the flag for an unusable routing setting."""
    moe = config.moe
    if moe.num_experts < 1:
        raise ConfigError(f"--num-experts {moe.num_experts} must be >= 1")
    if not 1 <= moe.moe_router_topk <= moe.num_experts:
        raise ConfigError(f"--moe-router-topk {moe.moe_router_topk} must be in 1..--num-experts "
                          f"{moe.num_experts}")
    if moe.moe_router_score_function not in MOE_ROUTER_SCORE_FUNCTIONS:
        raise ConfigError(f"--moe-router-score-function must be one of "
                          f"{MOE_ROUTER_SCORE_FUNCTIONS}, got {moe.moe_router_score_function!r}")
    if moe.moe_router_load_balancing_type not in MOE_LOAD_BALANCING_TYPES:
        raise ConfigError(f"--moe-router-load-balancing-type must be one of "
                          f"{MOE_LOAD_BALANCING_TYPES}, got "
                          f"{moe.moe_router_load_balancing_type!r}")
    if moe.moe_router_pre_softmax and moe.moe_router_score_function != "softmax":
        raise ConfigError("--moe-router-pre-softmax needs --moe-router-score-function softmax")
    if moe.moe_expert_capacity_factor is not None and moe.moe_expert_capacity_factor <= 0:
        raise ConfigError(f"--moe-expert-capacity-factor {moe.moe_expert_capacity_factor} must "
                          f"be > 0")


def expert_capacity(num_tokens: int, topk: int, num_experts: int, factor: float) -> int:
    """Tokens one expert keeps: ``ceil(num_tokens x topk / num_experts x factor)``."""
    return math.ceil(num_tokens * topk / num_experts * factor)


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """ST-MoE's router z-loss: ``coeff x mean over tokens of logsumexp(logits)^2``."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean() * coeff


def topk_scores(logits: torch.Tensor, topk: int, score_function: str, pre_softmax: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k experts of each token and their routing probabilities (fp32), both
    ``[tokens, k]``."""
    if score_function == "softmax":
        if pre_softmax:
            return torch.softmax(logits.float(), dim=-1).topk(topk, dim=-1)
        top, indices = logits.float().topk(topk, dim=-1)
        return torch.softmax(top, dim=-1), indices
    top, indices = torch.sigmoid(logits.float()).topk(topk, dim=-1)
    if topk > 1:
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    return top, indices


def drop_over_capacity(probs: torch.Tensor, routing_map: torch.Tensor, capacity: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep, per expert, the ``capacity`` tokens of highest probability among those routed to it;
    ``probs`` / ``routing_map`` ``[tokens, experts]`` with the others zeroed / cleared."""
    if capacity >= probs.shape[0]:
        return probs, routing_map
    kept = probs.topk(capacity, dim=0).indices
    capacity_mask = torch.zeros_like(routing_map).scatter_(0, kept, True)
    routing_map = routing_map & capacity_mask
    return probs * routing_map, routing_map


def aux_loss_scores(logits: torch.Tensor, topk: int, score_function: str
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of every expert (softmax, or sigmoid normalised per token) and the top-k choice
    ``[tokens, experts]`` bool, for the load-balancing loss."""
    if score_function == "softmax":
        scores = torch.softmax(logits.float(), dim=-1)
    else:
        scores = torch.sigmoid(logits.float())
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    chosen = scores.topk(topk, dim=-1).indices
    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, chosen, True)
    return scores, routing_map


def switch_load_balancing_loss(scores: torch.Tensor, tokens_per_expert: torch.Tensor,
                               num_tokens: int, topk: int, num_experts: int,
                               coeff: float) -> torch.Tensor:
    """Switch Transformer's loss ``coeff x E x sum_e f_e P_e`` with ``f_e`` = tokens per expert /
    (T x k) and ``P_e`` = summed scores / T (``scores`` ``[T, E']``, ``E'`` a multiple of E when
    sequences are folded into the expert dimension)."""
    return (scores.sum(dim=0) * tokens_per_expert).sum() * (
        num_experts * coeff / (topk * num_tokens * num_tokens))


class TopKRouter(nn.Module):
    """Routes ``[tokens, h]`` to ``--moe-router-topk`` of ``--num-experts`` experts."""

    def __init__(self, config: ModelConfig, layer_number: int, seed: int,
                 sequence_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        check_router(config)
        # sequence parallelism: the tensor ranks holding the other positions of the sequences
        self.sequence_group = sequence_group
        self.sequence_split = dist.get_world_size(sequence_group) if sequence_group else 1
        moe = config.moe
        self.layer_number = layer_number
        self.num_experts = moe.num_experts
        self.topk = moe.moe_router_topk
        self.score_function = moe.moe_router_score_function
        self.pre_softmax = moe.moe_router_pre_softmax
        self.load_balancing = moe.moe_router_load_balancing_type
        self.aux_loss_coeff = moe.moe_aux_loss_coeff
        self.z_loss_coeff = moe.moe_z_loss_coeff
        self.capacity_factor = moe.moe_expert_capacity_factor
        self.weight = nn.Parameter(torch.empty(moe.num_experts, config.hidden_size,
                                               dtype=config.torch_dtype))
        init_normal_(self.weight, config.init_method_std,
                     make_generator(seed, f"{layer_key(layer_number - 1)}.router"))
        self.aux_loss_scale = 1.0  # set by aux_loss.set_aux_loss_scale
        self.aux_log = AuxLossLog()

    def forward(self, tokens: torch.Tensor, seq_length: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, h]`` (sequence-major, ``seq_length`` positions of this rank) -> routing
        probabilities ``[T, E]`` (fp32, zero where not routed) and the routing map ``[T, E]``
        (bool). With sequence parallelism each auxiliary loss is this rank's share of the loss
        of the whole sequences (the shares sum to it over the tensor ranks, as the router's
        gradients do); the logged value is scaled so that its mean over the ranks is the
        whole."""
        logits = F.linear(tokens, self.weight)
        training = self.training and torch.is_grad_enabled()
        if training and self.z_loss_coeff:
            loss = z_loss(logits, self.z_loss_coeff) / self.sequence_split
            logits = attach_aux_loss(logits, loss, self.aux_loss_scale)
            self.aux_log.record("z_loss", self._whole(loss) / self.z_loss_coeff)
        top, indices = topk_scores(logits, self.topk, self.score_function, self.pre_softmax)
        probs = torch.zeros_like(logits, dtype=top.dtype).scatter(1, indices, top)
        routing_map = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, indices, True)
        if self.capacity_factor is not None:
            capacity = expert_capacity(tokens.shape[0], self.topk, self.num_experts,
                                       self.capacity_factor)
            probs, routing_map = drop_over_capacity(probs, routing_map, capacity)
        if training and self.load_balancing != "none" and self.aux_loss_coeff:
            probs = self._load_balancing(probs, logits, seq_length)
        return probs, routing_map

    def _load_balancing(self, probs: torch.Tensor, logits: torch.Tensor,
                        seq_length: int) -> torch.Tensor:
        scores, chosen = aux_loss_scores(logits, self.topk, self.score_function)
        num_tokens, whole = scores.shape[0], self.sequence_split  # (whole: the tensor ranks)
        if self.load_balancing == "seq_aux_loss":
            # fold the b sequences into the expert dimension: one loss per sequence, averaged
            batch = num_tokens // seq_length
            scores = scores.reshape(seq_length, batch * self.num_experts)
            chosen = chosen.reshape(seq_length, batch * self.num_experts)
            loss = switch_load_balancing_loss(
                scores, self._counts(chosen), seq_length * whole, self.topk, self.num_experts,
                self.aux_loss_coeff) / batch
        else:
            loss = switch_load_balancing_loss(scores, self._counts(chosen), num_tokens * whole,
                                              self.topk, self.num_experts, self.aux_loss_coeff)
        self.aux_log.record(AUX_LOSS_NAMES[self.load_balancing],
                            self._whole(loss) / self.aux_loss_coeff)
        return attach_aux_loss(probs, loss, self.aux_loss_scale)

    def _counts(self, chosen: torch.Tensor) -> torch.Tensor:
        """Tokens choosing each expert (column), over the whole sequences."""
        counts = chosen.sum(dim=0)
        if self.sequence_group is not None:
            dist.all_reduce(counts, group=self.sequence_group)
        return counts

    def _whole(self, share: torch.Tensor) -> torch.Tensor:
        """What this rank logs for a loss whose share it holds: the share times the tensor
        ranks, so that the mean over the ranks (:func:`aux_loss.reduce_aux_losses`) is the
        whole sequences' loss (no collective in the forward)."""
        return share.detach() * self.sequence_split
