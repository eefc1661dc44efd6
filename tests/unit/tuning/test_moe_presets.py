"""The MoE presets: Mixtral-8x7B's parameter count is the published 46.7 B, the DeepSeek-V3-like
shape lands near DeepSeek-V3's 671 B (plain attention instead of MLA), and the autotuner's command
for the Mixtral preset carries the MoE flags and parses back to the preset's MoE configuration."""

from __future__ import annotations

import importlib.util
import shlex
from pathlib import Path

from megatron_chimera.model.partition import count_parameters
from megatron_chimera.model.presets import MODEL_PRESETS

ROOT = Path(__file__).resolve().parents[3]


def test_moe_presets_have_their_published_sizes():
    family, mixtral = MODEL_PRESETS["mixtral-8x7b"]
    assert abs(count_parameters(mixtral, family) / 1e9 - 46.7) < 0.05  # Mistral AI: 46.7 B
    family, deepseek = MODEL_PRESETS["deepseek-v3-like"]
    assert deepseek.moe.moe_layers(61) == (False,) * 3 + (True,) * 58
    assert 660e9 < count_parameters(deepseek, family) < 700e9  # DeepSeek-V3: 671 B with MLA


def test_autotune_command_for_mixtral_carries_the_moe_flags(capsys):
    from megatron_chimera.training.arguments import parse_args

    spec = importlib.util.spec_from_file_location("autotune_cli", ROOT / "tools" / "autotune.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    rc = cli.main(["--preset", "mixtral-8x7b", "--num-gpus", "64", "--global-batch-size", "256",
                   "--hardware", "h100", "--bf16", "--schedules", "chimera",
                   "--tensor-model-parallel-sizes", "2", "--micro-batch-sizes", "1", "--top", "1"])
    assert rc == 0
    out = capsys.readouterr().out
    command = out[out.index("torchrun"):].replace(" \\\n    ", " ").replace(" \\\n", " ")
    words = shlex.split(command.split("\n")[0])
    assert "--num-experts" in words
    argv = words[words.index("pretrain_gpt2.py") + 1:words.index("--data-path")]
    config = parse_args([*argv, "--mock-data", "--train-iters", "1", "--lr", "1e-4",
                         "--vocab-size", "32000"], world_size=64)
    want = MODEL_PRESETS["mixtral-8x7b"][1].moe
    got = config.model.moe
    assert (got.num_experts, got.moe_router_topk, got.moe_aux_loss_coeff) == (
        want.num_experts, want.moe_router_topk, want.moe_aux_loss_coeff)
