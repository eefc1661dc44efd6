"""Generate text from a GPT checkpoint on one process (CPU or one GPU), with a KV cache.

    python tools/generate_text.py --load CKPT_DIR --prompt TEXT --max-new-tokens N \\
        [--greedy | --temperature T --top-k K --top-p P] [--seed S]

The model shape and the tokenizer come from the checkpoint's saved arguments (any layout it was
trained on). Prompts: ``--prompt`` (repeatable) and/or ``--prompt-file`` (one per line); an empty
prompt starts from the end-of-document token. Generation stops at end-of-document unless
``--ignore-eod``. Without ``--greedy`` it samples (temperature 1, no top-k / top-p by default).
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from megatron_chimera.atomic import atomic_write
from megatron_chimera.config import ConfigError
from megatron_chimera.errors import ToolArgumentParser
from megatron_chimera.inference.generation import SamplingParams, generate
from megatron_chimera.inference.tool_support import (
    add_checkpoint_args,
    load_gpt,
    prompt_token_ids,
    run_cli,
)


def build_parser() -> argparse.ArgumentParser:
    """The generation command line."""
    parser = ToolArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    add_checkpoint_args(parser)
    parser.add_argument("--prompt", action="append", default=None, help="repeatable")
    parser.add_argument("--prompt-file", default=None, help="one prompt per non-empty line")
    parser.add_argument("--max-new-tokens", type=int, required=True)
    parser.add_argument("--greedy", action="store_true", help="argmax decoding")
    parser.add_argument("--temperature", type=float, default=None, help="default 1.0")
    parser.add_argument("--top-k", type=int, default=None, help="default 0 (off)")
    parser.add_argument("--top-p", type=float, default=None, help="default 1.0 (off)")
    parser.add_argument("--seed", type=int, default=None,
                        help="sampling seed (default: a random one, printed)")
    parser.add_argument("--ignore-eod", action="store_true",
                        help="keep generating past the end-of-document token")
    parser.add_argument("--output-file", default=None,
                        help="also write one JSON object per prompt to this file (JSONL)")
    return parser


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """``--greedy`` or the sampling flags (never both)."""
    given = [f"--{n.replace('_', '-')}" for n in ("temperature", "top_k", "top_p")
             if getattr(args, n) is not None]
    if args.greedy and given:
        raise ConfigError(f"{given[0]} cannot be combined with --greedy")
    return SamplingParams(
        greedy=args.greedy,
        temperature=1.0 if args.temperature is None else args.temperature,
        top_k=0 if args.top_k is None else args.top_k,
        top_p=1.0 if args.top_p is None else args.top_p)


def read_prompts(args: argparse.Namespace) -> list[str]:
    """``--prompt`` values, then the lines of ``--prompt-file``."""
    prompts = list(args.prompt or [])
    if args.prompt_file is not None:
        try:
            with open(args.prompt_file, encoding="utf-8") as handle:
                prompts += [line.rstrip("\n") for line in handle if line.strip()]
        except OSError as exc:
            raise ConfigError(f"--prompt-file {args.prompt_file}: {exc.strerror}") from None
    if not prompts:
        raise ConfigError("give --prompt TEXT and/or --prompt-file FILE")
    return prompts


def main(argv: list[str] | None = None) -> None:
    """Load the checkpoint, generate for every prompt, print (and optionally save) the text."""
    args = build_parser().parse_args(argv)
    params = sampling_params(args)
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    prompts = read_prompts(args)
    loaded, tokenizer = load_gpt(args, "generate_text.py")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    device = next(loaded.model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    eod = tokenizer.eod
    all_ids = [prompt_token_ids(tokenizer, prompt, args.load) for prompt in prompts]
    mode = "greedy" if params.greedy else f"sampling, seed {seed}"
    print(f"checkpoint {loaded.root} (iteration {loaded.iteration}), {mode}", flush=True)
    records = []
    for index, (prompt, prompt_ids) in enumerate(zip(prompts, all_ids)):
        new = generate(loaded.model, prompt_ids, args.max_new_tokens, params, generator,
                       stop_token=None if args.ignore_eod else eod)
        completion = tokenizer.detokenize(new)
        print(f"--- sample {index + 1}/{len(prompts)} ({len(prompt_ids)} prompt tokens, "
              f"{len(new)} new)\n{prompt}{completion}", flush=True)
        records.append({"prompt": prompt, "prompt_tokens": prompt_ids, "tokens": new,
                        "completion": completion})
    if args.output_file is not None:
        data = "".join(json.dumps(r) + "\n" for r in records).encode()
        atomic_write(args.output_file, lambda handle: handle.write(data))


if __name__ == "__main__":
    run_cli(main)
