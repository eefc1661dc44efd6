#!/usr/bin/env python
"""Partition GPT-2 or BERT into pipeline stages, with memory estimates per stage and per rank.

Example (the paper's 64-layer GPT-2 over 8 stages)::

    python examples/demo_model.py --model gpt2-64 -D 8 --micro-batch-size 1

Prints the layers, parameters, weight memory (parameters + gradients + Adam state) and activation
memory per micro-batch of every stage, and the peak memory of every rank under Chimera (two weight
copies per rank, balanced activations) and under 1F1B (one copy, most activations on rank 0).
Then it builds a small version of the same model (hidden 64, two layers per stage) stage slice by
stage slice with the real model classes, shows what each slice holds, and checks that the
analytic parameter count and weight bytes equal the real ones (exit code 1 if not).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from megatron_chimera.config import ConfigError, ModelConfig
from megatron_chimera.model.bert import build_bert_stage
from megatron_chimera.model.family import ModelFamily
from megatron_chimera.model.gpt2 import build_gpt_stage
from megatron_chimera.model.memory import estimate_stage_memory
from megatron_chimera.model.partition import partition_layers
from megatron_chimera.model.presets import DTYPES, SIZE_FLAGS, add_model_arguments, make_model
from megatron_chimera.tuning.playground import PARTITION_CHOICES, Settings, section_partition

CHECK_HIDDEN, CHECK_HEADS, CHECK_SEQ, CHECK_VOCAB = 64, 4, 32, 500


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Model, stage count, micro-batch size, partition method, precision."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    add_model_arguments(p, default="gpt2-64")
    p.add_argument("--pipeline-model-parallel-size", "-D", type=int, default=8,
                   help="pipeline stages (even for Chimera, default 8)")
    p.add_argument("--num-microbatches", "-N", type=int, default=None,
                   help="micro-batches per iteration for the per-rank estimate (default D)")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--partition-method", choices=PARTITION_CHOICES, default="uniform")
    p.add_argument("--params-dtype", choices=DTYPES, default="fp32")
    p.add_argument("--no-real-check", action="store_true",
                   help="skip building the small model's stage slices")
    return p.parse_args(argv)


def small_version(config: ModelConfig, num_stages: int) -> ModelConfig:
    """The same architecture (type, tying, precision) at hidden 64 with two layers per stage."""
    return dataclasses.replace(
        config, num_layers=2 * num_stages, hidden_size=CHECK_HIDDEN,
        num_attention_heads=CHECK_HEADS, ffn_hidden_size=None, seq_length=CHECK_SEQ,
        max_position_embeddings=None, vocab_size=CHECK_VOCAB)


def describe_slice(module: torch.nn.Module, start: int, end: int) -> str:
    """What one stage slice holds, in parameter order: embeddings, layers, heads."""
    parts: list[str] = []
    for name, _ in module.named_parameters():
        path = name.rsplit(".", 1)[0].removeprefix("language_model.").split(".")
        if "layers" in path:
            part = f"transformer layers {start}-{end - 1}"
        elif path[0] in ("embedding", "encoder"):
            part = ".".join(path[:2])
        else:
            part = path[0] + (" (copy of the tied embedding)" if path[0] == "word_embeddings"
                              else "")
        if part not in parts:
            parts.append(part)
    return ", ".join(parts)


def check_real_slices(family: ModelFamily, config: ModelConfig, num_stages: int, method: str,
                      micro_batch_size: int) -> bool:
    """Build each stage slice of the small model; compare parameters and bytes with the estimate."""
    small = small_version(config, num_stages)
    partition = partition_layers(small.num_layers, num_stages, method, config=small,
                                 family=family)
    estimate = estimate_stage_memory(small, family, partition, micro_batch_size)
    build = build_bert_stage if family.sentence_heads else build_gpt_stage
    print(f"\nreal stage slices of a small {family.title} ({small.num_layers} layers, hidden "
          f"{small.hidden_size}, vocab {small.padded_vocab_size}, {small.params_dtype}):")
    ok = True
    for stage, (start, end) in enumerate(partition):
        module = build(small, partition, stage).to(small.torch_dtype)
        params = sum(p.numel() for p in module.parameters())
        nbytes = sum(p.numel() * p.element_size() for p in module.parameters())
        match = params == estimate[stage].parameters and nbytes == estimate[stage].param_bytes
        ok &= match
        print(f"  stage {stage}: {describe_slice(module, start, end)}")
        print(f"    parameters real {params:,} / estimated {estimate[stage].parameters:,}; "
              f"bytes real {nbytes:,} / estimated {estimate[stage].param_bytes:,}: "
              f"{'match' if match else 'MISMATCH'}")
    return ok


def print_partition(family: ModelFamily, config: ModelConfig, args: argparse.Namespace) -> None:
    """The stage table once, then the per-rank memory under Chimera and under 1F1B."""
    D = args.pipeline_model_parallel_size
    texts, notes = [], []
    for schedule in ("chimera", "1f1b"):
        settings = Settings(schedule=schedule, D=D, N=args.num_microbatches or D,
                            model=args.model, family=family, config=config,
                            micro_batch_size=args.micro_batch_size,
                            partition_method=args.partition_method)
        try:
            texts.append(section_partition(settings))
        except ValueError as exc:  # e.g. Chimera needs an even D
            if schedule == "1f1b" or isinstance(exc, ConfigError):
                raise
            notes.append(f"per rank under chimera: not available ({exc})")
    print(texts[0])
    for text in texts[1:]:  # the stage table is the same for every schedule
        print(text[text.index("\nper rank"):].lstrip("\n"))
    print("\n".join(notes))


def main(argv: list[str] | None = None) -> int:
    """Print the partition and memory estimates, then check them against real slices."""
    args = parse_args(argv)
    D = args.pipeline_model_parallel_size
    try:
        if D < 1 or args.micro_batch_size < 1:
            raise ConfigError("--pipeline-model-parallel-size and --micro-batch-size must be "
                              "positive")
        family, config = make_model(args.model, args.model_type, args.params_dtype,
                                  **{f: getattr(args, f) for f in SIZE_FLAGS})
        print_partition(family, config, args)
    except (ValueError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.no_real_check:
        return 0
    if not check_real_slices(family, config, D, args.partition_method, args.micro_batch_size):
        print("the analytic estimate does not match the real model", file=sys.stderr)
        return 1
    print("the analytic parameter counts and weight bytes match the real stage slices")
    return 0


if __name__ == "__main__":
    sys.exit(main())
