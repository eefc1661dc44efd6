"""Start torch.distributed from torchrun's environment, create the model-parallel groups, seed.

Backend: ``nccl`` on CUDA and ``gloo`` on CPU unless ``--distributed-backend`` says otherwise; every
collective has the finite ``--distributed-timeout-minutes`` timeout (default 10).
"""

from __future__ import annotations

import os
import random
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from megatron_chimera import parallel_state
from megatron_chimera.config import ConfigError, ParallelConfig
from megatron_chimera.schedules.actions import Schedule
from megatron_chimera.tensor_parallel import model_parallel_cuda_manual_seed

BACKENDS = ("gloo", "nccl")


def default_backend() -> str:
    """``nccl`` when CUDA is available, else ``gloo``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def check_backend(config: ParallelConfig) -> str:
    """The backend to use (``--distributed-backend`` or the device's); ConfigError when it cannot
    work here -- NCCL without CUDA, or gloo on a CUDA machine, which would silently train on the
    CPU unless ``--allow-cpu-training`` says that is meant."""
    backend = config.distributed_backend or default_backend()
    if backend not in BACKENDS:
        raise ConfigError(f"--distributed-backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("--distributed-backend nccl needs CUDA, which is not available; "
                          "use gloo on CPU")
    if backend == "gloo" and torch.cuda.is_available() and not config.allow_cpu_training:
        raise ConfigError("--distributed-backend gloo on a machine with CUDA devices would train "
                          "on the CPU; drop the flag to use NCCL on the GPUs, or pass "
                          "--allow-cpu-training if CPU training is meant")
    if config.distributed_timeout_minutes <= 0:
        raise ConfigError(
            f"--distributed-timeout-minutes must be > 0, got {config.distributed_timeout_minutes}"
        )
    return backend


# torch's NCCL flight recorder (read when its process group is created): the last collectives
# and point-to-point operations of every group with their state, dumped per rank to
# TORCH_NCCL_DEBUG_INFO_TEMP_FILE<rank> (default /tmp/nccl_trace_rank_<rank>) when NCCL's watchdog
# times out; the hang report reads it too (pipeline/hang.py). A setting in the environment wins.
NCCL_FLIGHT_RECORDER_ENV = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
                            "TORCH_FR_BUFFER_SIZE": "2000",
                            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}


def enable_nccl_flight_recorder() -> None:
    """Turn the NCCL flight recorder on (unless the environment says otherwise)."""
    for key, value in NCCL_FLIGHT_RECORDER_ENV.items():
        os.environ.setdefault(key, value)


def initialize_distributed(config: ParallelConfig) -> torch.device:
    """``init_process_group`` with the configured backend and timeout; returns this rank's device.

    Under torchrun (``RANK`` set) via ``env://``; a plain one-process run gets an in-memory store
    and needs no port. On CUDA the process group is bound to the rank's device
    (``device_id``), so NCCL communicators are created eagerly, when their groups are created in
    one order on every rank, instead of lazily at a first use that blocks until the peers arrive.
    """
    backend = check_backend(config)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if dist.is_initialized():
        return device
    if backend == "nccl":
        torch.cuda.set_device(device)
        enable_nccl_flight_recorder()
    options = {"backend": backend, "timeout": timedelta(minutes=config.distributed_timeout_minutes)}
    if backend == "nccl":
        options["device_id"] = device
    if "RANK" not in os.environ and config.world_size == 1:
        dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **options)
        return device
    required = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    missing = [k for k in required if k not in os.environ]
    if missing:
        raise ConfigError(f"environment lacks {missing}: launch with torchrun")
    config.layout.check_world(int(os.environ["WORLD_SIZE"]))  # the one world check
    store = attempt_store(options["timeout"])
    if store is not None:
        dist.init_process_group(store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), **options)
    else:
        dist.init_process_group(init_method="env://", **options)
    return device


def attempt_store(timeout: timedelta) -> dist.Store | None:
    """Under torchrun's agent store, a restarted attempt's store: the agent's, prefixed with the
    attempt (its keys outlive a failed attempt, so ranks of the next one would read the dead
    ranks' gloo addresses and failure claims); None otherwise (``env://`` as usual)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or attempt in ("", "0"):
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"/megatron_chimera/attempt_{attempt}", store)


def set_random_seed(seed: int) -> None:
    """Seed python, numpy and torch for this rank, and the tensor-parallel RNG tracker.

    Weights do not depend on this seed's per-rank offset (they are drawn from generators keyed by
    layer, see CONTRACTS.md); the offset by pipeline rank only decorrelates dropout (Megatron).
    The ranks of a tensor-parallel group share the default seed (equal dropout masks on the
    replicated residual stream); the tracker's stream differs by tensor rank
    (:func:`~megatron_chimera.tensor_parallel.model_parallel_cuda_manual_seed`).
    """
    if seed < 0:
        raise ConfigError(f"--seed must be >= 0, got {seed}")
    offset = 100 * parallel_state.get_pipeline_model_parallel_rank() \
        if parallel_state.model_parallel_is_initialized() else 0
    random.seed(seed + offset)
    np.random.seed((seed + offset) % 2**32)
    torch.manual_seed(seed + offset)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed + offset)
    model_parallel_cuda_manual_seed(seed + offset)


def initialize_megatron(config: ParallelConfig, schedule: Schedule, seed: int,
                        experts: bool = False) -> torch.device:
    """Distributed start-up, model-parallel groups for ``schedule``'s placement (every
    communicator connected before the first iteration), and seeding; returns this rank's
    device. ``experts``: the model has MoE layers (their groups, see ``parallel_state``)."""
    device = initialize_distributed(config)
    if schedule.num_ranks != config.pipeline_model_parallel_size:
        raise ConfigError(
            f"--pipeline-model-parallel-size {config.pipeline_model_parallel_size} != the "
            f"schedule's {schedule.num_ranks} ranks"
        )
    parallel_state.initialize_model_parallel(
        config.pipeline_model_parallel_size, schedule.placement, schedule.num_stages,
        config.tensor_model_parallel_size,
        timeout=timedelta(minutes=config.distributed_timeout_minutes),
        context_parallel_size=config.context_parallel_size,
        expert_model_parallel_size=config.expert_model_parallel_size, expert_groups=experts,
        hierarchical_context_parallel_sizes=config.hierarchical_context_parallel_sizes,
    )
    parallel_state.connect_communicators(device)
    set_random_seed(seed)
    return device
