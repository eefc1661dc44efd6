"""initialize.py rejects bad settings with one clear error naming the flag (no processes)."""

from __future__ import annotations

import pytest

from megatron_chimera.config import ConfigError, ParallelConfig
from megatron_chimera.training.initialize import initialize_distributed

pytestmark = pytest.mark.timeout(30)


def test_unknown_backend_is_rejected():
    with pytest.raises(ConfigError, match="--distributed-backend"):
        initialize_distributed(ParallelConfig(distributed_backend="mpi"))


def test_non_positive_timeout_is_rejected():
    with pytest.raises(ConfigError, match="--distributed-timeout-minutes"):
        initialize_distributed(ParallelConfig(distributed_backend="gloo",
                                              distributed_timeout_minutes=0))


def test_world_size_must_match_the_layout(monkeypatch):
    for key, value in {"RANK": "0", "WORLD_SIZE": "6", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(key, value)
    config = ParallelConfig(pipeline_model_parallel_size=4, data_parallel_size=2,
                            distributed_backend="gloo")
    with pytest.raises(ConfigError, match=r"--pipeline-model-parallel-size 4 x data-parallel 2 "
                                          r"!= world size 6"):
        initialize_distributed(config)


def test_missing_torchrun_environment_is_rejected(monkeypatch):
    """Several ranks need torchrun's environment (one process needs none: next test)."""
    for key in ("RANK", "MASTER_ADDR"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ConfigError, match="torchrun"):
        initialize_distributed(ParallelConfig(data_parallel_size=2, distributed_backend="gloo"))


def test_one_process_starts_without_torchrun(monkeypatch):
    """A plain ``python pretrain_gpt2.py`` run gets an in-memory store: no port, no env."""
    import torch.distributed as dist

    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    try:
        device = initialize_distributed(ParallelConfig(distributed_backend="gloo"))
        assert dist.is_initialized() and dist.get_world_size() == 1
        assert device.type == "cpu"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
