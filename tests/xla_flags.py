"""The XLA flags of every test process (pytest's and the worker processes tests start): set before jax is imported."""

# A cheaper XLA CPU compile: the test models are tiny, so compiling is most of the suite's time (65% of it,
# measured). LLVM without its optimisation passes (-O0 code is correct code; the HLO passes all still run), and XLA's
# element-wise loop emitter instead of its newer fusion emitters (the same HLO, fused the same way, emitted by the
# older code generator: about 30% less compile time; a sum may differ from the default emitters' in its last bit, as
# it may between two XLA versions).
COMPILE = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def flags(devices: int) -> str:
    """XLA_FLAGS for a process with `devices` CPU devices."""
    return " ".join((f"--xla_force_host_platform_device_count={devices}", *COMPILE))
