"""The parallel layout, the schedule and the data-parallel gradient settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from megatron_chimera.config.flag import flag, non_negative, positive
from megatron_chimera.config.model import GPT
from megatron_chimera.layout import ParallelLayout


def _timeout(minutes: float) -> str | None:
    """``--distributed-timeout-minutes``: >= 0, and not 0."""
    return non_negative(minutes) or (None if minutes else "must be positive")


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel layout and schedule: world = tensor x context x data-parallel x pipeline size.

    ``schedule_options`` is the typed options dataclass of ``pipeline_schedule`` from the
    schedule registry (``megatron_chimera.schedules.registry``, whose options declare their own
    flags), built from the flags.
    """

    FLAG_GROUP: ClassVar[str] = "distributed"

    tensor_model_parallel_size: int = flag(
        1, "--tensor-model-parallel-size", check=positive,
        help="tensor-parallel size T: attention heads, MLP and vocabulary split over T ranks "
             "(world = T x W x D)")
    pipeline_model_parallel_size: int = flag(
        1, "--pipeline-model-parallel-size", check=positive,
        help="pipeline stages D (data-parallel size W = world / (T x CP x D))")
    context_parallel_size: int = flag(
        1, "--context-parallel-size", check=positive, family=GPT,
        help="context-parallel size CP: each sequence split over CP ranks (s / CP tokens each, "
             "zigzag chunks i and 2CP-1-i for causal balance); attention by --cp-comm-type, "
             "gradients reduced over data x context ranks (world = T x CP x W x D)")
    hierarchical_context_parallel_sizes: tuple[int, ...] | None = flag(
        None, "--hierarchical-context-parallel-sizes", type=int, nargs="+", metavar="SIZE",
        family=GPT,
        help="for --cp-comm-type a2a+p2p: A B with A x B = --context-parallel-size; A adjacent "
             "context ranks run the all-to-all, a ring joins the B groups")
    pipeline_sequence_slices: int = flag(
        1, "--pipeline-sequence-slices", check=positive, family=GPT,
        help="sequence-sliced pipelines (1f1b, zb-h1, chimera, chimera-zb): each micro-batch's "
             "sequence is cut into k equal slices that enter the pipeline in order as N x k "
             "units; a stage keeps the keys/values of a sequence's earlier slices for the later "
             "ones (docs/LONG_SEQUENCES.md). k must divide --seq-length (default 1: unsliced)")
    data_parallel_size: int = 1  # W = world / (T x CP x D)
    pipeline_schedule: str = "1f1b"  # a name of the schedule registry
    schedule_options: Any = None  # None: the schedule's defaults
    distributed_backend: str | None = flag(
        None, "--distributed-backend", choices=("nccl", "gloo"),
        help="nccl or gloo (default: nccl on CUDA, gloo on CPU)")
    distributed_timeout_minutes: float = flag(10.0, "--distributed-timeout-minutes",
                                              check=_timeout,
                                              help="timeout of collective operations")
    allow_cpu_training: bool = flag(
        False, "--allow-cpu-training", after="--no-gradient-accumulation-fusion",
        help="with --distributed-backend gloo on a machine with CUDA devices: train on the CPU "
             "on purpose (refused otherwise)")

    expert_model_parallel_size: int = flag(
        1, "--expert-model-parallel-size", check=positive, after="--pipeline-model-parallel-size",
        help="expert-parallel size EP: each MoE layer's experts split over EP ranks folded out of "
             "each pipeline rank's T x CP x W ranks (EP divides T x CP x W and --num-experts)")
    expert_tensor_parallel_size: int | None = flag(
        None, "--expert-tensor-parallel-size", type=int, check=positive,
        help="tensor-parallel size of the experts (only 1: experts are not tensor-split)")

    @property
    def layout(self) -> ParallelLayout:
        """The T x CP x W x D layout with EP folded in (the one owner of every size rule and of
        the rank order)."""
        return ParallelLayout(self.tensor_model_parallel_size, self.data_parallel_size,
                              self.pipeline_model_parallel_size, self.context_parallel_size,
                              self.expert_model_parallel_size)

    @property
    def world_size(self) -> int:
        """Total ranks: T x CP x W x D."""
        return self.layout.world_size


@dataclass(frozen=True)
class DDPConfig:
    """Gradient buffers and data-parallel reduction (Megatron's ``DistributedDataParallelConfig``).

    ``grad_reduce_in_fp32``: accumulate and reduce gradients in fp32 buffers
    (``--accumulate-allreduce-grads-in-fp32``; always on with ``--bf16``, as in Megatron).
    ``overlap_grad_reduce``: reduce each bucket as soon as its gradients are final, during the
    stage's last backward; otherwise each stage is reduced whole once its last backward is done.
    ``bucket_size``: elements per bucket (None: Megatron's ``max(40M, 1M x group size)`` with
    overlap, one bucket per stage without). ``use_distributed_optimizer``: shard the fp32 main
    parameters and optimizer state over each stage-replica group (ZeRO-1).
    ``overlap_param_gather``: all-gather the updated parameters in the background, waiting for
    a stage's parameters before its first forward of the next iteration.
    ``gradient_accumulation_fusion``: weight gradients computed straight into ``main_grad``
    (``--no-gradient-accumulation-fusion`` turns it off; see ``tensor_parallel.weight_grad``).
    """

    FLAG_GROUP: ClassVar[str] = "distributed"

    grad_reduce_in_fp32: bool = False
    overlap_grad_reduce: bool = flag(
        False, "--overlap-grad-reduce", after="--accumulate-allreduce-grads-in-fp32",
        help="reduce each gradient bucket as soon as it is final, during the stage's last "
             "backward (otherwise each stage once its last backward is done)")
    bucket_size: int | None = None
    use_distributed_optimizer: bool = flag(
        False, "--use-distributed-optimizer",
        help="shard fp32 main parameters and optimizer state over each stage-replica group "
             "(ZeRO-1)")
    overlap_param_gather: bool = flag(
        False, "--overlap-param-gather",
        help="all-gather updated parameters in the background; each stage waits before its "
             "first forward (needs --use-distributed-optimizer)")
    gradient_accumulation_fusion: bool = flag(
        True, "--no-gradient-accumulation-fusion",
        help="materialise each weight gradient and add it into the gradient buffer in a hook, "
             "instead of computing it straight into main_grad")

    def bucket_elements(self, group_size: int) -> int | None:
        """Elements per bucket for a reducing group of ``group_size`` ranks (None: whole)."""
        if self.bucket_size is not None:
            return self.bucket_size
        if self.overlap_grad_reduce:
            return max(40_000_000, 1_000_000 * group_size)
        return None
