"""The GPU check's cost model: each part's seconds on an H200 estimated before it starts, from the 2026-11-28 check."""

from __future__ import annotations

# Calibration: the two checks of 2026-11-28 on one H200 (jax 0.11.2; docs/results.md, tests/fixtures/gpu_2026-11-28).
# "measured" figures are read off those JSONs; "assumed" ones are what no check has measured yet: each is replaced by
# the measured cost (printed beside the estimate in every check's JSON) once a check has run the part.
PROCESS_S = 6.0  # a part's process up to its first unit: Python, imports, JAX's GPU client (measured: 4.5-6.5 s)
TORCH_PROCESS_S = 8.0  # the same with torch imported and its CUDA context (measured: 7.9 s)
SETUP_S = 10.7  # a train-step process's first unit before it allocates: configs, transformers' import, the model config
INIT_S = 10.4  # the 2.9B-parameter cut's random weights built on the device (measured: 9.0-10.4 s)
TIMED_STEPS = 5  # gpu_parts.TIMED_STEPS["full"]: timed calls after the compiling one
# A train step's compile and first call, and its median step, per (impl, rows, seq). measured: mgpu 4 x 2048 (25.8 s,
# 0.132 s), 8 x 2048 (27.3 s, 0.218 s), tiled 4 x 2048 (19.6 s, 0.342 s). assumed: 1 x 16384 one and a half times the
# 2,048-token compile (the killed part ran 50 s), the other impls mgpu's compile with their layer table's slowdown.
STEP_COMPILE_S = {("mgpu", 4, 2048): 25.8, ("mgpu", 8, 2048): 27.3, ("mgpu", 1, 16384): 39.0, ("tiled", 4, 2048): 19.6}
STEP_S = {("mgpu", 4, 2048): 0.132, ("mgpu", 8, 2048): 0.218, ("mgpu", 1, 16384): 0.40, ("tiled", 4, 2048): 0.342}
STEP_TOKENS_PER_S = {"mgpu": 62_000.0, "tiled": 24_000.0, "triton": 30_000.0, "ragged": 2_000.0, "dense": 6_000.0}
DEFAULT_COMPILE_S = 27.0
PROFILE_S = 4.0  # one traced step written to disk (assumed)
# One exactness case (impl, dtype), compile and float64 reference: measured mgpu fp32 7.6 s (the process's first,
# with JAX's warm-up), bf16 12.2 s, tiled fp32 19.0 s; assumed: tiled bf16 as its fp32, every other case their mean.
CASE_S = {("mgpu", "float32"): 7.6, ("mgpu", "bfloat16"): 12.2, ("tiled", "float32"): 19.0, ("tiled", "bfloat16"): 19.0}
DEFAULT_CASE_S = 12.9
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
# The loop (assumed: it has never run on a GPU): the demo's warm-up (800 tiny-model steps, its held-out sampling), 64
# colocated steps (the first compiling the sampler, step, canary and evaluation programs), gpu_local.sh's server start
# and 4 steps with the transformers engine on the GPU.
LOOP_S = {"prepare": 40.0, "colocated": 110.0, "gpu_local": 80.0}
# The sampler section, measured on an H200 on 2026-11-28 (the part's first run; docs/results.md): the JAX part 155 s
# (the cut's weights 25 s, batch 64 25 s, batch 256 32 s, the decode trace 6 s, the bf16 agreement 9 s, the fp32
# one 57 s: its sampler and trainer programs compile in fp32), transformers' generate 81 s (batch 64 31 s, batch 256
# 50 s).
SAMPLER_S = {"jax": 155.0, "torch": 81.0}
ENV_S = 5.3  # the environment probe (measured: 4.5-5.3 s)
# small: every section at toy sizes on a CPU (the suite's run of the launcher: seconds each).
SMALL_S = {"env": 5.0, "loop": 150.0, "sampler": 35.0, "tune": 10.0, "train_step": 20.0, "exactness": 25.0}
SMALL_S.update({"moe_layer": 10.0, "torch_step": 10.0})


def train_unit_s(impl: str, rows: int, seq: int) -> float:
    """One train-step combo in a process that has its weights: compile and first call, then the timed steps."""
    key = (impl, rows, seq)
    compile_s = STEP_COMPILE_S.get(key, DEFAULT_COMPILE_S * (1.5 if seq > 8192 else 1.0))
    # an impl with a memory option of the optimizer state (mgpu+offload) computes as its impl does
    step_s = STEP_S.get(key, rows * seq / STEP_TOKENS_PER_S.get(impl.split("+")[0], 10_000.0))
    return compile_s + TIMED_STEPS * step_s


def case_s(impl: str, dtype: str) -> float:
    """One exactness case."""
    return CASE_S.get((impl, dtype), DEFAULT_CASE_S)


def layer_unit_s(shape: str, impl: str, tokens: int) -> float:
    """One MoE layer unit (shape, impl, tokens)."""
    base = LAYER_S.get((shape, impl, 8192), DEFAULT_LAYER_S)
    doublings = max(tokens // 8192, 1).bit_length() - 1
    return base + LAYER_TOKENS_EXTRA_S * doublings


def part_s(section: str, plan: dict) -> float:
    """A part's estimated seconds on an H200 (plan: gpu_check.plans's unit; small: SMALL_S)."""
    if plan.get("size") == "small":
        return SMALL_S[section]
    if section == "env":
        return ENV_S
    if section == "loop":
        return sum(LOOP_S.values())
    if section == "sampler":
        return (TORCH_PROCESS_S if plan["which"] == "torch" else PROCESS_S) + SAMPLER_S[plan["which"]]
    if section == "tune":
        return TUNE_S
    if section == "train_step":
        units = [train_unit_s(*c) for c in plan["combos"]]
        inits = INIT_S * len({c[0] for c in plan["combos"]})  # each impl (and option) builds its own weights
        return PROCESS_S + SETUP_S + inits + sum(units) + (PROFILE_S if plan.get("trace") else 0.0)
    if section == "exactness":
        return PROCESS_S + sum(case_s(impl, dtype) for _, impl, dtype in plan["cases"])
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
