"""Compile targets by the names users type (TPU slices, NVIDIA GPU sets): chips, HBM, peak FLOP/s, deviceless devices."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
import sys
from pathlib import Path

from jax._src import xla_bridge
from jax.experimental import topologies

from cisjax import errors

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator chip (a TPU chip, one GPU)."""

    name: str  # v5p | h100 | ...
    platform: str  # tpu | cuda
    hbm_bytes: float  # HBM per chip, as the vendor documents it
    usable_bytes: float  # what one program may use: the TPU compiler's "available HBM"; a GPU's HBM x the JAX client's memory fraction
    peak_flops: float  # dense bf16 FLOP/s per chip
    hbm_bandwidth: float  # bytes/s per chip
    cores_per_chip: int = 1  # TensorCores counted in a TPU slice's name (v4/v5p name cores, v5e/v6e chips)
    torus_dims: int = 0  # 3 (v4, v5p) or 2 (v5e, v6e); 0 for GPUs
    source: str = ""


# TPU figures: peak bf16, HBM and bandwidth from Google's system-architecture pages (cloud.google.com/tpu/docs/v4,
# /v5e, /v5p, /v6e). usable_bytes: the "available HBM" that libtpu 0.0.42.1's compiler names in its out-of-memory
# error when compiling for that chip here (tests/plan/test_hardware.py probes it again).
TPU_CHIPS = {
    "v4": Chip(
        "v4",
        "tpu",
        32 * GIB,
        30.75 * GIB,
        275e12,
        1200e9,
        cores_per_chip=2,
        torus_dims=3,
        source="cloud.google.com/tpu/docs/v4: 275 TFLOP/s bf16, 32 GiB HBM2, 1200 GB/s",
    ),
    "v5e": Chip(
        "v5e",
        "tpu",
        16 * GIB,
        15.75 * GIB,
        197e12,
        819e9,
        cores_per_chip=1,
        torus_dims=2,
        source="cloud.google.com/tpu/docs/v5e: 197 TFLOP/s bf16, 16 GB HBM2, 819 GB/s",
    ),
    "v5p": Chip(
        "v5p",
        "tpu",
        95 * GIB,
        95.74 * GIB,
        459e12,
        2765e9,
        cores_per_chip=2,
        torus_dims=3,
        source="cloud.google.com/tpu/docs/v5p: 459 TFLOP/s bf16, 95 GB HBM2e, 2765 GB/s",
    ),
    "v6e": Chip(
        "v6e",
        "tpu",
        32 * GIB,
        31.25 * GIB,
        918e12,
        1638e9,
        cores_per_chip=1,
        torus_dims=2,
        source="cloud.google.com/tpu/docs/v6e: 918 TFLOP/s bf16, 32 GB HBM, 1638 GB/s",
    ),
}
TPU_ALIASES = {"v5litepod": "v5e"}

# GPU memory a JAX process may use by default: the client preallocates 75% (XLA_PYTHON_CLIENT_MEM_FRACTION).
GPU_MEM_FRACTION = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """What XLA's GPU compiler needs to know of a device it cannot see (a GpuTargetConfigProto), from the vendor's
    data sheet and the CUDA programming guide's per-compute-capability limits."""

    description: str  # the device name CUDA reports
    sm_count: int
    compute_capability: tuple[int, int]
    clock_ghz: float  # boost clock
    fp32_cores_per_sm: int
    l2_bytes: int
    shared_per_sm: int  # bytes of shared memory per SM
    shared_per_block_optin: int  # bytes a block may opt in to


def _gpu(name, spec: GpuSpec, hbm_bytes, peak, bandwidth, source) -> tuple[Chip, GpuSpec]:
    return Chip(name, "cuda", hbm_bytes, hbm_bytes * GPU_MEM_FRACTION, peak, bandwidth, source=source), spec


# Dense (no sparsity) bf16 peaks; NVIDIA quotes twice these "with sparsity".
GPU_CHIPS = {
    "h100": _gpu(
        "h100",
        GpuSpec("NVIDIA H100 80GB HBM3", 132, (9, 0), 1.98, 128, 50 * 2**20, 228 * 1024, 227 * 1024),
        80e9,
        989.4e12,
        3.35e12,
        "NVIDIA H100 SXM data sheet: 989 TFLOP/s bf16 dense, 80 GB HBM3, 3.35 TB/s",
    ),
    "h200": _gpu(
        "h200",
        GpuSpec("NVIDIA H200", 132, (9, 0), 1.98, 128, 50 * 2**20, 228 * 1024, 227 * 1024),
        141e9,
        989.4e12,
        4.8e12,
        "NVIDIA H200 SXM data sheet: 989 TFLOP/s bf16 dense, 141 GB HBM3e, 4.8 TB/s",
    ),
    "a100": _gpu(
        "a100",
        GpuSpec("NVIDIA A100-SXM4-80GB", 108, (8, 0), 1.41, 64, 40 * 2**20, 164 * 1024, 163 * 1024),
        80e9,
        312e12,
        2.039e12,
        "NVIDIA A100 80GB SXM data sheet: 312 TFLOP/s bf16 dense, 80 GB HBM2e, 2039 GB/s",
    ),
}


# The host link of one chip (bytes/s, one direction), what train.offload_optimizer's moments cross twice per step.
HOST_LINKS = {
    "a100": (32e9, "NVIDIA A100 data sheet: PCIe Gen4 x16, 64 GB/s both directions"),
    "h100": (64e9, "NVIDIA H100 SXM data sheet: PCIe Gen5 x16, 128 GB/s both directions"),
    "h200": (64e9, "NVIDIA H200 data sheet: PCIe Gen5 x16, 128 GB/s both directions"),
    **{
        tpu: (
            15e9,
            "Google publishes no per-chip host link figure; the JAX scaling book (jax-ml.github.io/scaling-book, "
            "part 2) uses 1.5e10 B/s for a TPU chip's PCIe link, taken here for every generation",
        )
        for tpu in TPU_CHIPS
    },
}


def host_link(chip: Chip) -> tuple[float, str]:
    """(bytes/s one way, source) of the chip's link to its host's memory."""
    return HOST_LINKS[chip.name]


@dataclasses.dataclass(frozen=True)
class DevicePeak:
    """A device's dense peak FLOP/s per compute dtype, as its vendor documents it (None: not documented)."""

    kind: str  # jax's Device.device_kind (CUDA's device name on an NVIDIA GPU)
    bf16: float
    # full fp32 (no TF32: cisjax's fp32 programs on a GPU multiply in fp32, runtime.matmul_precision)
    fp32: float | None
    source: str

    def flops(self, dtype: str) -> float | None:
        """The peak of a program computing in `dtype` ("bfloat16" / "bf16", "float32" / "fp32"); None if undocumented."""
        return {"bfloat16": self.bf16, "bf16": self.bf16, "float32": self.fp32, "fp32": self.fp32}.get(str(dtype))


def _chip_peak(kind: str, chip: Chip, fp32: float | None, fp32_source: str = "") -> DevicePeak:
    """The peak of a device the plan also targets: its bf16 figure and source from the chip table."""
    return DevicePeak(kind, chip.peak_flops, fp32, f"{chip.source}{'; ' + fp32_source if fp32_source else ''}")


# MFU's denominators (cisjax bench moe / step, the GPU check), by the device kind jax reports; a kind not listed has no
# MFU (never a guess). NVIDIA's tensor-core figures are quoted "with sparsity": the dense peak is half. fp32: the
# CUDA-core FP32 line of the same data sheet. TPU kinds as libtpu names them (tests/plan/test_hardware.py); Google
# documents no fp32 peak.
_H100_SHEET = "NVIDIA H100 Tensor Core GPU data sheet (nvidia.com/en-us/data-center/h100)"
_H200_SHEET = "NVIDIA H200 Tensor Core GPU data sheet (nvidia.com/en-us/data-center/h200)"
_A100_SHEET = "NVIDIA A100 Tensor Core GPU data sheet (nvidia.com/en-us/data-center/a100)"
DEVICE_PEAKS = {
    p.kind: p
    for p in (
        _chip_peak("NVIDIA H100 80GB HBM3", GPU_CHIPS["h100"][0], 67e12, f"{_H100_SHEET}, H100 SXM: FP32 67 TFLOP/s"),
        DevicePeak(
            "NVIDIA H100 PCIe", 756.5e12, 51e12, f"{_H100_SHEET}, H100 PCIe: BF16 1,513 TFLOP/s with sparsity, FP32 51"
        ),
        DevicePeak(
            "NVIDIA H100 NVL", 835.5e12, 60e12, f"{_H100_SHEET}, H100 NVL: BF16 1,671 TFLOP/s with sparsity, FP32 60"
        ),
        _chip_peak("NVIDIA H200", GPU_CHIPS["h200"][0], 67e12, f"{_H200_SHEET}, H200 SXM: FP32 67 TFLOP/s"),
        DevicePeak(
            "NVIDIA H200 NVL", 835.5e12, 60e12, f"{_H200_SHEET}, H200 NVL: BF16 1,671 TFLOP/s with sparsity, FP32 60"
        ),
        _chip_peak("NVIDIA A100-SXM4-80GB", GPU_CHIPS["a100"][0], 19.5e12, f"{_A100_SHEET}: FP32 19.5 TFLOP/s"),
        DevicePeak("NVIDIA A100-SXM4-40GB", 312e12, 19.5e12, f"{_A100_SHEET}: BF16 312 TFLOP/s, FP32 19.5"),
        DevicePeak("NVIDIA A100 80GB PCIe", 312e12, 19.5e12, f"{_A100_SHEET}: BF16 312 TFLOP/s, FP32 19.5"),
        DevicePeak("NVIDIA A100-PCIE-40GB", 312e12, 19.5e12, f"{_A100_SHEET}: BF16 312 TFLOP/s, FP32 19.5"),
        _chip_peak("TPU v4", TPU_CHIPS["v4"], None),
        _chip_peak("TPU v5 lite", TPU_CHIPS["v5e"], None),
        _chip_peak("TPU v5", TPU_CHIPS["v5p"], None),
        _chip_peak("TPU v6 lite", TPU_CHIPS["v6e"], None),
    )
}


def device_peak(kind: str) -> DevicePeak | None:
    """DEVICE_PEAKS' entry of a jax device kind, None when the kind is not listed."""
    return DEVICE_PEAKS.get(kind)


# The HBM bandwidth a memory-bound program's roofline divides by (the sampler's decode, cisjax.bench.gpu_sampler), by
# jax's device kind: the chip tables' data-sheet figures; a kind not listed has no roofline (never a guess).
DEVICE_BANDWIDTH_CHIPS = {
    "NVIDIA H100 80GB HBM3": GPU_CHIPS["h100"][0],
    "NVIDIA H200": GPU_CHIPS["h200"][0],
    "NVIDIA A100-SXM4-80GB": GPU_CHIPS["a100"][0],
    "TPU v4": TPU_CHIPS["v4"],
    "TPU v5 lite": TPU_CHIPS["v5e"],
    "TPU v5": TPU_CHIPS["v5p"],
    "TPU v6 lite": TPU_CHIPS["v6e"],
}


def device_bandwidth(kind: str) -> tuple[float, str] | None:
    """(HBM bytes/s, its source) of a jax device kind, None when the kind is not listed."""
    chip = DEVICE_BANDWIDTH_CHIPS.get(kind)
    return None if chip is None else (chip.hbm_bandwidth, chip.source)


# Slice shapes Google offers, by chip count (the v5p/v5e/v6e pages' topology tables).
SHAPES_3D = {
    4: "2x2x1",
    8: "2x2x2",
    16: "2x2x4",
    32: "2x4x4",
    64: "4x4x4",
    128: "4x4x8",
    256: "4x8x8",
    512: "8x8x8",
    1024: "8x8x16",
    2048: "8x16x16",
    4096: "16x16x16",
}
SHAPES_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}


@dataclasses.dataclass(frozen=True)
class Target:
    """A set of chips to compile for: `name` as typed, the chip, how many, and the slice (or GPU) topology."""

    name: str
    chip: Chip
    chips: int
    topology: str  # TPU: "2x2x2"; GPU: "<slices>x<hosts>x<gpus per host>"

    @property
    def platform(self) -> str:
        return self.chip.platform

    @property
    def chips_per_host(self) -> int:
        """Chips one host (one process) drives: a GPU host's 8 (or fewer), a TPU VM's 4 (v4, v5p) or 8 (v5e, v6e)."""
        if self.platform != "tpu":
            return min(self.chips, 8)
        if self.chip.torus_dims == 2:
            return min(self.chips, 8)
        return min(self.chips, 4)

    def describe(self) -> dict:
        c = self.chip
        return dict(
            name=self.name,
            platform=c.platform,
            chip=c.name,
            chips=self.chips,
            topology=self.topology,
            hbm_gib_per_chip=c.hbm_bytes / GIB,
            usable_gib_per_chip=c.usable_bytes / GIB,
            peak_tflops_per_chip=c.peak_flops / 1e12,
            hbm_gb_per_s=c.hbm_bandwidth / 1e9,
            source=c.source,
        )

    def devices(self) -> list:
        """The target's devices, compile-only (no hardware needed): JAX's deviceless topology API."""
        if self.platform == "tpu":
            enable_libtpu()
            bounds = (2, 2, 1) if self.chip.torus_dims == 3 or self.chips >= 4 else (1, 1, 1)
            if self.chip.torus_dims == 2 and self.chips >= 8:
                bounds = (2, 4, 1)  # v5e / v6e hosts hold 8 chips
            topo = topologies.get_topology_desc(
                platform="tpu",
                topology_name=f"{self.chip.name}:{self.topology}",
                # v4 counts each chip's two TensorCores as one JAX device only in megacore mode (as on a v4 VM)
                chip_config_name="megacore" if self.chip.name == "v4" else "default",
                chips_per_host_bounds=bounds,
                num_slices=1,
            )
        else:
            enable_cuda_plugin()
            topo = topologies.get_topology_desc(
                platform="cuda",
                topology=self.topology,
                target_config=gpu_target_config(GPU_CHIPS[self.chip.name][1], self.chip),
            )
        devices = list(topo.devices)
        if len(devices) != self.chips:
            raise RuntimeError(
                f"{self.name}: the compiler's topology has {len(devices)} devices, expected {self.chips}"
            )
        return devices


NAMES_HELP = (
    "TPU: v4-N, v5p-N (N = TensorCores, 2 per chip), v5e-N, v6e-N (N = chips), or GEN:AxBxC "
    "(e.g. v5p:2x2x2); GPU: h100xN, h200xN, a100xN (N GPUs, 8 per host)"
)


def target(name: str) -> Target:
    """Parse a target name: v5p-16, v5p:2x2x2, v6e-64, v5litepod-16, h100x8, ..."""
    text = name.strip().lower()
    if m := re.fullmatch(r"(v4|v5p|v5e|v5litepod|v6e)-(\d+)", text):
        chip = TPU_CHIPS[TPU_ALIASES.get(m[1], m[1])]
        cores = int(m[2])
        if cores % chip.cores_per_chip:
            raise errors.UserError(
                f"{name}: {chip.name} slices are named by TensorCores ({chip.cores_per_chip} per chip)"
            )
        chips = cores // chip.cores_per_chip
        shapes = SHAPES_3D if chip.torus_dims == 3 else SHAPES_2D
        if chips not in shapes:
            raise errors.UserError(
                f"{name}: no {chip.name} slice of {chips} chips; sizes: "
                f"{', '.join(f'{chip.name}-{n * chip.cores_per_chip}' for n in shapes)} (or give the shape, {chip.name}:AxBxC)"
            )
        return Target(name, chip, chips, shapes[chips])
    if m := re.fullmatch(r"(v4|v5p|v5e|v5litepod|v6e):(\d+(?:x\d+)+)", text):
        chip = TPU_CHIPS[TPU_ALIASES.get(m[1], m[1])]
        dims = [int(d) for d in m[2].split("x")]
        if len(dims) != chip.torus_dims or min(dims) < 1:
            raise errors.UserError(f"{name}: a {chip.name} topology has {chip.torus_dims} positive dimensions")
        return Target(name, chip, math.prod(dims), m[2])
    if m := re.fullmatch(r"(h100|h200|a100)x(\d+)", text):
        chip = GPU_CHIPS[m[1]][0]
        n = int(m[2])
        if n < 1 or (n > 8 and n % 8):
            raise errors.UserError(f"{name}: 1-8 GPUs on one host, or a multiple of 8 over hosts of 8")
        return Target(name, chip, n, f"1x1x{n}" if n <= 8 else f"1x{n // 8}x8")
    raise errors.UserError(f"unknown target {name!r}; {NAMES_HELP}")


# ----------------------------------------------------------------------------- GPU: XLA's target description


def gpu_target_config(spec: GpuSpec, chip: Chip) -> str:
    """A GpuTargetConfigProto (text format) for a device the compiler cannot query. The limits not listed in GpuSpec
    are the same for every CUDA compute capability since 7.0 (1024 threads per block, 2048 per SM, 64K registers)."""
    major, minor = spec.compute_capability
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {spec.shared_per_sm}
  shared_memory_per_block_optin: {spec.shared_per_block_optin}
  threads_per_core_limit: 2048
  core_count: {spec.sm_count}
  fpus_per_core: {spec.fp32_cores_per_sm}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(chip.hbm_bandwidth)}
  l2_cache_size: {spec.l2_bytes}
  clock_rate_ghz: {spec.clock_ghz}
  device_memory_size: {int(chip.hbm_bytes)}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 patch: 0 }}
device_description_str: "{spec.description}"
"""


# ----------------------------------------------------------------------------- the compilers, off the import path
# `make setup` installs libtpu (the TPU compiler) and XLA's CUDA plugin into folders of the environment that are not
# on the import path: installed normally, JAX would start them in every process, and on a machine without their
# hardware print their start-up errors (libtpu: "unexpected worker hostname") or probes. Only a plan adds them, just
# before it asks for a target's devices. A TPU VM installs libtpu normally (pip install "jax[tpu]"): JAX finds its TPU,
# and the plan uses that libtpu.

LIBTPU_ENV = "CISJAX_LIBTPU_DIR"
CUDA_PLUGIN_ENV = "CISJAX_CUDA_PLUGIN_DIR"


def libtpu_dir() -> Path | None:
    """Where libtpu lies when it is not installed in the environment itself: $CISJAX_LIBTPU_DIR, else
    <environment>/libtpu (where `make setup` puts it)."""
    path = os.environ.get(LIBTPU_ENV) or os.path.join(sys.prefix, "libtpu")
    return Path(path) if Path(path, "libtpu", "libtpu.so").is_file() else None


def enable_libtpu() -> None:
    """Make libtpu importable, where JAX looks for the TPU compiler when a TPU topology is first asked for."""
    if importlib.util.find_spec("libtpu") is not None or os.environ.get("TPU_LIBRARY_PATH"):
        return
    path = libtpu_dir()
    if path is None:
        raise RuntimeError(
            "TPU targets need libtpu's compiler: pip install --no-deps --target .venv/libtpu -c constraints.txt libtpu "
            f'(`make setup` does), or set ${LIBTPU_ENV}; on a TPU VM, pip install -c constraints.txt "jax[tpu]"'
        )
    if str(path) not in sys.path:
        sys.path.append(str(path))


def cuda_plugin_dir() -> Path | None:
    """Where the CUDA PJRT plugin lies when it is not installed in the environment itself: $CISJAX_CUDA_PLUGIN_DIR,
    else <environment>/cuda-plugin (where `make setup` puts it)."""
    path = os.environ.get(CUDA_PLUGIN_ENV) or os.path.join(sys.prefix, "cuda-plugin")
    return Path(path) if Path(path, "jax_plugins").is_dir() else None


def enable_cuda_plugin() -> None:
    """Make the CUDA plugin discoverable by JAX, which looks for plugins when it starts its backends."""
    if (
        importlib.util.find_spec("jax_cuda12_plugin") is not None
        or importlib.util.find_spec("jax_cuda13_plugin") is not None
    ):
        return
    path = cuda_plugin_dir()
    if path is None:
        raise RuntimeError(
            "GPU targets need the CUDA PJRT plugin, which compiles without a GPU: "
            "pip install --no-deps --target .venv/cuda-plugin jax-cuda12-plugin==0.10.2 jax-cuda12-pjrt==0.10.2 "
            f"(`make setup` does), or set ${CUDA_PLUGIN_ENV}"
        )
    if xla_bridge._backends:  # plugins are discovered once, when the first backend starts
        if "cuda" not in xla_bridge._backend_factories:
            raise RuntimeError(
                "GPU targets: JAX started its backends before the CUDA plugin was on the path; "
                "run `cisjax plan` for a GPU target in a fresh process"
            )
        return
    if str(path) not in sys.path:
        sys.path.append(str(path))
