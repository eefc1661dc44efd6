"""A small language model cut into pipeline stages, for the runtime's exactness tests.

``NUM_LAYERS`` residual layers ``h + tanh(Linear(h))`` (``megatron_chimera.model.linear.Linear``,
so split backward applies) between a word embedding and an output layer tied to it. Every
parameter is drawn from a generator seeded by (seed, stable key), so any stage slice has exactly
the weights of the same layers in the whole model and all replicas start identical.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_chimera.model.linear import Linear

NUM_LAYERS = 16
HIDDEN = 8
VOCAB = 11
SEQ = 4
MICRO_BATCH = 2
EMBEDDING_KEY = 10_000


def _generator(seed: int, key: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 100_003 + key)


class ToyStage(nn.Module):
    """Layers ``[start, end)``; the embedding on the first stage, the tied output on the last."""

    def __init__(self, start: int, end: int, pre_process: bool, post_process: bool,
                 seed: int = 1, dropout: float = 0.0) -> None:
        super().__init__()
        self.dropout = dropout
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_ids = list(range(start, end))
        self.layers = nn.ModuleList(Linear(HIDDEN, HIDDEN) for _ in self.layer_ids)
        with torch.no_grad():
            for layer_id, layer in zip(self.layer_ids, self.layers):
                g = _generator(seed, layer_id)
                layer.weight.copy_(torch.randn(HIDDEN, HIDDEN, generator=g) * HIDDEN**-0.5)
                layer.bias.copy_(torch.randn(HIDDEN, generator=g) * 0.1)
        self.word_embeddings = None
        if pre_process or post_process:
            weight = torch.randn(VOCAB, HIDDEN, generator=_generator(seed, EMBEDDING_KEY)) * 0.3
            self.word_embeddings = nn.Parameter(weight)
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """Input activations ``[s, b, h]`` of a non-first stage."""
        self.input_tensor = tensor

    def shared_embedding_or_output_weight(self) -> nn.Parameter | None:
        """The tied word-embedding copy held by this stage."""
        return self.word_embeddings

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Hidden states ``[s, b, h]``, or the per-token loss ``[b, s]`` at the last stage."""
        if self.pre_process:
            hidden = F.embedding(batch["tokens"], self.word_embeddings).transpose(0, 1)
        else:
            hidden = self.input_tensor
        for layer in self.layers:
            hidden = hidden + 0.25 * F.dropout(torch.tanh(layer(hidden)), self.dropout)
        if not self.post_process:
            return hidden
        logits = hidden.transpose(0, 1).matmul(self.word_embeddings.t())  # [b, s, V]
        return F.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1),
                               reduction="none").view_as(batch["labels"])


def forward_step(batch: dict[str, torch.Tensor], model: ToyStage):
    """Megatron's ``forward_step_func`` contract: (output, loss_func)."""
    output = model(batch)

    def loss_func(per_token: torch.Tensor):
        loss = per_token.mean()
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


def make_batch(step: int, dp_rank: int, microbatch: int) -> dict[str, torch.Tensor]:
    """Deterministic micro-batch ``(step, data-parallel replica, micro-batch)``."""
    g = torch.Generator().manual_seed(7919 * step + 104_729 * dp_rank + microbatch)
    return {
        "tokens": torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g),
        "labels": torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g),
    }


VARLEN_TOKENS = (3, 7, 5)  # the sequence lengths of the variable-length micro-batches


def make_varlen_batch(step: int, dp_rank: int, microbatch: int) -> dict[str, torch.Tensor]:
    """A packed (THD, one row) micro-batch of ``VARLEN_TOKENS[(step + dp + m) % 3]`` tokens."""
    g = torch.Generator().manual_seed(7919 * step + 104_729 * dp_rank + microbatch)
    n = VARLEN_TOKENS[(step + dp_rank + microbatch) % len(VARLEN_TOKENS)]
    return {"tokens": torch.randint(0, VOCAB, (1, n), generator=g),
            "labels": torch.randint(0, VOCAB, (1, n), generator=g)}


def build_stage(stage: int, num_stages: int, seed: int = 1, dropout: float = 0.0) -> ToyStage:
    """The module of model stage ``stage`` out of ``num_stages`` equal slices."""
    per = NUM_LAYERS // num_stages
    return ToyStage(stage * per, (stage + 1) * per, stage == 0, stage == num_stages - 1, seed,
                    dropout)


def reference_training(steps: int, num_microbatches: int, data_parallel_size: int,
                       make_optimizer, seed: int = 1, make=make_batch):
    """Single-process run on the same mini-batches: (losses per step, final model, eval losses).

    Per step the loss is ``sum over (replica, micro-batch) of loss / (N x W)``.
    """
    model = ToyStage(0, NUM_LAYERS, True, True, seed)
    optimizer = make_optimizer(list(model.parameters()))
    losses = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        step_losses = []
        for dp in range(data_parallel_size):
            for m in range(num_microbatches):
                loss = model(make(step, dp, m)).mean()
                (loss / (num_microbatches * data_parallel_size)).backward()
                step_losses.append(loss.item())
        optimizer.step()
        losses.append(step_losses)
    with torch.no_grad():
        eval_losses = [model(make(steps, dp, m)).mean().item()
                       for dp in range(data_parallel_size) for m in range(num_microbatches)]
    return losses, model, eval_losses
