"""Rank bodies of the context-parallel model tests: a whole GPT / Llama-style model on CP gloo
ranks (one pipeline stage) against the same model in one process, and the activation bytes
autograd saves per rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_chimera import parallel_state
from megatron_chimera.model.context_parallel import sequence_mean_loss, split_batch
from megatron_chimera.model.document_attention import DocumentMask
from megatron_chimera.model.gpt2 import GPTModel
from megatron_chimera.training.memory_report import SavedActivations
from tests.helpers.models import VOCAB, small_config

LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
             num_query_groups=2, add_bias_linear=False)


def _batch(seq: int, documents: bool):
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (2, seq), generator=generator)
    labels = torch.randint(0, VOCAB, (2, seq), generator=generator)
    loss_mask = (torch.rand(2, seq, generator=generator) > 0.2).float()
    positions = torch.arange(seq).expand(2, seq).contiguous()
    docs = None
    if documents:
        docs = torch.cumsum((torch.rand(2, seq, generator=generator) < 0.15).long(), dim=1)
    return tokens, labels, loss_mask, positions, docs


def _loss(model, tokens, labels, loss_mask, positions, docs):
    mask = None if docs is None else DocumentMask(docs)
    losses = model(tokens, positions, attention_mask=mask, labels=labels)
    return sequence_mean_loss(losses.float(), loss_mask)


def _relative(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def run_model_matches_one_process(rank, world_size, comm_type, llama, documents):
    """Loss and every gradient (summed over the context ranks, as the stage-replica reduction
    does) equal one process's (fp32 model: 1e-5 relative, other summation orders only)."""
    config = small_config(cp_comm_type=comm_type, **(LLAMA if llama else {}))
    tokens, labels, loss_mask, positions, docs = _batch(config.seq_length, documents)
    reference = GPTModel(config, seed=11)  # built before the groups: the whole sequence
    ref_loss, _ = _loss(reference, tokens, labels, loss_mask, positions, docs)
    ref_loss.backward()
    parallel_state.initialize_model_parallel(1, [[0]], 1, context_parallel_size=world_size)
    model = GPTModel(config, seed=11)
    loss, reported = _loss(model, *split_batch(tokens, labels, loss_mask, positions, docs))
    loss.backward()
    assert _relative(reported, ref_loss.detach()) < 1e-6, (reported, ref_loss)
    check_summed_gradients(model, reference, f"{comm_type} llama={llama} documents={documents}")
    parallel_state.destroy_model_parallel()


def check_summed_gradients(model, reference, label: str) -> None:
    """Every gradient of ``model``, summed over the context ranks (as the stage-replica
    reduction does), equals the one-process ``reference``'s (1e-5 relative)."""
    group = parallel_state.get_context_parallel_group()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad, group=group)
        err = _relative(grad, q.grad)
        assert err < 1e-5, f"{label}: {name} {err:.1e}"


def saved_activation_bytes(model, batch) -> int:
    """Peak bytes autograd holds for the backward during one forward (the memory report's
    saved-tensor meter: one count per storage, parameters excluded)."""
    with SavedActivations(model.parameters()) as meter:
        loss, _ = _loss(model, *batch)
    peak = meter.peak
    del loss
    return peak


def run_saved_activation_bytes(rank, world_size, limit):
    """Saved activation bytes per rank at CP = world over one process's for the same sequence
    (Llama-style model, 256 tokens) are at most ``limit``."""
    config = small_config(seq_length=256, num_layers=2, **LLAMA)
    batch = _batch(config.seq_length, documents=False)
    one = saved_activation_bytes(GPTModel(config, seed=3), batch)
    parallel_state.initialize_model_parallel(1, [[0]], 1, context_parallel_size=world_size)
    per_rank = saved_activation_bytes(GPTModel(config, seed=3), split_batch(*batch))
    ratio = per_rank / one
    if rank == 0:
        print(f"saved activation bytes per rank, CP={world_size} / CP=1: {per_rank} / {one} = "
              f"{ratio:.3f}", flush=True)
    assert ratio <= limit, f"saved activation bytes CP={world_size}: {ratio:.3f} x CP=1 > {limit}"
    parallel_state.destroy_model_parallel()


def run_model_cases(rank, world_size, cases, limit):
    """Every ``(comm_type, llama, documents)`` model case, then the saved-activation bound."""
    for case in cases:
        run_model_matches_one_process(rank, world_size, *case)
    run_saved_activation_bytes(rank, world_size, limit)
