"""Mixture of experts (Megatron-core's MoE flags, declared on their fields)."""

from __future__ import annotations

import argparse
import ast
from dataclasses import dataclass
from typing import ClassVar

from megatron_chimera.config.flag import flag, non_negative, positive
from megatron_chimera.errors import ConfigError

MOE_ROUTER_SCORE_FUNCTIONS = ("softmax", "sigmoid")  # --moe-router-score-function
MOE_LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")  # --moe-router-load-balancing-type
MOE_TOKEN_DISPATCHERS = ("alltoall", "allgather")  # --moe-token-dispatcher-type
GPT = "gpt2"  # the family that reads the MoE flags


def layer_freq(text: str) -> int | str:
    """``--moe-layer-freq``'s value: an int, or a list expression kept as written (checked
    here, expanded per layer by :func:`parse_moe_layer_freq`)."""
    try:
        value = _layer_freq_value(text)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return value if isinstance(value, int) else text


@dataclass(frozen=True)
class MoEConfig:
    """Mixture of experts; ``num_experts`` None: every MLP is dense.

    ``moe_layer_freq`` is an int k (layers 0, k, 2k, ... are MoE) or Megatron's list string, e.g.
    ``"[1,0,1,0]"`` or ``"([1]*3+[0])*2"`` (one 0/1 per layer; see :meth:`moe_layers`)."""

    FLAG_GROUP: ClassVar[str] = "mixture of experts"

    num_experts: int | None = flag(
        None, "--num-experts", type=int, check=positive, model=True, family=GPT,
        help="experts per MoE layer (default: none, every MLP is dense)")
    moe_ffn_hidden_size: int | None = flag(
        None, "--moe-ffn-hidden-size", type=int, check=positive, model=True, family=GPT,
        help="hidden size of each expert's MLP (default --ffn-hidden-size)")
    moe_router_topk: int = flag(2, "--moe-router-topk", check=positive, model=True, family=GPT,
                                help="experts each token is routed to")
    moe_router_score_function: str = flag(
        "softmax", "--moe-router-score-function", choices=MOE_ROUTER_SCORE_FUNCTIONS,
        model=True, family=GPT,
        help="softmax over the top-k logits (or over all with --moe-router-pre-softmax), or "
             "sigmoid normalised over the top-k")
    moe_router_pre_softmax: bool = flag(
        False, "--moe-router-pre-softmax", model=True, family=GPT,
        help="softmax over all experts before the top-k (softmax scores only)")
    moe_router_load_balancing_type: str = flag(
        "aux_loss", "--moe-router-load-balancing-type", choices=MOE_LOAD_BALANCING_TYPES,
        model=True, family=GPT,
        help="load-balancing loss: aux_loss (Switch Transformer's, per micro-batch), "
             "seq_aux_loss (per sequence), none")
    moe_aux_loss_coeff: float = flag(0.0, "--moe-aux-loss-coeff", check=non_negative,
                                     model=True, family=GPT,
                                     help="coefficient of the load-balancing loss")
    moe_z_loss_coeff: float | None = flag(
        None, "--moe-z-loss-coeff", type=float, check=non_negative, model=True, family=GPT,
        help="coefficient of the router z-loss (ST-MoE; default off)")
    moe_expert_capacity_factor: float | None = flag(
        None, "--moe-expert-capacity-factor", type=float, check=positive, model=True,
        family=GPT,
        help="each expert keeps at most ceil(tokens x topk / experts x factor) tokens, those of "
             "highest probability; the rest are dropped (default: dropless)")
    moe_shared_expert_intermediate_size: int | None = flag(
        None, "--moe-shared-expert-intermediate-size", type=int, check=positive, model=True,
        family=GPT, help="hidden size of a shared expert every token takes (default: none)")
    moe_shared_expert_gate: bool = flag(
        False, "--moe-shared-expert-gate", model=True, family=GPT,
        help="scale the shared expert's output by sigmoid(x w_g), one gate weight [1, h] per "
             "layer (Qwen2-MoE's shared_expert_gate; needs "
             "--moe-shared-expert-intermediate-size)")
    moe_layer_freq: int | str = flag(
        1, "--moe-layer-freq", type=layer_freq, model=True, family=GPT,
        help="MoE layers: an int k (every k-th layer from the first) or a list of 0/1 per "
             "layer, e.g. \"[1,0,1,0]\" or \"([1]*3+[0])*2\"")
    moe_token_dispatcher_type: str = flag(
        "allgather", "--moe-token-dispatcher-type", choices=MOE_TOKEN_DISPATCHERS, family=GPT,
        help="how tokens reach the experts of other expert-parallel ranks: alltoall or "
             "allgather")
    moe_grouped_gemm: bool = flag(
        False, "--moe-grouped-gemm", family=GPT,
        help="one grouped GEMM per projection over the local experts (torch._grouped_mm where "
             "this torch and device run it, a loop otherwise)")
    moe_per_layer_logging: bool = flag(False, "--moe-per-layer-logging", group="logging",
                                       family=GPT,
                                       help="log each MoE layer's auxiliary losses too")

    @property
    def enabled(self) -> bool:
        """Whether the model has MoE layers."""
        return self.num_experts is not None

    def moe_layers(self, num_layers: int) -> tuple[bool, ...]:
        """Which of the ``num_layers`` layers (0-based) are MoE layers (Megatron's
        ``--moe-layer-freq``: int k -> every k-th layer from layer 0; a list -> its 0/1 pattern,
        one entry per layer)."""
        if not self.enabled:
            return (False,) * num_layers
        return parse_moe_layer_freq(self.moe_layer_freq, num_layers)


def parse_moe_layer_freq(freq: int | str, num_layers: int) -> tuple[bool, ...]:
    """``--moe-layer-freq`` as one flag per layer; ConfigError naming the flag when malformed.
    A string is an int or a Python list expression of 0/1 built from list literals, ``+`` and
    ``*`` (evaluated on its syntax tree, never by ``eval``)."""
    if isinstance(freq, str):
        freq = _layer_freq_value(freq)
    if isinstance(freq, int) and not isinstance(freq, bool):
        if freq < 1:
            raise ConfigError(f"--moe-layer-freq {freq} must be >= 1")
        return tuple(i % freq == 0 for i in range(num_layers))
    pattern = list(freq)
    if len(pattern) != num_layers or any(v not in (0, 1) for v in pattern):
        raise ConfigError(f"--moe-layer-freq {pattern} must hold one 0 or 1 per layer "
                          f"(--num-layers {num_layers})")
    return tuple(bool(v) for v in pattern)


def _layer_freq_value(text: str) -> int | list[int]:
    """The int or list a ``--moe-layer-freq`` string denotes (list literals, ``+``, ``*``)."""

    def value(node: ast.AST):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, (ast.List, ast.Tuple)):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ConfigError(f"--moe-layer-freq {text!r}: only ints, lists, + and * are allowed")

    try:
        result = value(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, TypeError) as error:
        raise ConfigError(f"--moe-layer-freq {text!r} is not an int or a list expression "
                          f"({error})") from None
    if isinstance(result, list) and any(isinstance(v, list) for v in result):
        raise ConfigError(f"--moe-layer-freq {text!r} must be a flat list of 0/1")
    return result
