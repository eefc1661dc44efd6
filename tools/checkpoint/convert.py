"""Convert between Hugging Face ``transformers`` directories and our checkpoints.

    python tools/checkpoint/convert.py import-hf --hf-dir DIR --save CKPT_DIR
    python tools/checkpoint/convert.py export-hf --load CKPT_DIR --hf-dir DIR
    python tools/checkpoint/convert.py import-megatron --load MEGATRON_DIR --save CKPT_DIR
    python tools/checkpoint/convert.py export-megatron --load CKPT_DIR --save MEGATRON_DIR

``import-hf`` reads a local ``GPT2LMHeadModel``, ``LlamaForCausalLM``, ``MistralForCausalLM``,
``Qwen2ForCausalLM``, ``MixtralForCausalLM``, ``Qwen2MoeForCausalLM`` or
``MegatronBertForPreTraining`` / ``MegatronBertForMaskedLM`` directory (``config.json`` +
safetensors or ``pytorch_model.bin``, loaded without running code) and writes a release
checkpoint (``--ckpt-format``: ``torch_dist`` by default, or ``torch``) that
``pretrain_gpt2.py`` / ``pretrain_bert.py --load`` trains under any layout with a fresh optimizer;
it prints the model flags to train it with. ``export-hf`` writes ``config.json``,
``model.safetensors`` and the tokenizer files (GPT-2 BPE, WordPiece or a fast tokenizer's
``tokenizer.json``) that ``from_pretrained`` loads, then checks the logits. ``import-megatron``
reads a Megatron-LM checkpoint (Megatron-core ``torch_dist`` or legacy ``mp_rank_*`` files of any
T x P, GPT and Llama-family layouts) into a release checkpoint; ``export-megatron`` writes ours as
Megatron-core ``torch_dist`` (see docs/MEGATRON_CHECKPOINTS.md).
"""

from __future__ import annotations

import argparse
import shlex

from megatron_chimera.checkpoint.checkpointing import CKPT_FORMATS, FORMAT_TORCH_DIST
from megatron_chimera.errors import ToolArgumentParser
from megatron_chimera.hf.convert import export_hf, import_hf
from megatron_chimera.inference.tool_support import run_cli
from megatron_chimera.megatron_lm.exporter import export_megatron
from megatron_chimera.megatron_lm.importer import import_megatron
from megatron_chimera.model.architecture import describe_model
from megatron_chimera.model.flags import model_flags


def build_parser() -> argparse.ArgumentParser:
    """The ``import-hf`` / ``export-hf`` command line."""
    parser = ToolArgumentParser(description=__doc__.split("\n\n")[0],
                                     allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import-hf", help="Hugging Face directory -> checkpoint",
                         allow_abbrev=False)
    imp.add_argument("--hf-dir", required=True, help="local directory written by save_pretrained")
    imp.add_argument("--save", required=True, help="new checkpoint directory")
    imp.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                     help="pad the vocabulary as training does (padding ids are masked)")
    imp.add_argument("--max-position-embeddings", type=int, default=None,
                     help="keep only the first N position embeddings (shorter context)")
    imp.add_argument("--no-verify", action="store_true",
                     help="skip comparing our logits with transformers' on a random batch")
    imp.add_argument("--ckpt-format", choices=CKPT_FORMATS, default=FORMAT_TORCH_DIST,
                     help="checkpoint format written (as training's --ckpt-format)")
    exp = sub.add_parser("export-hf", help="checkpoint -> Hugging Face directory",
                         allow_abbrev=False)
    exp.add_argument("--load", required=True, help="checkpoint directory (any layout)")
    exp.add_argument("--hf-dir", required=True, help="output directory")
    exp.add_argument("--overwrite", action="store_true", help="replace a non-empty --hf-dir")
    exp.add_argument("--model-type", choices=("llama", "mistral", "qwen2", "mixtral",
                                              "qwen2_moe"), default=None,
                     help="a RoPE model's Hugging Face architecture (default: as imported, "
                          "else qwen2 with a QKV bias, llama without; an MoE model: qwen2_moe "
                          "with a shared expert, mixtral without)")
    exp.add_argument("--no-verify", action="store_true",
                     help="skip loading the result with transformers and comparing logits")
    _add_megatron_commands(sub)
    return parser


def _add_megatron_commands(sub) -> None:
    imp = sub.add_parser("import-megatron", help="Megatron-LM checkpoint -> checkpoint",
                         allow_abbrev=False)
    imp.add_argument("--load", required=True,
                     help="Megatron-LM checkpoint directory (with its tracker) or iter_* directory")
    imp.add_argument("--save", required=True, help="new checkpoint directory")
    imp.add_argument("--ckpt-format", choices=CKPT_FORMATS, default=FORMAT_TORCH_DIST,
                     help="checkpoint format written (as training's --ckpt-format)")
    exp = sub.add_parser("export-megatron", help="checkpoint -> Megatron-core torch_dist",
                         allow_abbrev=False)
    exp.add_argument("--load", required=True, help="checkpoint directory (any layout)")
    exp.add_argument("--save", required=True, help="output directory (Megatron-LM --load)")
    exp.add_argument("--overwrite", action="store_true", help="write into a non-empty --save")


def _print_megatron_import(result, save: str) -> None:
    config = result.model_config
    print(f"imported {result.source.describe} at {result.source.path} ({result.tensors} tensors, "
          f"{config.num_layers} layers, hidden {config.hidden_size}, vocabulary "
          f"{config.vocab_size} rows) -> {result.checkpoint}")
    for note in result.notes:
        print(f"note: {note}")
    flags = model_flags(config, seq_length=config.seq_length)
    tok = result.tokenizer
    if tok.tokenizer_type is not None:
        flags += ["--tokenizer-type", tok.tokenizer_type]
        for flag, value in (("--vocab-file", tok.vocab_file), ("--merge-file", tok.merge_file),
                            ("--tokenizer-model", tok.tokenizer_model)):
            flags += [flag, value] if value else []
    print(f"train it with: pretrain_gpt2.py --load {shlex.quote(save)} "
          + " ".join(shlex.quote(str(f)) for f in flags) + " ...")


def _print_import(result, save: str) -> None:
    config = result.model_config
    script = result.family.entry_point
    flags = model_flags(config, seq_length=config.max_positions)
    tok = result.tokenizer
    if tok.tokenizer_type == "HuggingFaceTokenizer":
        flags += ["--tokenizer-type", tok.tokenizer_type, "--tokenizer-model",
                  tok.tokenizer_model]
    elif tok.tokenizer_type is not None:
        flags += ["--tokenizer-type", tok.tokenizer_type, "--vocab-file", tok.vocab_file]
        flags += ["--merge-file", tok.merge_file] if tok.merge_file else []
    kind = describe_model(result.family.name, config)
    print(f"imported {result.weights_file} ({kind}, {config.num_layers} layers, hidden "
          f"{config.hidden_size}, vocabulary {config.vocab_size} padded to "
          f"{config.padded_vocab_size}) -> {result.checkpoint}")
    for note in result.notes:
        print(f"note: {note}")
    _print_agreement(result.agreement)
    print(f"train it with: {script} --load {shlex.quote(save)} "
          + " ".join(shlex.quote(f) for f in flags) + " ...")


def _print_agreement(agreement) -> None:
    if agreement is not None:
        print(f"verified against transformers (fp32, random batch): max |logit difference| "
              f"{agreement.max_abs_logit_diff:.3e}, |loss difference| {agreement.loss_diff:.3e}")


def main(argv: list[str] | None = None) -> None:
    """Run one conversion."""
    args = build_parser().parse_args(argv)
    if args.command == "import-hf":
        result = import_hf(args.hf_dir, args.save, args.make_vocab_size_divisible_by,
                           args.max_position_embeddings, verify=not args.no_verify,
                           ckpt_format=args.ckpt_format)
        _print_import(result, args.save)
        return
    if args.command == "import-megatron":
        _print_megatron_import(import_megatron(args.load, args.save, args.ckpt_format),
                               args.save)
        return
    if args.command == "export-megatron":
        exported = export_megatron(args.load, args.save, overwrite=args.overwrite)
        print(f"exported {args.load} -> Megatron-core torch_dist {exported.path} "
              f"({exported.tensors} tensors, iteration {exported.iteration}); Megatron-LM loads "
              f"it with --load {args.save} --ckpt-format torch_dist --use-checkpoint-args")
        return
    result = export_hf(args.load, args.hf_dir, overwrite=args.overwrite,
                       verify=not args.no_verify, model_type=args.model_type)
    print(f"exported {args.load} as {result.architecture} -> {result.hf_dir} "
          f"({', '.join(result.files)})")
    for note in result.notes:
        print(f"note: {note}")
    _print_agreement(result.agreement)


if __name__ == "__main__":
    run_cli(main)
