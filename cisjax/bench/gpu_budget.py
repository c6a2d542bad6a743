"""The GPU check's cost model: each part's seconds on an H200 estimated before it starts, from the checks run there."""

from __future__ import annotations

# Calibration: the checks of 2026-11-28 and 2026-11-30 on one H200 (jax 0.11.2; docs/results.md,
# tests/fixtures/gpu_check). "measured" figures are read off those JSONs; "assumed" ones are what no check has measured
# yet: each is replaced by the measured cost (printed beside the estimate in every check's JSON) once a check has run
# the part.
PROCESS_S = 6.0  # a part's process up to its first unit: Python, imports, JAX's GPU client (measured: 4.5-6.5 s)
TORCH_PROCESS_S = 8.0  # the same with torch imported and its CUDA context (measured: 7.9 s)
SETUP_S = 10.7  # a train-step process's first unit before it allocates: configs, transformers' import, the model config
INIT_S = 10.4  # the 2.9B-parameter cut's random weights built on the device (measured: 8.7-10.4 s)
# an optimizer-state option's state built from the weights the process has (measured: bf16 moments 0.9 s, bf16 sum
# 0.7 s; offload 24.6 s, its state put in host memory)
OPTION_INIT_S = {"offload": 24.6}
DEFAULT_OPTION_INIT_S = 1.0
TIMED_STEPS = 5  # gpu_parts.TIMED_STEPS["full"]: timed calls after the compiling one
# A train step's compile and first call, and its median step, per (impl, rows, seq). measured: mgpu 4 x 2048 (25.8 s,
# 0.132 s; 24.6 s, 0.136 s on 2026-11-30), 8 x 2048 (27.3 s, 0.218 s; 27.2 s, 0.223 s), 1 x 16384 (22.3 s, 0.315 s:
# 2026-11-30), tiled 4 x 2048 (19.6 s, 0.342 s), the optimizer state's options at 4 x 2048 (2026-11-30). assumed: the
# other impls mgpu's compile with their layer table's slowdown.
STEP_COMPILE_S = {("mgpu", 4, 2048): 25.8, ("mgpu", 8, 2048): 27.3, ("mgpu", 1, 16384): 22.3, ("tiled", 4, 2048): 19.6}
STEP_COMPILE_S.update({("mgpu+bf16moments", 4, 2048): 35.0, ("mgpu+offload", 4, 2048): 24.6})
STEP_COMPILE_S[("mgpu+bf16sum", 4, 2048)] = 25.1
STEP_S = {("mgpu", 4, 2048): 0.132, ("mgpu", 8, 2048): 0.218, ("mgpu", 1, 16384): 0.315, ("tiled", 4, 2048): 0.342}
STEP_S.update(
    {("mgpu+bf16moments", 4, 2048): 0.141, ("mgpu+offload", 4, 2048): 0.914, ("mgpu+bf16sum", 4, 2048): 0.139}
)
STEP_TOKENS_PER_S = {"mgpu": 62_000.0, "tiled": 24_000.0, "triton": 30_000.0, "ragged": 2_000.0, "dense": 6_000.0}
DEFAULT_COMPILE_S = 27.0
# assumed: an impl no check has measured costs what the named one measured (its compile, step and layer)
ASSUMED_AS = {"mgpu_ws": "mgpu"}
PROFILE_S = 4.0  # one traced step written to disk (assumed)
# One exactness case (impl, dtype), compile and float64 reference, in a process alone on the device: measured
# (2026-11-28, one process) mgpu fp32 7.6 s (the process's first, with JAX's warm-up), bf16 12.2 s, tiled fp32 19.0 s;
# the rest measured on 2026-11-30 in four processes at once (CONTENTION) and divided by it; assumed: dense fp32,
# attention einsum and triton fp32 twice their bf16 (as tiled's), any other case the mean.
CASE_S = {("mgpu", "float32"): 7.6, ("mgpu", "bfloat16"): 12.2, ("tiled", "float32"): 19.0, ("tiled", "bfloat16"): 8.4}
CASE_S.update({("dense", "bfloat16"): 5.6, ("dense", "float32"): 11.2, ("ragged", "float32"): 8.8})
CASE_S.update({("triton", "float32"): 4.2, ("triton", "bfloat16"): 4.2, ("ragged", "bfloat16"): 3.8})
CASE_S.update({("einsum", "bfloat16"): 3.6, ("einsum", "float32"): 7.2})
CASE_S.update({("triton_attention", "bfloat16"): 2.0, ("triton_attention", "float32"): 4.0})
DEFAULT_CASE_S = 12.9
# Exactness processes at once slow each other (their compiles share the host, their runs the device): each case in
# a check of four took 2.45-2.7x its time alone (mgpu fp32 20.3 s, bf16 33.3 s, tiled fp32 46.6 s; 2026-11-30)
CONTENTION_PER_EXTRA_WORKER = 0.53
# One MoE layer unit (shape, impl, tokens): the impl's compile and first call, the dense MLP's, five timed calls of
# each and the CPU-side ratio. measured at 8,192 tokens with mgpu: 25.1 s (Qwen1.5), 26.5 s (DeepSeek-V2-Lite),
# 31.2 s (Qwen3); assumed: 16,384 tokens the same plus the timed calls' doubling (2 s), other impls 30 s.
LAYER_S = {
    ("qwen15_moe", "mgpu", 8192): 25.1,
    ("deepseek_v2_lite", "mgpu", 8192): 26.5,
    ("qwen3_30b_a3b", "mgpu", 8192): 31.2,
}
DEFAULT_LAYER_S = 30.0
LAYER_TOKENS_EXTRA_S = 2.0  # per doubling of the tokens past 8,192
# transformers' step per (experts, rows, seq): measured grouped_mm 4 x 2048 11.5 s (the process's first: the model
# built on the GPU), 8 x 2048 4.0 s, eager 4 x 2048 5.1 s.
TORCH_S = {("fastest", 4, 2048): 11.5, ("fastest", 8, 2048): 4.0, ("eager", 4, 2048): 5.1}
DEFAULT_TORCH_S = 8.0
TUNE_S = 150.0  # the block sweep fills its time box: measured 144 s of a 192 s share
# The loop, measured on 2026-11-30 with its stages one after another: the demo's warm-up (800 tiny-model steps, its
# held-out sampling) 67.3 s, 64 colocated steps (the first compiling the sampler, step, canary and evaluation programs)
# 83.1 s, gpu_local.sh's server start and 4 steps with the transformers engine on the GPU 67.3 s. The two runs now go
# at once (gpu_loop.run); assumed: the longest slowed by LOOP_BESIDE by the others beside it.
LOOP_S = {"prepare": 67.3, "colocated": 83.1, "gpu_local": 67.3}
LOOP_EXACT_S = 60.0  # rollout.exact's run beside them (8 steps, eval off): never run on a GPU, assumed
LOOP_BESIDE = 1.2
# The sampler section, measured on 2026-11-30: the JAX part 150.3 s (the cut's weights 17.1 s, batch 64 21.2 s, batch
# 256 29.4 s, the decode trace 9.3 s, the bf16 agreement 8.8 s, the fp32 one 59.9 s: its sampler and trainer programs
# compile in fp32), transformers' generate 98.3 s (its model 5.6 s, batch 64 26.4 s, batch 256 59.4 s: 22.0 s first
# and three calls of 12.4 s). The timed calls now stop at gpu_torch_generate.TIMED_S: batch 256 one call fewer for
# JAX (4.0 s) and two for transformers (24.8 s).
SAMPLER_S = {"jax": 142.0, "torch": 67.0}
ENV_S = 5.3  # the environment probe (measured: 3.6-5.3 s)
# small: every section at toy sizes on a CPU (the suite's run of the launcher: seconds each).
SMALL_S = {"env": 5.0, "loop": 150.0, "sampler": 35.0, "tune": 10.0, "train_step": 20.0, "exactness": 25.0}
SMALL_S.update({"moe_layer": 10.0, "torch_step": 10.0})


def train_unit_s(impl: str, rows: int, seq: int) -> float:
    """One train-step combo in a process that has its weights: compile and first call, then the timed steps."""
    impl = _measured_as(impl, rows, seq)
    key = (impl, rows, seq)
    compile_s = STEP_COMPILE_S.get(key, DEFAULT_COMPILE_S * (1.5 if seq > 8192 else 1.0))
    # an impl with a memory option of the optimizer state (mgpu+offload) computes as its impl does
    step_s = STEP_S.get(key, rows * seq / STEP_TOKENS_PER_S.get(impl.split("+")[0], 10_000.0))
    return compile_s + TIMED_STEPS * step_s


def _measured_as(impl: str, rows: int, seq: int) -> str:
    """impl, or the impl whose measured cost stands for it (ASSUMED_AS) where no step of its own was measured."""
    base, _, option = impl.partition("+")
    if (impl, rows, seq) in STEP_S or base not in ASSUMED_AS:
        return impl
    return "+".join([ASSUMED_AS[base], *([option] if option else [])])


def case_s(impl: str, dtype: str, workers: int = 1, kind: str = "moe") -> float:
    """One exactness case in one of `workers` processes at once."""
    impl = impl if (impl, dtype) in CASE_S else ASSUMED_AS.get(impl, impl)
    key = (f"{impl}_attention" if kind == "attention" and impl == "triton" else impl, dtype)
    return CASE_S.get(key, DEFAULT_CASE_S) * (1.0 + CONTENTION_PER_EXTRA_WORKER * (workers - 1))


def layer_unit_s(shape: str, impl: str, tokens: int) -> float:
    """One MoE layer unit (shape, impl, tokens)."""
    base = LAYER_S.get((shape, impl, 8192)) or LAYER_S.get((shape, ASSUMED_AS.get(impl, impl), 8192), DEFAULT_LAYER_S)
    doublings = max(tokens // 8192, 1).bit_length() - 1
    return base + LAYER_TOKENS_EXTRA_S * doublings


def part_s(section: str, plan: dict) -> float:
    """A part's estimated seconds on an H200 (plan: gpu_check.plans's unit; small: SMALL_S)."""
    if plan.get("size") == "small":
        return SMALL_S[section]
    if section == "env":
        return ENV_S
    if section == "loop":
        return LOOP_S["prepare"] + LOOP_BESIDE * max(LOOP_S["colocated"], LOOP_EXACT_S, LOOP_S["gpu_local"])
    if section == "sampler":
        return (TORCH_PROCESS_S if plan["which"] == "torch" else PROCESS_S) + SAMPLER_S[plan["which"]]
    if section == "tune":
        return TUNE_S
    if section == "train_step":
        units = [train_unit_s(*c) for c in plan["combos"]]
        impls = {c[0].split("+")[0] for c in plan["combos"]}  # each impl builds its weights, each option its state
        options = {c[0].split("+")[1] for c in plan["combos"] if "+" in c[0]}
        inits = INIT_S * len(impls) + sum(OPTION_INIT_S.get(o, DEFAULT_OPTION_INIT_S) for o in options)
        return PROCESS_S + SETUP_S + inits + sum(units) + (PROFILE_S if plan.get("trace") else 0.0)
    if section == "exactness":
        workers = plan.get("workers", 1)
        return PROCESS_S + sum(case_s(impl, dtype, workers, kind) for kind, impl, dtype in plan["cases"])
    if section == "moe_layer":
        return PROCESS_S + sum(layer_unit_s(s, i, t) for s, i, t in plan["units"])
    if section == "torch_step":
        return TORCH_PROCESS_S + sum(TORCH_S.get(tuple(c), DEFAULT_TORCH_S) for c in plan["combos"])
    raise ValueError(f"no cost model for section {section!r}")


def section_s(section: str, parts: list[dict]) -> float:
    """A section's estimated seconds: its parts one after another, except the exactness workers, which run at once."""
    costs = [part_s(section, p) for p in parts]
    if section == "exactness" and parts and parts[0].get("size") == "full":
        return max(costs, default=0.0)
    return sum(costs)
