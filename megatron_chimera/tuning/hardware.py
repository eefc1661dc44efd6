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
sustains: clocks under load, instruction issue; 0.75), ``memory_efficiency`` (the fraction of the
HBM bandwidth a streaming kernel reaches, STREAM-like; 0.85) and ``kernel_overhead_s`` (the gap
between two back-to-back kernels on the device, 2 us).

The communication backend is part of the profile (``collective_backend``): ``nccl`` moves device
memory directly over the links (the links' bandwidth is what a message or an all-reduce gets);
``gloo`` with CUDA tensors is host-staged, as the Chimera paper's runtime ran (its README: "We use
GLOO as the distributed backend"): every all-reduce buffer is copied device -> host into pinned
memory, reduced by gloo's ring on the CPU over TCP, and copied back (PyTorch's ProcessGroupGloo),
and every pipeline message is copied to the host, sent over TCP and copied to the receiving
device. Such a profile gives the device <-> host copy bandwidth (``host_copy_gbps``, PCIe) and
the bandwidth gloo's host path reaches per connection (``host_transport_gbps``: TCP stack, one
connection per peer, CPU reduction; measured). :meth:`HardwareProfile.message_link` and
:meth:`HardwareProfile.collective_link` turn a link into what a message or an all-reduce sees;
:meth:`HardwareProfile.concurrent_collectives` says how many all-reduces of different process
groups one rank runs at once (1 device-direct; with gloo as many as the link carries).

JSON schema (``load_hardware_profile(path)``; also ``--hardware PATH``)::

    {
      "name": "a100-measured",          # optional (default: the file's stem)
      "peak_tflops_fp32": 19.5,         # dense fp32 peak, TFLOP/s (non-tensor-core)
      "peak_tflops_half": 312.0,        # dense fp16/bf16 tensor-core peak, TFLOP/s
      "peak_tflops_fp8": 0.0,           # optional: dense FP8 tensor-core peak (0: no FP8)
      "mxfp8_tensor_cores": false,      # optional: block-scaled (MX) FP8 in the tensor cores
      "efficiency": 0.8,                # fraction of the peak a large GEMM sustains, (0, 1]
      "memory_gb": 80.0,                # device memory, GB (1e9 bytes)
      "gpus_per_node": 8,
      "intra_node": {"alpha_s": 5e-6, "bandwidth_gbps": 300.0},   # per GPU, per direction
      "inter_node": {"alpha_s": 5e-6, "bandwidth_gbps": 25.0},    # per GPU (its NIC)
      "hbm_bandwidth_gbps": 2039.0,     # optional: 0 = memory-bound work not modelled
      "memory_efficiency": 0.85,        # optional: fraction of hbm_bandwidth_gbps reached
      "num_sms": 108,                   # optional: 0 = no tile / wave quantisation
      "kernel_overhead_s": 2e-6,        # optional: device gap per kernel
      "action_overhead_s": 0.0,         # optional: host seconds per pipeline action
      "collective_backend": "nccl",     # optional: nccl (device-direct) | gloo (host-staged)
      "host_copy_gbps": 0.0,            # gloo: device <-> host copy GB/s per direction (PCIe)
      "host_transport_gbps": 0.0        # gloo: GB/s per connection of gloo's host path
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
BACKENDS = ("nccl", "gloo")


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
    # how messages and collectives move (module doc): nccl (device-direct) or gloo (host-staged)
    collective_backend: str = "nccl"
    host_copy_gbps: float = 0.0  # gloo: device <-> host copy GB/s per direction
    host_transport_gbps: float = 0.0  # gloo: GB/s per connection of the host path (TCP, CPU)
    peak_tflops_fp8: float = 0.0  # dense FP8 tensor-core peak; 0: no FP8 tensor cores
    mxfp8_tensor_cores: bool = False  # MX block scales applied by the tensor cores (Blackwell)

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
               self.action_overhead_s, self.peak_tflops_fp8) < 0:
            raise ConfigError("--hardware: hbm_bandwidth_gbps, num_sms, kernel_overhead_s, "
                              "action_overhead_s and peak_tflops_fp8 must be >= 0")
        if self.collective_backend not in BACKENDS:
            raise ConfigError(f"--hardware: collective_backend must be one of {BACKENDS}, got "
                              f"{self.collective_backend!r}")
        if self.host_staged and min(self.host_copy_gbps, self.host_transport_gbps) <= 0:
            raise ConfigError("--hardware: collective_backend 'gloo' needs host_copy_gbps and "
                              "host_transport_gbps > 0 (its messages and all-reduces cross the "
                              "host)")

    @property
    def host_staged(self) -> bool:
        """Whether messages and collectives go through host memory (``gloo``)."""
        return self.collective_backend == "gloo"

    def describe_backend(self) -> str:
        """One line: how this profile's messages and collectives move."""
        if not self.host_staged:
            return f"{self.collective_backend} (device-direct over the links)"
        return (f"gloo (host-staged: device <-> host copies at {self.host_copy_gbps:.2f} GB/s "
                f"each way, gloo's host path at {self.host_transport_gbps:.2f} GB/s per "
                f"connection)")

    def message_link(self, link: LinkProfile) -> LinkProfile:
        """What one point-to-point message over ``link`` sees. Host-staged (gloo): a copy to the
        host, the send at the slower of the link and gloo's host path, a copy to the receiving
        device, one after the other: ``1/B = 1/min(link, transport) + 2/copy``."""
        if not self.host_staged:
            return link
        per_byte = 1.0 / min(link.bandwidth_gbps, self.host_transport_gbps) \
            + 2.0 / self.host_copy_gbps
        return LinkProfile(link.alpha_s, 1.0 / per_byte)

    def collective_link(self, link: LinkProfile, ranks: int) -> LinkProfile:
        """The link whose Rabenseifner cost ``2 log2(r) alpha + 2 (r-1)/r n beta`` is the
        all-reduce of ``n`` bytes over ``ranks`` ranks on this backend. Host-staged (gloo): the
        ring runs at the slower of the link and gloo's host path, and the whole buffer is copied
        to the host and back (``2 n / copy``, whatever r), folded into beta exactly."""
        if not self.host_staged or ranks < 2:
            return link
        share = 2.0 * (ranks - 1) / ranks
        per_byte = 1.0 / min(link.bandwidth_gbps, self.host_transport_gbps) \
            + 2.0 / (share * self.host_copy_gbps)
        return LinkProfile(link.alpha_s, 1.0 / per_byte)

    def concurrent_collectives(self, link: LinkProfile) -> int:
        """How many collectives of different process groups (a rank's stage all-reduces) run at
        once at full speed over ``link``. Device-direct: 1 (they share the link's bandwidth).
        Host-staged (gloo): each process group has its own TCP connection per peer and its own
        worker threads, and one connection, not the NIC, is the limit ([gloo-tcp]), so as many
        as the link carries at gloo's host-path rate, ``floor(link / transport)`` (the PCIe
        copies need about half the transport rate each way per collective)."""
        if not self.host_staged:
            return 1
        carried = min(link.bandwidth_gbps, self.host_copy_gbps) / self.host_transport_gbps
        return max(1, int(carried))

    def peak_flops(self, params_dtype: str) -> float:
        """Data-sheet dense matmul FLOP/s in ``params_dtype``: fp32, fp16 / bf16 (one tensor-core
        rate on every preset) or fp8 (ConfigError on a profile without FP8 tensor cores)."""
        if params_dtype == "fp8":
            if self.peak_tflops_fp8 <= 0:
                raise ConfigError(f"--fp8-format: the {self.name} profile has no FP8 tensor "
                                  f"cores (peak_tflops_fp8 is 0)")
            return self.peak_tflops_fp8 * 1e12
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
# [H100] NVIDIA H100 Tensor Core GPU data sheet, SXM5: 67 TFLOP/s fp32; the tensor-core figures
#        are quoted "with sparsity" (BF16 / FP16 1,979, FP8 3,958 TFLOP/s), dense is half: 989
#        fp16 / bf16 (one rate for both) and 1,979 FP8; 3.35 TB/s HBM3, NVLink 4 900 GB/s (450
#        per direction); 132 SMs, 128 FP32 cores per SM (H100 whitepaper); DGX H100: 8 x 400
#        Gb/s NDR ConnectX-7, one 50 GB/s NIC per GPU. FP8 needs Hopper or newer (A100, P100:
#        none, peak_tflops_fp8 0); Hopper has no MX block-scaled tensor cores (Blackwell does).
# [H200] NVIDIA H200 data sheet, SXM: same compute as H100 SXM (67 / 989 / FP8 1,979 dense),
#        141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s; DGX H200 8 x 400 Gb/s NDR per node.
# [P100] NVIDIA Tesla P100 PCIe data sheet (16 GB): 9.3 TFLOP/s fp32, 18.7 TFLOP/s fp16,
#        732 GB/s HBM2, 56 SMs; Piz Daint XC50 (CSCS): one P100 per node on the Cray Aries
#        network, about 10 GB/s injection bandwidth per node (Chimera paper, Sec. 5).
# [P100-PCIe] Microway, "NVIDIA Tesla P100 PCI-E 16GB GPU Accelerator (Pascal GP100) Up Close":
#        CUDA bandwidthTest --memory=pinned on a Tesla P100-PCIE-16GB (PCIe 3.0 x16), 32 MB:
#        host -> device 11,688 MB/s, device -> host 12,886 MB/s. A round trip of n bytes takes
#        n/11.688 + n/12.886 GB/s, i.e. 2n at their harmonic mean (12.26 GB/s).
# [gloo-tcp] pytorch/gloo issue #248 (2020): gloo's allreduce_ring_chunked over its TCP transport
#        between two Xeon E5-2620 v4 hosts (40 GbE, 5 GB/s line rate), one connection per peer:
#        5,000,000 fp32 (20 MB) in 17,251 us (p50), 1.16 GB/s, "the avg bandwidth doesn't go up"
#        with more elements -- the host path (TCP stack, one connection per peer, CPU
#        reduction), not the NIC, is the limit. Each rank sends 2 (r-1)/r n = n bytes at r = 2,
#        so 1.16 GB/s is also the ring's per-rank bandwidth. Each process ran pinned to one core
#        (taskset -c 0) with one gloo thread: a per-connection, per-core figure, which is why
#        collectives of different process groups (own connections and worker threads) run at
#        once (concurrent_collectives).
# [PG-gloo] PyTorch's ProcessGroupGloo (torch/csrc/distributed/c10d/ProcessGroupGloo.cpp,
#        AsyncAllreduceCUDAWork): a CUDA all-reduce copies its tensors to pinned host memory,
#        runs gloo's all-reduce on the host tensors and copies the result back; the ring is
#        its default algorithm (PyTorch PR #9309) over one connection per peer and interface
#        (PR #22978).
# [Chimera-code] The paper's reference code (github.com/Shigangli/Chimera): "We use GLOO as the
#        distributed backend"; its jobs set NCCL_SOCKET_IFNAME=ipogif0 (TCP/IP over the Aries
#        NIC); its pipeline messages are sent as tensor.cpu() over gloo and moved back with
#        .cuda(); its gradients are all-reduced with gloo on CUDA tensors (host-staged).
#        Piz Daint's XC50 nodes hold a 12-core Xeon E5-2690 v3 (Haswell, 2.6 GHz), of the class
#        of the [gloo-tcp] hosts.
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


_P100_HOST_COPY_GBPS = 2.0 / (1.0 / 11.688 + 1.0 / 12.886)  # [P100-PCIe]
_GLOO_TCP_GBPS = 5_000_000 * 4 / 17_251e-6 / GB  # [gloo-tcp]: 1.16 GB/s


def _p100(name: str, backend: str = "nccl") -> HardwareProfile:
    staged = backend == "gloo"
    return HardwareProfile(name, 9.3, 18.7, GEMM_EFFICIENCY, 16.0, 1, _ARIES, _ARIES,
                           hbm_bandwidth_gbps=732.0, num_sms=56, kernel_overhead_s=KERNEL_GAP_S,
                           collective_backend=backend,
                           host_copy_gbps=_P100_HOST_COPY_GBPS if staged else 0.0,
                           host_transport_gbps=_GLOO_TCP_GBPS if staged else 0.0)


PRESETS: dict[str, HardwareProfile] = {
    "p100": _p100("p100"),
    # Piz Daint as the Chimera paper ran it: gloo over TCP on the Aries NIC [Chimera-code]
    "p100-gloo": _p100("p100-gloo", "gloo"),
    "a100": _a100("a100", 80.0, 2039.0),  # the 80 GB SXM of Selene
    "a100-80gb": _a100("a100-80gb", 80.0, 2039.0),
    "a100-40gb": _a100("a100-40gb", 40.0, 1555.0),
    "h100": HardwareProfile("h100", 67.0, 989.0, GEMM_EFFICIENCY, 80.0, 8, _NVLINK4, _NDR_IB,
                            hbm_bandwidth_gbps=3350.0, num_sms=132,
                            kernel_overhead_s=KERNEL_GAP_S, peak_tflops_fp8=1979.0),
    "h200": HardwareProfile("h200", 67.0, 989.0, GEMM_EFFICIENCY, 141.0, 8, _NVLINK4, _NDR_IB,
                            hbm_bandwidth_gbps=4800.0, num_sms=132,
                            kernel_overhead_s=KERNEL_GAP_S, peak_tflops_fp8=1979.0),
}

OPTIONAL_KEYS = ("name", "action_overhead_s", "hbm_bandwidth_gbps", "memory_efficiency",
                 "num_sms", "kernel_overhead_s", "collective_backend", "host_copy_gbps",
                 "host_transport_gbps", "peak_tflops_fp8", "mxfp8_tensor_cores")


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
