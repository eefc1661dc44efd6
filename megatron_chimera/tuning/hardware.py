"""Hardware profiles for the performance model: compute peak, memory and a two-level network.

A profile gives the peak dense-matmul throughput per precision, the fraction of it a transformer
layer achieves (``efficiency``), the device memory and an alpha-beta model of the network: one
link inside a node (NVLink) and one across nodes (InfiniBand / Cray Aries). A communication group
uses the inter-node link as soon as its ranks span more than one node.

The presets are **approximate** figures from vendor data sheets and the Chimera paper's system
description; they are meant to rank configurations, not to predict to the percent:

* ``p100`` -- Piz Daint XC50 node as in the Chimera paper: one P100 16 GB per node (PCIe form
  factor, 9.3 TFLOP/s fp32, 18.7 TFLOP/s fp16 from NVIDIA's data sheet), Cray Aries network
  (about 10 GB/s injection bandwidth per node, MPI latency about 1.5 us). The paper trained in fp32.
* ``a100`` -- A100 SXM 80 GB, 8 per node: 19.5 TFLOP/s fp32, 312 TFLOP/s fp16/bf16 dense;
  NVLink 3 about 300 GB/s per direction, HDR InfiniBand 200 Gb/s (25 GB/s) per GPU.
* ``h100`` -- H100 SXM 80 GB, 8 per node: 67 TFLOP/s fp32, 989 TFLOP/s fp16/bf16 dense;
  NVLink 4 about 450 GB/s per direction, NDR InfiniBand 400 Gb/s (50 GB/s) per GPU.

Small micro-batches run below the large-GEMM efficiency: the achieved rate is
``peak x efficiency x m / (m + m_half)`` for ``m = B x s`` tokens per micro-batch, with ``m_half``
(``half_efficiency_tokens``) an approximate figure per device (128 for the P100, 512 for the
A100, 1024 for the H100: bigger devices need bigger GEMMs to fill). ``--profile`` measures instead.

A JSON file with the fields of :class:`HardwareProfile` (links as ``{"alpha_s", "bandwidth_gbps"}``
objects, bandwidth in GB/s) defines a custom profile; ``tools/gpu_check.sh`` writes one from a
GEMM sweep and a bandwidth measurement on the lent GPU (``hardware_profile.json``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from megatron_chimera.config import ConfigError

GB = 1e9
GIB = 2**30


@dataclass(frozen=True)
class LinkProfile:
    """Alpha-beta model of one link: a message of ``n`` bytes takes ``alpha_s + n / bandwidth``."""

    alpha_s: float
    bandwidth_gbps: float  # GB/s (1e9 bytes per second)

    @property
    def beta_s_per_byte(self) -> float:
        """Seconds per byte (the beta of the alpha-beta model)."""
        return 1.0 / (self.bandwidth_gbps * GB)


@dataclass(frozen=True)
class HardwareProfile:
    """Compute peak, efficiency, memory and network of one accelerator type."""

    name: str
    peak_tflops_fp32: float
    peak_tflops_half: float  # fp16 / bf16 dense matmul peak
    efficiency: float  # achievable fraction of the peak for large transformer layers
    memory_gb: float  # device memory, GB (1e9 bytes) as vendors quote it
    gpus_per_node: int
    intra_node: LinkProfile
    inter_node: LinkProfile
    # tokens per micro-batch (B x s) at which a layer reaches half of ``efficiency``; models
    # small-GEMM inefficiency and per-kernel overheads (0: efficiency independent of B)
    half_efficiency_tokens: float = 0.0
    # host seconds before every compute action (the runtime's bookkeeping between two actions;
    # ``tools/benchmark_schedules.py --trace`` measures it): matters when actions are short
    action_overhead_s: float = 0.0
    # device-memory bandwidth, GB/s (``tools/gpu_check.sh`` measures it; 0: unknown): recorded
    # with a measured profile, not used by the cost model yet
    memory_bandwidth_gbps: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 < self.efficiency <= 1.0:
            raise ConfigError(f"--hardware: efficiency must be in (0, 1], got {self.efficiency}")
        if self.gpus_per_node < 1:
            raise ConfigError(f"--hardware: gpus_per_node must be >= 1, got {self.gpus_per_node}")
        if min(self.peak_tflops_fp32, self.peak_tflops_half, self.memory_gb) <= 0:
            raise ConfigError("--hardware: peak TFLOP/s and memory must be positive")

    def achieved_flops(self, params_dtype: str, tokens: float | None = None) -> float:
        """FLOP/s a transformer stage reaches in ``params_dtype`` on micro-batches of ``tokens``
        tokens: ``peak x efficiency x tokens / (tokens + half_efficiency_tokens)``."""
        peak = self.peak_tflops_fp32 if params_dtype == "fp32" else self.peak_tflops_half
        saturation = 1.0
        if tokens is not None and self.half_efficiency_tokens > 0:
            saturation = tokens / (tokens + self.half_efficiency_tokens)
        return peak * 1e12 * self.efficiency * saturation

    def node_of(self, rank: int) -> int:
        """Node index of a global rank (ranks fill nodes consecutively)."""
        return rank // self.gpus_per_node

    def link_for(self, ranks: Iterable[int]) -> LinkProfile:
        """The link a group of global ranks communicates over: inter-node if it spans nodes."""
        nodes = {self.node_of(r) for r in ranks}
        return self.intra_node if len(nodes) <= 1 else self.inter_node

    def to_dict(self) -> dict:
        """Plain-JSON form (the format :func:`load_hardware` reads)."""
        return asdict(self)


PRESETS: dict[str, HardwareProfile] = {
    "p100": HardwareProfile(
        name="p100",
        peak_tflops_fp32=9.3,
        peak_tflops_half=18.7,
        efficiency=0.6,
        memory_gb=16.0,
        gpus_per_node=1,
        intra_node=LinkProfile(alpha_s=1.5e-6, bandwidth_gbps=10.0),
        inter_node=LinkProfile(alpha_s=1.5e-6, bandwidth_gbps=10.0),
        half_efficiency_tokens=128.0,
    ),
    "a100": HardwareProfile(
        name="a100",
        peak_tflops_fp32=19.5,
        peak_tflops_half=312.0,
        efficiency=0.5,
        memory_gb=80.0,
        gpus_per_node=8,
        intra_node=LinkProfile(alpha_s=3e-6, bandwidth_gbps=300.0),
        inter_node=LinkProfile(alpha_s=5e-6, bandwidth_gbps=25.0),
        half_efficiency_tokens=512.0,
    ),
    "h100": HardwareProfile(
        name="h100",
        peak_tflops_fp32=67.0,
        peak_tflops_half=989.0,
        efficiency=0.5,
        memory_gb=80.0,
        gpus_per_node=8,
        intra_node=LinkProfile(alpha_s=3e-6, bandwidth_gbps=450.0),
        inter_node=LinkProfile(alpha_s=5e-6, bandwidth_gbps=50.0),
        half_efficiency_tokens=1024.0,
    ),
}


def _profile_from_dict(data: dict, source: str) -> HardwareProfile:
    known = {f.name for f in fields(HardwareProfile)}
    unknown = set(data) - known
    missing = known - set(data) - {"name", "half_efficiency_tokens", "action_overhead_s",
                                   "memory_bandwidth_gbps"}
    if unknown or missing:
        raise ConfigError(
            f"--hardware {source}: unknown keys {sorted(unknown)}, missing keys {sorted(missing)}"
        )
    values = dict(data)
    values.setdefault("name", Path(source).stem)
    try:
        for key in ("intra_node", "inter_node"):
            values[key] = LinkProfile(**values[key])
        return HardwareProfile(**values)
    except TypeError as exc:
        raise ConfigError(f"--hardware {source}: bad link description ({exc})") from None


def load_hardware(name_or_path: str) -> HardwareProfile:
    """A preset by name (``p100``, ``a100``, ``h100``) or a profile read from a JSON file."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise ConfigError(
            f"--hardware: {name_or_path!r} is neither a preset {sorted(PRESETS)} nor a JSON file"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--hardware {name_or_path}: invalid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--hardware {name_or_path}: expected a JSON object")
    return _profile_from_dict(data, name_or_path)
