"""Autoregressive text generation from a GPT model on one device, with a KV cache.

The prompt is run once (prefill), storing every layer's keys and values (the key/value heads
only, RoPE applied, with grouped-query attention one per group); each new token then runs one
position through the layers, attending to the cache. The layers' own modules (layer norms,
``query_key_value``, ``dense``, MLP, the tied or untied head with its padded-vocabulary mask) are
reused, so the cached path computes what ``GPTModel.forward`` computes (a test holds them equal).
Next-token choice: greedy (argmax), or sampling with temperature, then top-k, then top-p (nucleus),
applied in that order as Hugging Face does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_chimera.config import ConfigError
from megatron_chimera.model.gpt2 import GPTModel


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen (``--greedy`` or ``--temperature/--top-k/--top-p``)."""

    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1.0: no nucleus filter

    def __post_init__(self) -> None:
        if not self.temperature > 0.0:
            raise ConfigError(f"--temperature must be positive, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"--top-k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"--top-p must be in (0, 1], got {self.top_p}")


class KVCache:
    """Per-layer keys and values ``[b, kv heads, t, head_dim]`` of the positions run so far (the
    key/value heads only: one per query group with grouped-query attention)."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    @property
    def length(self) -> int:
        """Number of cached positions."""
        return 0 if self.keys[0] is None else int(self.keys[0].shape[2])

    def extend(self, layer: int, key: torch.Tensor,
               value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this step's keys/values of ``layer``; return all of them."""
        if self.keys[layer] is not None:
            key = torch.cat([self.keys[layer], key], dim=2)
            value = torch.cat([self.values[layer], value], dim=2)
        self.keys[layer], self.values[layer] = key, value
        return key, value


@torch.no_grad()
def forward_cached(model: GPTModel, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits ``[b, s, V]`` of ``tokens`` ``[b, s]`` at positions ``cache.length ...``; extends
    the cache. ``model`` must be a whole GPT model in eval mode."""
    if not (model.pre_process and model.post_process):
        raise ValueError("generation needs the whole model (first and last stage)")
    if any(layer.self_attention.num_heads != model.config.num_attention_heads
           for layer in model.language_model.encoder.layers):
        raise ConfigError("text generation runs the whole model on one process: it cannot use "
                          "a tensor-parallel shard (--tensor-model-parallel-size must be 1; "
                          "checkpoints hold full tensors, load them with T = 1)")
    start, (b, s) = cache.length, tokens.shape
    lm = model.language_model
    positions = torch.arange(start, start + s, device=tokens.device).expand(b, s)
    hidden = lm.embedding(tokens, positions)  # [s, b, h]
    rotary = lm.encoder.rotary_tables(hidden, positions)
    # query i (absolute position start + i) may attend to keys 0 .. start + i
    allowed = (torch.arange(start + s, device=tokens.device)[None, :]
               <= torch.arange(start, start + s, device=tokens.device)[:, None])
    for index, layer in enumerate(lm.encoder.layers):
        attention = layer.self_attention
        qkv, _ = attention.query_key_value(layer.input_layernorm(hidden))
        query, key, value = attention.query_key_value_heads(qkv, rotary)
        key, value = attention.repeat_key_value(*cache.extend(index, key, value))
        context = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed)
        context = context.permute(2, 0, 1, 3).reshape(s, b, -1)
        hidden = _residual(hidden, attention.dense(context))
        hidden = _residual(hidden, layer.mlp(layer.post_attention_layernorm(hidden)))
    return model.output_logits(lm.encoder.final_layernorm(hidden))


def _residual(hidden: torch.Tensor, output: tuple[torch.Tensor, torch.Tensor | None]
              ) -> torch.Tensor:
    """``hidden + out (+ bias)`` for a block's ``(out, bias)`` (no dropout: eval)."""
    out, bias = output
    return hidden + (out if bias is None else out + bias)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``[b, V]`` logits after temperature, top-k and top-p; removed entries are -inf."""
    logits = logits.float() / params.temperature
    if params.top_k > 0:
        k = min(params.top_k, logits.shape[-1])
        kth = torch.topk(logits, k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        remove_sorted = mass_before >= params.top_p  # keeps the smallest set reaching top_p
        remove_sorted[..., 0] = False
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def next_token(logits: torch.Tensor, params: SamplingParams,
               generator: torch.Generator | None) -> torch.Tensor:
    """The chosen ids ``[b]`` for last-position logits ``[b, V]``."""
    if params.greedy:
        return torch.argmax(logits, dim=-1)
    probs = torch.softmax(filter_logits(logits, params), dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def generate(model: GPTModel, prompt: list[int], max_new_tokens: int, params: SamplingParams,
             generator: torch.Generator | None = None,
             stop_token: int | None = None) -> list[int]:
    """The ids generated after ``prompt`` (at most ``max_new_tokens``; stops after
    ``stop_token``, which is not returned)."""
    if not prompt:
        raise ValueError("the prompt must have at least one token")
    limit = model.config.max_positions
    if len(prompt) + max_new_tokens > limit:
        raise ConfigError(f"--max-new-tokens {max_new_tokens}: prompt ({len(prompt)} tokens) plus "
                          f"new tokens exceed the model's {limit} positions")
    device = next(model.parameters()).device
    cache = KVCache(len(model.language_model.encoder.layers))
    logits = forward_cached(model, torch.tensor([prompt], device=device), cache)[:, -1]
    out: list[int] = []
    for step in range(max_new_tokens):
        token = next_token(logits, params, generator)
        if stop_token is not None and int(token) == stop_token:
            break
        out.append(int(token))
        if step + 1 < max_new_tokens:
            logits = forward_cached(model, token.view(1, 1), cache)[:, -1]
    return out
