"""The environment the vLLM engine runs with, in one place: defaults applied (when unset) before vLLM is imported."""

from __future__ import annotations

import os
from importlib import metadata

# An in-process engine (no engine-core subprocess), 1 GiB of CPU KV cache (unset, vLLM on CPU takes ~11 GiB), no
# torch.compile (3-15 s per start on CPU), the V1 model runner (the routing capture splits each forward's rows along
# its token layout, cisjax.engines.vllm.routing_capture; on GPUs vLLM would otherwise pick its V2 runner; CPU has only V1).
DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TORCH_COMPILE_DISABLE": "1",
    "VLLM_USE_V2_MODEL_RUNNER": "0",
}


def cpu_build() -> bool:
    """Whether the installed engine is vLLM's CPU build (the `vllm-cpu` distribution)."""
    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


def defaults() -> dict[str, str]:
    """DEFAULTS, plus VLLM_TARGET_DEVICE=cpu for the CPU build: vLLM takes an importable libtpu for TPU hardware and
    then refuses to pick between TPU and CPU, and a TPU VM (or an environment with the .[tpu] extra) has libtpu."""
    env = dict(DEFAULTS)
    if cpu_build():
        env["VLLM_TARGET_DEVICE"] = "cpu"
    return env


def apply() -> None:
    for key, value in defaults().items():
        os.environ.setdefault(key, value)
