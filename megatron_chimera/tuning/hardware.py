"""Hardware profiles for the performance model: compute peak, memory bandwidth, GEMM shape
behaviour and a two-level network.

A profile gives the data-sheet peak dense-matmul throughput per precision, the HBM bandwidth, the
number of streaming multiprocessors (for the GEMM tile and wave quantisation of
:mod:`megatron_chimera.tuning.operators`), the device memory and an alpha-beta model of the
network: one link inside a node (NVLink) and one across nodes (InfiniBand / Cray Aries), both per
GPU and per direction. A communication group uses the inter-node link as soon as its ranks span
more than one node.

Every figure of the presets is a published one; the source is named next to it in
:data:`PRESETS`. Three numbers are not data-sheet figures but physical assumptions shared by all
presets, named so that a measured profile (``tools/gpu_check.sh`` when a GPU is lent) can replace
them: ``efficiency`` (the fraction of the data-sheet peak that a large, well-shaped GEMM
sustains: clocks under load, instruction issue; 0.8), ``memory_efficiency`` (the fraction of the
HBM bandwidth a streaming kernel reaches, STREAM-like; 0.85) and ``kernel_overhead_s`` (the gap
between two back-to-back kernels on the device, 2 us).

JSON schema (``load_hardware_profile(path)``; also ``--hardware PATH``)::

    {
      "name": "a100-measured",          # optional (default: the file's stem)
      "peak_tflops_fp32": 19.5,         # dense fp32 peak, TFLOP/s (non-tensor-core)
      "peak_tflops_half": 312.0,        # dense fp16/bf16 tensor-core peak, TFLOP/s
      "efficiency": 0.8,                # fraction of the peak a large GEMM sustains, (0, 1]
      "memory_gb": 80.0,                # device memory, GB (1e9 bytes)
      "gpus_per_node": 8,
      "intra_node": {"alpha_s": 5e-6, "bandwidth_gbps": 300.0},   # per GPU, per direction
      "inter_node": {"alpha_s": 5e-6, "bandwidth_gbps": 25.0},    # per GPU (its NIC)
      "hbm_bandwidth_gbps": 2039.0,     # optional: 0 = memory-bound work not modelled
      "memory_efficiency": 0.85,        # optional: fraction of hbm_bandwidth_gbps reached
      "num_sms": 108,                   # optional: 0 = no tile / wave quantisation
      "kernel_overhead_s": 2e-6,        # optional: device gap per kernel
      "action_overhead_s": 0.0          # optional: host seconds per pipeline action
    }

Unknown keys are rejected (``half_efficiency_tokens`` of the old tokens-per-rank curve included:
the GEMM shape model replaced it).
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
    """Compute peak, GEMM efficiency, memory bandwidth, memory and network of one accelerator."""

    name: str
    peak_tflops_fp32: float
    peak_tflops_half: float  # fp16 / bf16 dense matmul peak
    efficiency: float  # fraction of the peak a large, well-shaped GEMM sustains
    memory_gb: float  # device memory, GB (1e9 bytes) as vendors quote it
    gpus_per_node: int
    intra_node: LinkProfile
    inter_node: LinkProfile
    # host seconds before every compute action (the runtime's bookkeeping between two actions;
    # ``tools/benchmark_schedules.py --trace`` measures it): matters when actions are short
    action_overhead_s: float = 0.0
    hbm_bandwidth_gbps: float = 0.0  # GB/s; 0: memory-bound work is not modelled
    memory_efficiency: float = 0.85  # fraction of the HBM bandwidth a streaming kernel reaches
    num_sms: int = 0  # streaming multiprocessors; 0: no tile / wave quantisation
    kernel_overhead_s: float = 0.0  # device time between two back-to-back kernels

    def __post_init__(self) -> None:
        if not 0.0 < self.efficiency <= 1.0:
            raise ConfigError(f"--hardware: efficiency must be in (0, 1], got {self.efficiency}")
        if not 0.0 < self.memory_efficiency <= 1.0:
            raise ConfigError(f"--hardware: memory_efficiency must be in (0, 1], got "
                              f"{self.memory_efficiency}")
        if self.gpus_per_node < 1:
            raise ConfigError(f"--hardware: gpus_per_node must be >= 1, got {self.gpus_per_node}")
        if min(self.peak_tflops_fp32, self.peak_tflops_half, self.memory_gb) <= 0:
            raise ConfigError("--hardware: peak TFLOP/s and memory must be positive")
        if min(self.hbm_bandwidth_gbps, self.num_sms, self.kernel_overhead_s,
               self.action_overhead_s) < 0:
            raise ConfigError("--hardware: hbm_bandwidth_gbps, num_sms, kernel_overhead_s and "
                              "action_overhead_s must be >= 0")

    def peak_flops(self, params_dtype: str) -> float:
        """Data-sheet dense matmul FLOP/s in ``params_dtype`` (fp32, or 16-bit tensor cores)."""
        return (self.peak_tflops_fp32 if params_dtype == "fp32" else self.peak_tflops_half) * 1e12

    def achieved_flops(self, params_dtype: str) -> float:
        """FLOP/s of a large, well-shaped GEMM: ``peak x efficiency``."""
        return self.peak_flops(params_dtype) * self.efficiency

    def memory_bytes_per_s(self) -> float:
        """Bytes per second a streaming (memory-bound) kernel moves; inf when not modelled."""
        if self.hbm_bandwidth_gbps <= 0:
            return float("inf")
        return self.hbm_bandwidth_gbps * GB * self.memory_efficiency

    def node_of(self, rank: int) -> int:
        """Node index of a global rank (ranks fill nodes consecutively)."""
        return rank // self.gpus_per_node

    def link_for(self, ranks: Iterable[int]) -> LinkProfile:
        """The link a group of global ranks communicates over: inter-node if it spans nodes."""
        nodes = {self.node_of(r) for r in ranks}
        return self.intra_node if len(nodes) <= 1 else self.inter_node

    def to_dict(self) -> dict:
        """Plain-JSON form (the format :func:`load_hardware_profile` reads)."""
        return asdict(self)


# Shared physical assumptions (module doc): large-GEMM fraction of the peak, kernel gap.
GEMM_EFFICIENCY = 0.75
KERNEL_GAP_S = 2e-6

# Sources.
# [A100] NVIDIA A100 Tensor Core GPU data sheet (2021): 19.5 TFLOP/s fp32, 312 TFLOP/s fp16/bf16
#        dense; 80 GB SXM 2,039 GB/s, 40 GB SXM 1,555 GB/s HBM2e/HBM2; NVLink 3 600 GB/s
#        (bidirectional, i.e. 300 GB/s per direction); 108 SMs (NVIDIA A100 architecture
#        whitepaper).
# [Selene] Narayanan et al., SC'21, Sec. 5: DGX A100 nodes, 8 GPUs, 8 x 200 Gb/s HDR InfiniBand
#        per node, i.e. one 25 GB/s NIC per GPU.
# [H100] NVIDIA H100 Tensor Core GPU data sheet, SXM5: 67 TFLOP/s fp32, 989 TFLOP/s fp16/bf16
#        dense, 3.35 TB/s HBM3, NVLink 4 900 GB/s (450 per direction); 132 SMs (H100 whitepaper);
#        DGX H100: 8 x 400 Gb/s NDR ConnectX-7, one 50 GB/s NIC per GPU.
# [H200] NVIDIA H200 data sheet, SXM: same compute as H100 SXM (67 / 989 dense), 141 GB HBM3e at
#        4.8 TB/s, NVLink 900 GB/s; DGX H200 8 x 400 Gb/s NDR per node.
# [P100] NVIDIA Tesla P100 PCIe data sheet (16 GB): 9.3 TFLOP/s fp32, 18.7 TFLOP/s fp16,
#        732 GB/s HBM2, 56 SMs; Piz Daint XC50 (CSCS): one P100 per node on the Cray Aries
#        network, about 10 GB/s injection bandwidth per node (Chimera paper, Sec. 5).
# Latencies (alpha): NCCL / MPI small-message latencies of a few microseconds, orders of magnitude.
_NVLINK3 = LinkProfile(alpha_s=5e-6, bandwidth_gbps=300.0)  # [A100]
_NVLINK4 = LinkProfile(alpha_s=5e-6, bandwidth_gbps=450.0)  # [H100], [H200]
_HDR_IB = LinkProfile(alpha_s=5e-6, bandwidth_gbps=25.0)  # [Selene]
_NDR_IB = LinkProfile(alpha_s=5e-6, bandwidth_gbps=50.0)  # [H100], [H200]
_ARIES = LinkProfile(alpha_s=1.5e-6, bandwidth_gbps=10.0)  # [P100]


def _a100(name: str, memory_gb: float, hbm_gbps: float) -> HardwareProfile:
    return HardwareProfile(name, 19.5, 312.0, GEMM_EFFICIENCY, memory_gb, 8, _NVLINK3, _HDR_IB,
                           hbm_bandwidth_gbps=hbm_gbps, num_sms=108,
                           kernel_overhead_s=KERNEL_GAP_S)


PRESETS: dict[str, HardwareProfile] = {
    "p100": HardwareProfile("p100", 9.3, 18.7, GEMM_EFFICIENCY, 16.0, 1, _ARIES, _ARIES,
                            hbm_bandwidth_gbps=732.0, num_sms=56,
                            kernel_overhead_s=KERNEL_GAP_S),
    "a100": _a100("a100", 80.0, 2039.0),  # the 80 GB SXM of Selene
    "a100-80gb": _a100("a100-80gb", 80.0, 2039.0),
    "a100-40gb": _a100("a100-40gb", 40.0, 1555.0),
    "h100": HardwareProfile("h100", 67.0, 989.0, GEMM_EFFICIENCY, 80.0, 8, _NVLINK4, _NDR_IB,
                            hbm_bandwidth_gbps=3350.0, num_sms=132,
                            kernel_overhead_s=KERNEL_GAP_S),
    "h200": HardwareProfile("h200", 67.0, 989.0, GEMM_EFFICIENCY, 141.0, 8, _NVLINK4, _NDR_IB,
                            hbm_bandwidth_gbps=4800.0, num_sms=132,
                            kernel_overhead_s=KERNEL_GAP_S),
}

OPTIONAL_KEYS = ("name", "action_overhead_s", "hbm_bandwidth_gbps", "memory_efficiency",
                 "num_sms", "kernel_overhead_s")


def _profile_from_dict(data: dict, source: str) -> HardwareProfile:
    known = {f.name for f in fields(HardwareProfile)}
    unknown = set(data) - known
    missing = known - set(data) - set(OPTIONAL_KEYS)
    if unknown or missing:
        raise ConfigError(
            f"--hardware {source}: unknown keys {sorted(unknown)}, missing keys {sorted(missing)}"
            " (schema: megatron_chimera/tuning/hardware.py)"
        )
    values = dict(data)
    values.setdefault("name", Path(source).stem)
    try:
        for key in ("intra_node", "inter_node"):
            values[key] = LinkProfile(**values[key])
        return HardwareProfile(**values)
    except TypeError as exc:
        raise ConfigError(f"--hardware {source}: bad link description ({exc})") from None


def load_hardware_profile(path: str | Path) -> HardwareProfile:
    """A profile read from a JSON file (schema in the module doc)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--hardware: no such profile file {str(path)!r}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--hardware {path}: invalid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--hardware {path}: expected a JSON object")
    return _profile_from_dict(data, str(path))


def load_hardware(name_or_path: str) -> HardwareProfile:
    """A preset by name (:data:`PRESETS`) or a profile read from a JSON file."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if not Path(name_or_path).is_file():
        raise ConfigError(
            f"--hardware: {name_or_path!r} is neither a preset {sorted(PRESETS)} nor a JSON file"
        )
    return load_hardware_profile(name_or_path)
