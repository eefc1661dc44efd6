#!/usr/bin/env python
"""Choose T, W, D, B, N, the pipeline schedule and recomputation before spending GPU hours.

Example (the paper's BERT-48 on 32 P100s, mini-batch 512)::

    python tools/autotune.py --model bert --num-layers 48 --hidden-size 1024 \\
        --num-attention-heads 16 --seq-length 128 --num-gpus 32 --global-batch-size 512 \\
        --hardware p100

Prints the ranked table (configuration, predicted iteration time, samples/s, bubble ratio, peak
memory per rank, fits) and the ``torchrun`` command of the best layout; ``--json PATH`` writes the
ranked list. ``--profile`` replaces the analytic stage times by timings of the real model classes
on this machine; ``--measure-p2p`` replaces the network profile by a measured ping-pong.
``--stage-costs-json PATH`` writes the best layout's per-stage F, B, W and p2p seconds, which
``pretrain_*.py --chimera-zb-costs @PATH`` takes as they are.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from megatron_chimera.atomic import atomic_write
from megatron_chimera.config import ConfigError, ModelConfig
from megatron_chimera.config.flag import flag_fields
from megatron_chimera.config.moe import MoEConfig
from megatron_chimera.config.parallel import ParallelConfig
from megatron_chimera.errors import ToolArgumentParser, run_tool
from megatron_chimera.model.architecture import check_architecture, describe_model
from megatron_chimera.model.presets import MODEL_PRESETS
from megatron_chimera.schedules.registry import add_schedule_arguments, spec_and_options_from
from megatron_chimera.training.arguments import add_architecture_arguments, architecture_fields
from megatron_chimera.tuning.analytic_costs import ModelSpec
from megatron_chimera.tuning.autotune import (
    DEFAULT_SCHEDULES,
    SearchSpace,
    autotune,
    format_table,
    to_records,
)
from megatron_chimera.tuning.command import torchrun_command
from megatron_chimera.tuning.error_bars import describe_error, nearest_family
from megatron_chimera.tuning.hardware import GB, PRESETS, HardwareProfile, load_hardware
from megatron_chimera.tuning.length_mix import MixPerformanceModel
from megatron_chimera.tuning.perf_model import PerformanceModel, Prediction
from megatron_chimera.tuning.precision import (
    DEFAULT_RECIPE,
    FP8_FORMATS,
    FP8_RECIPES,
    Fp8Config,
    fp8_from_flags,
)
from megatron_chimera.tuning.published import megatron_flops
from megatron_chimera.tuning.training_plan import RUNTIMES, TrainingPlan

DEFAULT_VOCAB = {"gpt2": 50257, "bert": 30522}


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        message = f"expected comma-separated integers, got {text!r}"
        raise argparse.ArgumentTypeError(message) from None


def _name_list(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The model flags, as pretrain_gpt2.py / pretrain_bert.py."""
    g = p.add_argument_group("model (as pretrain_gpt2.py / pretrain_bert.py)")
    g.add_argument("--model", choices=("gpt2", "bert"), default="gpt2")
    g.add_argument("--preset", choices=tuple(MODEL_PRESETS), default=None,
                   help="a named model (its family, sizes and architecture; --seq-length may "
                        "override its sequence); replaces the size flags")
    g.add_argument("--num-layers", type=int, default=None, help="required without --preset")
    g.add_argument("--hidden-size", type=int, default=None, help="required without --preset")
    g.add_argument("--num-attention-heads", type=int, default=None,
                   help="required without --preset")
    g.add_argument("--seq-length", type=int, default=None, help="required without --preset")
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--vocab-size", type=int, default=None,
                   help="tokenizer vocabulary (default: 50257 for gpt2, 30522 for bert)")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--bert-no-binary-head", action="store_false", dest="bert_binary_head")
    g.add_argument("--no-masked-softmax-fusion", action="store_false",
                   dest="masked_softmax_fusion",
                   help="unfused attention: the [s, s] scores are kept for the backward "
                   "(as the paper's 2021 implementation)")
    add_architecture_arguments(g)
    precision = g.add_mutually_exclusive_group()
    precision.add_argument("--fp16", action="store_true")
    precision.add_argument("--bf16", action="store_true")
    g.add_argument("--fp8-format", choices=FP8_FORMATS, default=None,
                   help="price the linears' GEMMs in FP8 (Megatron's flag; with --bf16 or "
                        "--fp16; needs a profile with FP8 tensor cores, e.g. h100)")
    g.add_argument("--fp8-recipe", choices=FP8_RECIPES, default=None,
                   help=f"FP8 scaling recipe (Megatron's; default {DEFAULT_RECIPE}); mxfp8 "
                        f"needs MX tensor cores (Blackwell)")
    _add_moe_arguments(p)



def _add_moe_arguments(p: argparse.ArgumentParser) -> None:
    """The MoE flags, declared from their config fields (``config/moe.py``)."""
    g = p.add_argument_group("mixture of experts (as pretrain_gpt2.py)")
    for f, spec in flag_fields(MoEConfig):
        spec.add_to(g, f.name, f.default)


def moe_config(args: argparse.Namespace) -> MoEConfig:
    """MoEConfig from the MoE flags (ConfigError naming a flag that is out of range)."""
    values = {}
    for f, spec in flag_fields(MoEConfig):
        value = getattr(args, f.name)
        problem = spec.check(value) if spec.check is not None and value is not None else None
        if problem:
            raise ConfigError(f"{spec.name} {problem}")
        values[f.name] = value
    moe = MoEConfig(**values)
    if moe.enabled and not 1 <= moe.moe_router_topk <= moe.num_experts:
        raise ConfigError(f"--moe-router-topk {moe.moe_router_topk} must be in 1..--num-experts "
                          f"{moe.num_experts}")
    return moe


def _expert_parallel_flag() -> tuple:
    """(field, flag) of ``--expert-model-parallel-size`` (``config/parallel.py``)."""
    return next((f, spec) for f, spec in flag_fields(ParallelConfig)
                if f.name == "expert_model_parallel_size")


def _add_machine_arguments(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The machine flags (GPU count, hardware profile, memory)."""
    g = p.add_argument_group("machine")
    g.add_argument("--num-gpus", type=int, required=True)
    g.add_argument("--hardware", default="p100",
                   help=f"preset ({', '.join(PRESETS)}) or a JSON profile file (schema: "
                        f"megatron_chimera/tuning/hardware.py); p100-gloo is Piz Daint as "
                        f"the Chimera paper ran it (gloo's host-staged collectives over TCP)")
    g.add_argument("--gpu-memory-gb", type=float, default=None,
                   help="device memory in GB (default: the hardware profile's)")
    g.add_argument("--memory-headroom", type=float, default=0.9,
                   help="usable fraction of the memory (allocator, CUDA context, buffers)")
    g.add_argument("--document-lengths", default=None, metavar="PATH",
                   help="token lengths of one global batch's documents (a JSON list): every "
                        "micro-batch is priced by its own documents (attention by their squared "
                        "lengths; megatron_chimera/tuning/length_mix.py); analytic compute only")
    return g


def performance_model(args: argparse.Namespace, spec: ModelSpec, hardware: HardwareProfile,
                      **kwargs) -> PerformanceModel:
    """The performance model: for a real length mix with ``--document-lengths``."""
    if args.document_lengths is None:
        return PerformanceModel(spec, hardware, **kwargs)
    if kwargs.get("compute") is not None:
        raise ConfigError("--document-lengths prices micro-batches analytically: not with "
                          "--profile")
    try:
        lengths = json.loads(Path(args.document_lengths).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--document-lengths {args.document_lengths}: {exc}") from None
    if (not isinstance(lengths, list) or not lengths
            or not all(isinstance(n, int) and n > 0 for n in lengths)):
        raise ConfigError(f"--document-lengths {args.document_lengths}: expected a JSON list "
                          f"of positive token counts")
    return MixPerformanceModel(spec, hardware, lengths, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    """The CLI: model flags as pretrain_gpt2.py / pretrain_bert.py plus the search space."""
    p = ToolArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--predict", action="store_true",
                   help="predict one layout given by training flags instead of searching "
                        "(see --predict --help)")
    _add_model_arguments(p)
    g = _add_machine_arguments(p)
    g.add_argument("--profile", action="store_true",
                   help="time the stages with the real model classes on this machine")
    g.add_argument("--profile-device", default=None, help="device for --profile (default: "
                   "cuda if available, else cpu)")
    g.add_argument("--measure-p2p", action="store_true",
                   help="measure point-to-point alpha/beta by a local gloo ping-pong")
    g = p.add_argument_group("search")
    g.add_argument("--global-batch-size", type=int, required=True)
    g.add_argument("--micro-batch-sizes", type=_int_list, default=None,
                   help="comma-separated B to try (default: powers of two dividing B̂/W)")
    g.add_argument("--schedules", type=_name_list, default=DEFAULT_SCHEDULES,
                   help=f"comma-separated schedules (default: {','.join(DEFAULT_SCHEDULES)})")
    g.add_argument("--chimera-pipes", type=_int_list, default=(2, 4))
    g.add_argument("--tensor-model-parallel-sizes", type=_int_list, default=None,
                   help="comma-separated tensor-parallel sizes T to try, e.g. 1,2,4,8 "
                   "(default: every T dividing the attention heads within one node); T > 1 "
                   "runs sequence parallel")
    g.add_argument("--pipeline-model-parallel-sizes", type=_int_list, default=None,
                   help="comma-separated pipeline sizes D to try (default: every D dividing "
                        "--num-gpus / T, odd sizes and 1 included, at most one stage per layer)")
    g.add_argument("--expert-model-parallel-sizes", type=_int_list, default=None,
                   help="EP to try with --num-experts (default: every EP dividing the experts "
                        "and T x CP x W)")
    g.add_argument("--try-overlap-moe-expert-parallel-comm", action="store_true",
                   help="with EP > 1 also try every schedule with "
                        "--overlap-moe-expert-parallel-comm")
    g.add_argument("--context-parallel-sizes", type=_int_list, default=(1,),
                   help="comma-separated context-parallel sizes CP to try (ring attention over "
                        "CP ranks per sequence; default 1)")
    g.add_argument("--pipeline-sequence-slices", type=_int_list, default=(1,),
                   help="comma-separated sequence slices k to try with 1f1b, zb-h1, chimera "
                        "and chimera-zb (default 1: unsliced)")
    g.add_argument("--no-sequence-parallel", action="store_false", dest="sequence_parallel",
                   help="with T > 1, do not split the residual stream over the sequence")
    g.add_argument("--recompute", choices=("both", "on", "off"), default="both")
    g.add_argument("--recompute-granularities", choices=("both", "full", "selective"),
                   default="both",
                   help="what a recomputing layout recomputes: the whole layer (full), the "
                        "attention core (selective, Megatron's), or try both")
    g.add_argument("--distributed-optimizer", choices=("both", "on", "off"), default="both",
                   help="try --use-distributed-optimizer (optimizer state sharded over each "
                        "stage-replica group), plain data parallelism, or both")
    g.add_argument("--partition-methods", type=_name_list, default=("uniform", "parameters"),
                   help="comma-separated --partition-method values to try")
    g.add_argument("--pipeline-model-parallel-layout", action="append", default=[],
                   help="also try this layout string (Megatron's E, t, L, |, *k; repeatable); "
                        "the sizes whose stage count differs from it are skipped")
    g.add_argument("--try-fp8", action="store_true",
                   help="also search every --fp8-recipe the hardware runs (format hybrid, or "
                        "--fp8-format's) and compare the best layout of each precision")
    g.add_argument("--top", type=int, default=10, help="rows of the table")
    g.add_argument("--exhaustive", action="store_true",
                   help="simulate every layout (default: branch and bound, exact for the top rows "
                   "but the --json list holds only the layouts it had to simulate)")
    g.add_argument("--show-over-memory", type=int, default=3,
                   help="also list this many of the smallest layouts that do not fit")
    g.add_argument("--json", default=None, help="write the ranked list to this path")
    g.add_argument("--stage-costs-json", default=None,
                   help="write the best layout's per-stage F, B, W and p2p seconds to this path "
                        "(for --chimera-zb-costs @PATH)")
    return p


SIZES = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")


def _precision(args: argparse.Namespace) -> str:
    return "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32"


def preset_spec(args: argparse.Namespace) -> ModelSpec:
    """ModelSpec of ``--preset`` (``--seq-length`` and the precision flags may be given)."""
    given = [f for f in SIZES[:3] if getattr(args, f) is not None]
    if given:
        raise ConfigError(f"--{given[0].replace('_', '-')} applies only without --preset (the "
                          f"preset {args.preset} fixes the sizes)")
    family, config = MODEL_PRESETS[args.preset]
    config = dataclasses.replace(config, params_dtype=_precision(args),
                                 seq_length=args.seq_length or config.seq_length)
    if config.moe.enabled:  # the preset's experts; the dispatcher and GEMM flags may be given
        runtime = {}
        for f, flag_spec in flag_fields(MoEConfig):
            value = getattr(args, f.name)
            if value != f.default and flag_spec.model:
                raise ConfigError(f"{flag_spec.name} applies only without --preset (the preset "
                                  f"{args.preset} fixes its experts)")
            if value != f.default:
                runtime[f.name] = value
        return ModelSpec(dataclasses.replace(
            config, moe=dataclasses.replace(config.moe, **runtime)), family)
    return _with_moe(ModelSpec(config, family), args)


def model_spec(args: argparse.Namespace) -> ModelSpec:
    """ModelSpec from ``--preset`` or the model flags, with ``--fp8-format`` / ``--fp8-recipe``."""
    return dataclasses.replace(_model_spec(args),
                               fp8=fp8_from_flags(args.fp8_format, args.fp8_recipe))


def _model_spec(args: argparse.Namespace) -> ModelSpec:
    for flag in ("num_gpus", "global_batch_size", "make_vocab_size_divisible_by"):
        if getattr(args, flag) <= 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be positive")
    if args.preset is not None:
        return preset_spec(args)
    for flag in SIZES:
        if getattr(args, flag) is None:
            raise ConfigError(f"--{flag.replace('_', '-')} is required (or give --preset)")
        if getattr(args, flag) <= 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be positive")
    if args.max_position_embeddings is not None and args.max_position_embeddings < args.seq_length:
        raise ConfigError("--seq-length exceeds --max-position-embeddings")
    if args.model == "bert" and args.untie_embeddings_and_output_weights:
        raise ConfigError("--untie-embeddings-and-output-weights is not supported for BERT")
    config = ModelConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
        seq_length=args.seq_length, max_position_embeddings=args.max_position_embeddings,
        vocab_size=args.vocab_size or DEFAULT_VOCAB[args.model],
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        bert_binary_head=args.bert_binary_head,
        masked_softmax_fusion=args.masked_softmax_fusion, params_dtype=_precision(args),
        normalization=args.normalization, swiglu=args.swiglu, kv_channels=args.kv_channels,
        add_bias_linear=args.add_bias_linear, add_qkv_bias=args.add_qkv_bias,
        position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent, use_rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor, **architecture_fields(args),
    )
    check_architecture(config)
    return _with_moe(ModelSpec(config, args.model), args)


def _with_moe(spec: ModelSpec, args: argparse.Namespace) -> ModelSpec:
    """``spec`` with the MoE flags' experts (GPT only)."""
    moe = moe_config(args)
    if moe.enabled and spec.family.name != "gpt2":
        raise ConfigError("--num-experts applies to GPT models only (--model gpt2)")
    return ModelSpec(dataclasses.replace(spec.config, moe=moe), spec.family)


def write_json(path: str, records: list[dict] | dict) -> None:
    """Write ``records`` (a list, or one object) atomically (temp file + rename)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(str(target), lambda f: json.dump(records, f, indent=1), mode="w")


def _memory_limit(args: argparse.Namespace, hardware: HardwareProfile) -> tuple[float, int]:
    """(device GB, usable bytes) from --gpu-memory-gb / the profile and --memory-headroom."""
    if not 0 < args.memory_headroom <= 1:
        raise ConfigError("--memory-headroom must be in (0, 1]")
    memory_gb = args.gpu_memory_gb if args.gpu_memory_gb is not None else hardware.memory_gb
    if memory_gb <= 0:
        raise ConfigError("--gpu-memory-gb must be positive")
    return memory_gb, int(memory_gb * GB * args.memory_headroom)


def main(argv: list[str] | None = None) -> int:
    """Run the search and print the table and the command of the best layout (or, with
    ``--predict``, the prediction of one layout)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--predict" in argv:
        return predict_main([a for a in argv if a != "--predict"])
    args = build_parser().parse_args(argv)
    try:
        spec = model_spec(args)
        hardware = load_hardware(args.hardware)
        memory_gb, limit = _memory_limit(args, hardware)
        if args.top < 1:
            raise ConfigError("--top must be positive")
        compute, p2p_link = None, None
        if args.profile:
            from megatron_chimera.tuning.profile import MeasuredCompute

            compute = MeasuredCompute(spec, device=args.profile_device)
        if args.measure_p2p:
            from megatron_chimera.tuning.profile import measure_p2p_link

            p2p_link = measure_p2p_link()
            print(f"measured p2p: alpha {p2p_link.alpha_s * 1e6:.1f} us, "
                  f"{p2p_link.bandwidth_gbps:.2f} GB/s")
        model = performance_model(args, spec, hardware, compute=compute, p2p_link=p2p_link)
        choices = {"both": (False, True), "on": (True,), "off": (False,)}
        granularities = {"both": ("full", "selective"), "full": ("full",),
                         "selective": ("selective",)}
        recompute = choices[args.recompute]
        cfg = spec.config
        space = SearchSpace(args.num_gpus, args.global_batch_size, cfg.num_layers,
                            schedules=args.schedules, micro_batch_sizes=args.micro_batch_sizes,
                            recompute=recompute,
                            option_values=(("pipes", args.chimera_pipes),),
                            partition_methods=(*args.partition_methods,
                                               *args.pipeline_model_parallel_layout),
                            tensor_parallel_sizes=args.tensor_model_parallel_sizes,
                            pipeline_parallel_sizes=args.pipeline_model_parallel_sizes,
                            sequence_parallel=args.sequence_parallel,
                            distributed_optimizer=choices[args.distributed_optimizer],
                            recompute_granularities=granularities[args.recompute_granularities],
                            num_attention_heads=cfg.num_attention_heads,
                            gpus_per_node=hardware.gpus_per_node,
                            context_parallel_sizes=args.context_parallel_sizes,
                            sequence_slices=args.pipeline_sequence_slices,
                            num_experts=cfg.moe.num_experts or 0,
                            expert_parallel_sizes=args.expert_model_parallel_sizes,
                            overlap_all_to_all=args.try_overlap_moe_expert_parallel_comm)
        result = autotune(model, space, limit, keep=None if args.exhaustive else args.top)
        over = sorted(result.over_memory, key=lambda lp: lp[1])[: args.show_over_memory]
        print(f"{describe_model(spec.family.name, cfg)}: {cfg.num_layers} layers, "
              f"hidden {cfg.hidden_size}, "
              f"{cfg.num_attention_heads} heads, seq {cfg.seq_length}, "
              f"{spec.config.params_dtype}{' + ' + spec.fp8.describe() if spec.fp8 else ''}; "
              f"{args.num_gpus} x {hardware.name} "
              f"({memory_gb:g} GB, limit {limit / 2**30:.2f} GiB); global batch "
              f"{args.global_batch_size}")
        print(f"searched in {result.seconds:.1f} s: {len(result.ranked)} fit, "
              f"{len(result.over_memory)} over memory, {len(result.invalid)} invalid sizes, "
              f"{result.dominated} recomputing layouts dominated, {result.pruned} pruned by "
              f"the work bound\n")
        print(format_table(result.ranked[: args.top], limit, over))
        best = result.best
        print(f"\nbest: {best.layout.describe()}: {best.iteration_s:.4f} s/iteration, "
              f"{best.samples_per_s:.1f} samples/s")
        print(describe_error(spec, best.layout) + "\n")
        print(torchrun_command(spec, best.layout, hardware.gpus_per_node))
        if spec.fp8 is not None:
            print(f"\nnote: {spec.fp8.describe()} is priced only: training refuses --fp8-* "
                  "until an FP8 path exists (docs/FLAGS.md, Refused)")
        if hardware.host_staged:
            print(f"\nnote: {hardware.name} prices {hardware.describe_backend()}, the system "
                  "the Chimera paper measured; this framework trains CUDA devices with NCCL "
                  "(device-direct), which a profile with collective_backend nccl models")
        if args.try_fp8:
            print(compare_precisions(spec, hardware, space, limit, args, best))
        if args.json:
            write_json(args.json, to_records(result.ranked))
        if args.stage_costs_json:
            costs = model.stage_costs(best.layout)
            write_json(args.stage_costs_json, costs.to_dict() | {"layout": best.layout.describe()})
            print(f"wrote the per-stage costs of {best.layout.describe()} to "
                  f"{args.stage_costs_json} (--chimera-zb-costs @{args.stage_costs_json})")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def compare_precisions(spec: ModelSpec, hardware: HardwareProfile, space: SearchSpace,
                       limit: int, args: argparse.Namespace, best: Prediction) -> str:
    """``--try-fp8``: the best layout of every FP8 recipe the profile runs, against ``best``."""
    if spec.config.params_dtype == "fp32" or hardware.peak_tflops_fp8 <= 0:
        raise ConfigError(f"--try-fp8 needs --bf16 or --fp16 and a profile with FP8 tensor "
                          f"cores ({hardware.name} has peak_tflops_fp8 "
                          f"{hardware.peak_tflops_fp8:g})")
    label = spec.fp8.describe() if spec.fp8 else spec.config.params_dtype
    lines = ["\nprecision (best layout of each; FP8 recipes priced by tuning/precision.py):",
             f"  {label:<24}{best.layout.describe()}: {best.samples_per_s:.2f} samples/s"]
    for recipe in FP8_RECIPES:
        fp8 = Fp8Config(spec.fp8.format if spec.fp8 else "hybrid", recipe)
        if fp8 == spec.fp8 or (recipe == "mxfp8" and not hardware.mxfp8_tensor_cores):
            continue
        model = PerformanceModel(dataclasses.replace(spec, fp8=fp8), hardware)
        found = autotune(model, space, limit, keep=None if args.exhaustive else args.top).best
        lines.append(f"  {fp8.describe():<24}{found.layout.describe()}: "
                     f"{found.samples_per_s:.2f} samples/s "
                     f"({found.samples_per_s / best.samples_per_s:.3f}x)")
    return "\n".join(lines)


def build_predict_parser() -> argparse.ArgumentParser:
    """``--predict``: the model flags, the machine and one layout as training flags."""
    p = ToolArgumentParser(prog="autotune.py --predict", allow_abbrev=False,
                           description="Predict one layout: iteration time, TFLOP/s per GPU "
                                       "(Megatron's formula), bubble and peak memory per rank.")
    _add_model_arguments(p)
    _add_machine_arguments(p)
    g = p.add_argument_group("layout (as pretrain_gpt2.py / pretrain_bert.py)")
    g.add_argument("--global-batch-size", type=int, required=True)
    g.add_argument("--micro-batch-size", type=int, default=1)
    field_, flag_ = _expert_parallel_flag()
    flag_.add_to(g, field_.name, field_.default)
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--partition-method", default="uniform",
                   help="uniform, parameters or a --pipeline-model-parallel-layout string")
    add_schedule_arguments(g)
    g.add_argument("--runtime", choices=("ours", *sorted(RUNTIMES)), default="ours",
                   help="the runtime that runs it: ours (default), megatron (Megatron-LM's "
                        "blocking pipeline exchanges; 1f1b, interleaved: to compare with a "
                        "Megatron-LM run) or zb (the zero-bubble authors' runtime, "
                        "post-validated step; zb-h1, zb-2p, zbv)")
    g.add_argument("--json", default=None, help="write the prediction to this path")
    return p


def predict_layout(args: argparse.Namespace, spec: ModelSpec) -> TrainingPlan:
    """The layout the --predict flags describe (ConfigError naming the flag that does not fit)."""
    T, D, B = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
               args.micro_batch_size)
    for flag, value in (("--tensor-model-parallel-size", T),
                        ("--pipeline-model-parallel-size", D), ("--micro-batch-size", B)):
        if value < 1:
            raise ConfigError(f"{flag} must be positive, got {value}")
    if args.num_gpus % (T * D):
        raise ConfigError(f"--num-gpus {args.num_gpus} is not a multiple of "
                          f"--tensor-model-parallel-size x --pipeline-model-parallel-size "
                          f"= {T * D}")
    W = args.num_gpus // (T * D)
    if args.global_batch_size % (W * B):
        raise ConfigError(f"--global-batch-size {args.global_batch_size} is not a multiple of "
                          f"--micro-batch-size x data-parallel size = {B} x {W}")
    if args.sequence_parallel and T == 1:
        raise ConfigError("--sequence-parallel needs --tensor-model-parallel-size > 1")
    try:
        schedule, options = spec_and_options_from(args)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return TrainingPlan(schedule.name, D, W, B, args.global_batch_size // (W * B),
                        args.recompute_granularity is not None, options,
                        args.partition_method, T, args.sequence_parallel,
                        args.use_distributed_optimizer, args.recompute_granularity or "full",
                        EP=args.expert_model_parallel_size, runtime=args.runtime)


def predict_main(argv: list[str]) -> int:
    """Print (and with --json write) the prediction of the layout the flags give."""
    args = build_predict_parser().parse_args(argv)
    try:
        spec = model_spec(args)
        hardware = load_hardware(args.hardware)
        memory_gb, limit = _memory_limit(args, hardware)
        layout = predict_layout(args, spec)
        model = performance_model(args, spec, hardware)
        try:
            prediction = model.predict(layout)
        except ValueError as exc:
            raise ConfigError(str(exc).splitlines()[0]) from None
        tflops = (megatron_flops(spec.config, layout.global_batch_size) / layout.num_gpus
                  / prediction.iteration_s / 1e12)
        exposed = max(prediction.sim.exposed_all_to_all or [0.0])
        record = {"layout": layout.describe(), "schedule": layout.label, "T": layout.T,
                  "EP": layout.EP, "all_to_all_s": list(model.all_to_all_costs(layout)),
                  "exposed_all_to_all_s": exposed,
                  "D": layout.D, "W": layout.W, "B": layout.B, "N": layout.N,
                  "num_gpus": layout.num_gpus, "hardware": hardware.name,
                  "precision": spec.fp8.describe() if spec.fp8 else spec.config.params_dtype,
                  "collective_backend": hardware.collective_backend,
                  "iteration_s": prediction.iteration_s,
                  "samples_per_s": prediction.samples_per_s,
                  "tflops_per_gpu": tflops, "bubble_ratio": prediction.bubble_ratio,
                  "peak_memory_bytes": prediction.peak_memory_bytes,
                  "memory_limit_bytes": limit,
                  "fits": prediction.peak_memory_bytes <= limit}
        print(f"{describe_model(spec.family.name, spec.config)}: "
              f"{spec.config.num_layers} layers, hidden "
              f"{spec.config.hidden_size}, {spec.config.num_attention_heads} heads, seq "
              f"{spec.config.seq_length}, {spec.config.params_dtype}"
              f"{' + ' + spec.fp8.describe() if spec.fp8 else ''}; {layout.num_gpus} x "
              f"{hardware.name} ({memory_gb:g} GB)")
        print(f"layout: {layout.describe()}")
        print(f"collectives: {hardware.describe_backend()}")
        print(f"iteration: {prediction.iteration_s:.4f} s ({prediction.samples_per_s:.2f} "
              f"samples/s)")
        dense_only = (", dense: one MLP per layer, not the top-k experts"
                      if spec.config.moe.enabled else "")
        print(f"TFLOP/s per GPU: {tflops:.1f} (Megatron's 96 B s l h^2 (1 + s/6h + V/16lh)"
              f"{dense_only})")
        print(f"bubble: {prediction.bubble_ratio:.3f}")
        if layout.EP > 1:
            per_stage = model.all_to_all_costs(layout)
            print(f"all-to-all per micro-batch and direction: {max(per_stage) * 1e3:.2f} ms "
                  f"(slowest stage); exposed per iteration: {exposed:.4f} s (most exposed "
                  f"rank)")
        headroom_only = (not record["fits"]
                         and prediction.peak_memory_bytes <= memory_gb * GB)
        print(f"peak memory per rank: {prediction.peak_memory_bytes / 2**30:.2f} GiB "
              f"({'fits' if record['fits'] else 'does not fit'} the "
              f"{limit / 2**30:.2f} GiB limit"
              + (f": within the whole {memory_gb:g} GB, above --memory-headroom "
                 f"{args.memory_headroom:g}" if headroom_only else "") + ")")
        record["validated_error"] = describe_error(spec, layout)
        record["family"] = nearest_family(spec, layout)
        print(record["validated_error"])
        if args.json:
            write_json(args.json, record)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    run_tool(main)
