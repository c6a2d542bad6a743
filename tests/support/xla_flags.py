"""The XLA flags of every test process (pytest's and the worker processes tests start): set before jax is imported."""

import importlib.metadata


def _jaxlib_before(major: int, minor: int) -> bool:
    parts = importlib.metadata.version("jaxlib").split(".")
    return (int(parts[0]), int(parts[1])) < (major, minor)


# A cheaper XLA CPU compile: the test models are tiny, so compiling is most of the suite's time (two thirds of it,
# measured: docs/results.md). LLVM without its optimisation passes (-O0 code is correct code; the HLO passes all still
# run), and XLA:CPU's older code generator for fused computations instead of its fusion emitters (about 30% less
# compile time; a sum may come out in another order than with the default, as it may between two XLA versions).
# jaxlib 0.11 removed that generator and aborts on the flag: the GPU kernels' tests also run there (docs/gpu.md).
COMPILE = ("--xla_backend_optimization_level=0",) + (
    ("--xla_cpu_use_fusion_emitters=false",) if _jaxlib_before(0, 11) else ()
)


def flags(devices: int) -> str:
    """XLA_FLAGS for a process with `devices` CPU devices."""
    return " ".join((f"--xla_force_host_platform_device_count={devices}", *COMPILE))
