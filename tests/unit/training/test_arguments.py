"""arguments.parse_args: Megatron flags -> frozen configs, derived sizes, one-line errors."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_chimera.config import ConfigError
from megatron_chimera.training.arguments import parse_args

BASE = (
    "--num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--micro-batch-size 2 --global-batch-size 16 --lr 1e-3 --train-iters 20 "
    "--mock-data --vocab-size 500"
).split()


def parse(extra: str = "", world_size: int = 1, base=BASE):
    return parse_args(list(base) + extra.split(), world_size=world_size)


def test_chimera_takes_fewer_microbatches_than_stages():
    """Two sequences per iteration at D = 4 (one per pipe) is Chimera's partial basic unit."""
    from megatron_chimera.schedules.chimera import chimera
    from megatron_chimera.training.config_checks import build_schedule_for

    config = parse("--pipeline-model-parallel-size 4 --pipeline-schedule chimera "
                   "--global-batch-size 4", world_size=4)
    assert config.training.num_microbatches == 2
    assert build_schedule_for(config).actions == chimera(4, 2).actions


def test_derives_data_parallel_and_microbatches():
    config = parse("--pipeline-model-parallel-size 4 --chimera-pipes 2", world_size=8)
    assert config.parallel.data_parallel_size == 2
    assert config.parallel.pipeline_schedule == "chimera"
    assert config.training.num_microbatches == 16 // (2 * 2)
    assert config.optimizer.lr_decay_samples == 20 * 16


def test_default_schedule_is_1f1b_and_frozen():
    config = parse("--pipeline-model-parallel-size 2", world_size=2)
    assert config.parallel.pipeline_schedule == "1f1b"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.training.seed = 3  # type: ignore[misc]


def test_megatron_flag_meanings():
    config = parse(
        "--fp16 --loss-scale-window 10 --hysteresis 3 --no-apex --lr-warmup-fraction 0.1 "
        "--untie-embeddings-and-output-weights --ffn-hidden-size 100 --clip-grad 0.5 "
        "--save /tmp/x --save-interval 5 --log-interval 2 --no-load-rng"
    )
    assert config.model.params_dtype == "fp16" and config.optimizer.fp16
    assert config.model.use_apex is False and config.optimizer.use_apex is False
    assert config.optimizer.lr_warmup_samples == int(0.1 * 20 * 16)
    assert config.model.untie_embeddings_and_output_weights
    assert config.model.ffn_size == 100
    assert config.checkpoint.save_interval == 5 and config.checkpoint.no_load_rng
    assert config.optimizer.hysteresis == 3 and config.logging.log_interval == 2


def test_exit_flags():
    config = parse("--exit-signal-handler --exit-duration-in-mins 0.25 --exit-interval 7")
    assert config.training.exit_signal_handler
    assert config.training.exit_duration_in_mins == 0.25 and config.training.exit_interval == 7
    assert not parse().training.exit_signal_handler
    assert parse().training.exit_duration_in_mins is None


def test_lr_warmup_iters_become_samples():
    config = parse("--lr-warmup-iters 4 --lr-decay-iters 10")
    assert config.optimizer.lr_warmup_samples == 4 * 16
    assert config.optimizer.lr_decay_samples == 10 * 16


def test_extra_args_provider():
    def provider(parser):
        parser.add_argument("--my-flag", type=int, default=7)
        return parser

    config = parse_args(BASE + ["--my-flag", "3"], world_size=1, extra_args_provider=provider)
    assert config.extra_arg("my_flag") == 3


# (extra flags, world size, the flag the one-line message must name)
BAD_SETTINGS = [
    ("--pipeline-model-parallel-size 3 --pipeline-schedule chimera", 3,
     "--pipeline-model-parallel-size"),
    ("--pipeline-model-parallel-size 4 --chimera-pipes 3", 4, "--chimera-pipes"),
    ("--pipeline-model-parallel-size 4 --chimera-pipes 8", 4, "--chimera-pipes"),
    ("--global-batch-size 15", 1, "--global-batch-size"),
    ("--pipeline-model-parallel-size 4 --chimera-pipes 2 --global-batch-size 12", 4,
     "--num-microbatches"),
    ("--pipeline-model-parallel-size 4", 6, "--pipeline-model-parallel-size"),
    ("--tensor-model-parallel-size 2", 1, "--tensor-model-parallel-size"),
    ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2", 6,
     "--tensor-model-parallel-size"),
    ("--tensor-model-parallel-size 3", 3, "--num-attention-heads"),
    ("--tensor-model-parallel-size 2 --ffn-hidden-size 33", 2, "--ffn-hidden-size"),
    ("--sequence-parallel", 1, "--sequence-parallel"),
    ("--tensor-model-parallel-size 2 --sequence-parallel --seq-length 15", 2, "--seq-length"),
    ("--fp16 --bf16", 1, "--fp16"),
    ("--seq-length 64 --max-position-embeddings 32", 1, "--max-position-embeddings"),
    ("--hidden-size 66", 1, "--num-attention-heads"),
    ("--lr-warmup-fraction 0.1 --lr-warmup-iters 2", 1, "--lr-warmup-fraction"),
    ("--train-samples 100", 1, "--train-samples"),
    ("--load /nonexistent/ckpt", 1, "--load"),
    ("--finetune", 1, "--finetune"),
    ("--min-lr 1.0", 1, "--min-lr"),
    ("--chimera-concat direct --pipeline-schedule 1f1b", 1, "--chimera-concat"),
    ("--pipeline-model-parallel-size 4 --pipeline-schedule interleaved", 4,
     "--num-layers-per-virtual-pipeline-stage"),
    ("--recompute-method uniform", 1, "--recompute-method"),
    ("--hidden-dropout 1.5", 1, "--hidden-dropout"),
    ("--tokenizer-type GPT2BPETokenizer --vocab-file /nonexistent.json "
     "--merge-file /nonexistent.txt", 1, "--vocab-file"),
    ("--micro-batch-size 0", 1, "--micro-batch-size"),
    ("--pipeline-model-parallel-size 8 --pipeline-schedule gpipe --num-layers 4 "
     "--global-batch-size 16", 8, "--num-layers"),
    ("--save-interval 5", 1, "--save-interval"),
    ("--exit-duration-in-mins 0", 1, "--exit-duration-in-mins"),
    ("--exit-duration-in-mins -0.5", 1, "--exit-duration-in-mins"),
    ("--no-such-flag 1", 1, "--no-such-flag"),
]


@pytest.mark.parametrize("extra,world_size,flag", BAD_SETTINGS)
def test_bad_settings_name_the_flag(extra, world_size, flag):
    with pytest.raises(ConfigError) as info:
        parse(extra, world_size=world_size)
    message = str(info.value)
    assert flag in message and "\n" not in message


def test_missing_data_path_without_mock_data():
    base = [a for a in BASE if a != "--mock-data"]
    with pytest.raises(ConfigError, match="--data-path"):
        parse_args(base, world_size=1)


def test_data_path_prefix_must_exist(tmp_path):
    base = [a for a in BASE if a != "--mock-data"]
    argv = base + ["--data-path", str(tmp_path / "corpus"), "--tokenizer-type", "NullTokenizer"]
    with pytest.raises(ConfigError, match="--data-path: .*corpus.bin"):
        parse_args(argv, world_size=1)
    (tmp_path / "corpus.bin").write_bytes(b"")
    (tmp_path / "corpus.idx").write_bytes(b"")
    assert parse_args(argv, world_size=1).data.data_path == (str(tmp_path / "corpus"),)


def test_chimera_max_inflight_reaches_the_split_backward_schedule():
    from megatron_chimera.schedules.simulate import simulate
    from megatron_chimera.training.config_checks import build_schedule_for

    config = parse("--pipeline-model-parallel-size 4 --chimera-pipes 2 --chimera-split-backward "
                   "--chimera-max-inflight 3", world_size=4)
    assert config.parallel.schedule_options.max_inflight == 3
    schedule = build_schedule_for(config)
    assert schedule.name == "chimera-zb" and schedule.split_backward
    assert max(simulate(schedule).peak_inflight) <= 3


@pytest.mark.parametrize("extra", [
    "--pipeline-model-parallel-size 4 --chimera-pipes 2 --chimera-max-inflight 3",
    "--pipeline-model-parallel-size 4 --pipeline-schedule 1f1b --chimera-max-inflight 3",
    "--pipeline-model-parallel-size 4 --pipeline-schedule chimera-zb --chimera-max-inflight 0",
])
def test_chimera_max_inflight_needs_the_split_backward_schedule(extra):
    with pytest.raises(ConfigError, match="--chimera-max-inflight"):
        parse(extra, world_size=4)


def test_gloo_on_a_cuda_machine_needs_allow_cpu_training(monkeypatch):
    """--distributed-backend gloo with CUDA devices visible would silently train on the CPU."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError, match="--allow-cpu-training"):
        parse("--distributed-backend gloo")
    config = parse("--distributed-backend gloo --allow-cpu-training")
    assert config.parallel.allow_cpu_training


@pytest.mark.parametrize("extra,expected", [
    ("--chimera-split-backward", 3),  # split backward, costs not given: profile 3 iterations
    ("--pipeline-schedule zb-h1", 3),
    ("--chimera-split-backward --profile-iterations 5", 5),
    ("--chimera-split-backward --chimera-zb-costs 1,2,1", 0),  # costs fixed by hand
    ("--chimera-split-backward --chimera-zb-costs 1,2,1 --profile-iterations 2", 2),
    ("--chimera-split-backward --profile-iterations 0", 0),
    ("--chimera-pipes 2", 0),  # unsplit: nothing to rebuild
    ("--chimera-split-backward --train-iters 2", 1),  # leaves an iteration for the rebuilt order
    ("--chimera-split-backward --train-iters 1", 0),
])
def test_profile_iterations_resolved(extra, expected):
    config = parse(f"--pipeline-model-parallel-size 4 {extra}", world_size=4)
    assert config.training.profile_iterations == expected


@pytest.mark.parametrize("extra,message", [
    ("--chimera-split-backward --profile-iterations -1", "--profile-iterations must be >= 0"),
    ("--chimera-pipes 2 --profile-iterations 2",
     "--profile-iterations applies to split-backward schedules .* not --pipeline-schedule "
     "chimera"),
    ("--chimera-split-backward --profile-iterations 20", "--profile-iterations 20 must be "
                                                          "smaller than the 20 training"),
    ("--chimera-split-backward --chimera-zb-costs 1,2", "--chimera-zb-costs must be three"),
    ("--chimera-split-backward --chimera-zb-costs 1,2,1;1,2,1", "--chimera-zb-costs: the costs "
                                                                 "have 2 stages"),
    ("--chimera-split-backward --chimera-zb-fallback never", "--chimera-zb-fallback"),
    ("--chimera-pipes 2 --chimera-zb-fallback refuse", "--chimera-zb-fallback does not apply"),
    ("--partition-method fastest", "--partition-method"),
])
def test_profile_and_cost_flags_rejected_with_the_flag(extra, message):
    with pytest.raises(ConfigError, match=message):
        parse(f"--pipeline-model-parallel-size 4 {extra}", world_size=4)


def test_stage_costs_file_and_time_partition_accepted(tmp_path):
    path = tmp_path / "costs.json"
    path.write_text('{"F": [1.2, 1, 1, 1.4], "B": [1, 1, 1, 1.5], "W": [1, 1, 1, 1]}')
    config = parse(f"--pipeline-model-parallel-size 4 --chimera-split-backward "
                   f"--chimera-zb-costs @{path} --partition-method time", world_size=4)
    assert config.parallel.schedule_options.costs.forward == (1.2, 1.0, 1.0, 1.4)
    assert config.training.partition_method == "time"


def test_profile_iterations_help_names_the_default():
    from megatron_chimera.config import DEFAULT_PROFILE_ITERATIONS, TrainingConfig, flag_fields

    help_text = dict((f.name, spec.help) for f, spec in flag_fields(TrainingConfig))
    assert f"(default {DEFAULT_PROFILE_ITERATIONS}," in help_text["profile_iterations"]


def test_a_misspelt_flag_gets_the_nearest_flag_and_chimera_pipes_lists_its_values():
    with pytest.raises(ConfigError, match=r"--num-query-group: did you mean --num-query-groups\?"):
        parse("--num-query-group 2", world_size=1)
    with pytest.raises(ConfigError) as info:
        parse("--no-such-thing 3", world_size=1)
    assert "did you mean" not in str(info.value)  # nothing close: argparse's message alone
    with pytest.raises(ConfigError, match=r"--chimera-pipes 6 .*use one of 2, 4, 8 "):
        parse("--pipeline-model-parallel-size 8 --chimera-pipes 6", world_size=8)
