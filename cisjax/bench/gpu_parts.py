"""The GPU check's measured parts, each run in a process of its own: the environment, the MoE layer table, the train
step of the full-width cut per MoE impl and token shape, and the same step in transformers/torch."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import os
import platform
import statistics
import time
import traceback

import flax.nnx as nnx
import jax

from cisjax import sharding
from cisjax.bench import gpu_profile, harness, mfu, synthetic, tiny_model, torch_step
from cisjax.bench import moe as bench_moe
from cisjax.models import attention, hf_io, moe
from cisjax.plan import buffers
from cisjax.plan import flops as flops_lib
from cisjax.records import TrainBatch

# Qwen1.5-MoE-A2.7B's layers at full width (hidden 2048, 60 experts of 1408, top-4, a 5632-wide shared expert, vocab
# 151,936), 4 of its 24 (2.9B parameters, 0.97B active); small: a toy of the same family for a CPU run.
MODEL = {
    "full": tiny_model.Sizes(2048, 4, 16, 16, 60, 4, 1408, 5632, 151936),
    "small": tiny_model.Sizes(64, 1, 4, 2, 8, 2, 32, 64, 512),
}
# The train step's token shapes, rows x length: 8,192 tokens as 4 x 2,048; 16,384 as 8 x 2,048 and as one row.
STEP_TOKENS = {"full": ((4, 2048), (8, 2048), (1, 16384)), "small": ((2, 32), (1, 64))}
# The MoE layer table: the paper models' layer shapes (experts E, top-k, expert width F) at hidden D, N tokens, bf16.
MOE_LAYER = {
    "full": dict(
        tokens=8192,
        hidden=2048,
        repeats=5,
        shapes={"qwen15_moe": (60, 4, 1408), "deepseek_v2_lite": (64, 6, 1408), "qwen3_30b_a3b": (128, 8, 768)},
    ),
    "small": dict(
        tokens=128,
        hidden=64,
        repeats=2,
        shapes={"qwen15_moe": (6, 2, 32), "deepseek_v2_lite": (8, 3, 32), "qwen3_30b_a3b": (8, 4, 16)},
    ),
}
# The MoE layer table's token counts: 8,192 and 16,384 (small: the toy's one).
LAYER_TOKENS = {"full": (8192, 16384), "small": (MOE_LAYER["small"]["tokens"],)}
TIMED_STEPS = {"full": 5, "small": 2}  # timed calls after the first (compiling) one


def failure(err: BaseException) -> dict:
    """An exception as a result: out of memory (XLA's RESOURCE_EXHAUSTED, torch's OutOfMemoryError) flagged as such."""
    text = f"{type(err).__name__}: {err}"
    oom = "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower() or "OutOfMemoryError" in text
    return dict(status="oom" if oom else "error", error=text[:2000], traceback=traceback.format_exc()[-2000:])


def versions() -> dict:
    """Python and the installed versions of what the check uses (read from package metadata: nothing imported)."""
    out = {"python": platform.python_version()}
    for name in ("jax", "jaxlib", "flax", "optax", "numpy", "torch", "transformers", "triton", "ml-collections"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    plugins = [
        d.metadata["Name"] for d in importlib.metadata.distributions() if "jax-cuda" in (d.metadata["Name"] or "")
    ]
    out["jax_plugins"] = sorted(set(plugins))
    return out


def env() -> dict:
    """JAX's view of the machine: backend, device kind, compute capability, memory limit, and what "auto" picks."""
    dev = jax.devices()[0]
    stats = dev.memory_stats() or {}
    backend = jax.default_backend()
    return dict(
        backend=backend,
        devices=len(jax.devices()),
        device_kind=dev.device_kind,
        compute_capability=getattr(dev, "compute_capability", None),
        memory_limit_gib=stats["bytes_limit"] / 2**30 if "bytes_limit" in stats else None,
        mem_fraction=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
        moe_impls=list(moe.IMPLS),
        moe_default=moe.default_impl(backend),
        attention_impls=list(attention.IMPLS),
        attention_default_bf16=attention.default_impl(backend, "bfloat16"),
    )


def memory() -> dict:
    """This process's device memory so far (peak, limit) in GiB; the CPU backend keeps none."""
    stats = jax.devices()[0].memory_stats()
    if not stats:
        return dict(peak_gib=None, memory_note=f"{jax.default_backend()}: no device memory statistics")
    return dict(peak_gib=stats.get("peak_bytes_in_use", 0) / 2**30, limit_gib=stats.get("bytes_limit", 0) / 2**30)


def _bytes_in_use() -> int | None:
    stats = jax.devices()[0].memory_stats()
    return stats.get("bytes_in_use") if stats else None


def compiled_memory(compiled) -> dict:
    """A compiled program's buffer assignment in GiB, as `cisjax plan` reports it (cisjax.plan.buffers, a module
    free of the trainer's imports: cisjax.plan.programs reaches grpc, which a GPU machine's carried wheels lack)."""
    return {k: v / 2**30 for k, v in buffers.memory_of(compiled).items()}


# ----------------------------------------------------------------------------- the MoE layer table


def moe_layer(size: str, units: list[list], deadline: float, save) -> dict:
    """`cisjax bench moe`'s measurement (forward + backward, routing inside, against a dense SwiGLU MLP of equal
    active FLOPs) per unit [shape, impl, tokens], one impl per call (one that runs out of memory leaves the others):
    its ms, ratio to the dense MLP, TFLOP/s and MFU, under shapes["<shape>@<tokens>"]. A unit that would start past
    `deadline` is skipped, saying so."""
    spec = MOE_LAYER[size]
    out = dict(hidden=spec["hidden"], dtype="bfloat16", shapes={})
    last_s = 0.0
    for name, impl, tokens in units:
        e, k, f = spec["shapes"][name]
        rows = out["shapes"].setdefault(f"{name}@{tokens}", dict(shape=name, E=e, k=k, F=f, tokens=tokens, impls={}))
        if time.time() + last_s > deadline:
            rows["impls"][impl] = dict(status="skipped", reason=f"time box (a unit took ~{last_s:.0f} s)")
            continue
        t0 = time.time()
        try:
            r = bench_moe.bench_shape(
                e, k, f, n=tokens, d=spec["hidden"], impls=[impl], forced={impl}, tile=None,
                dtype_name="bfloat16", repeats=spec["repeats"], slow_repeats=2, seed=0,
            )  # fmt: skip
            by = {row["candidate"]: row for row in r["rows"]}
            row = by[f"moe_{impl}"]
            if "skipped" in row:  # the platform refuses it
                rows["impls"][impl] = dict(status="skipped", reason=row["skipped"])
            else:
                rows["impls"][impl] = dict(status="ok", moe=row, dense_mlp=by["dense_mlp"])
            out.update({key: r[key] for key in ("device_kind", "peak_tflops", "mfu_omitted") if key in r})
        except Exception as err:  # noqa: BLE001  (out of memory or a failing kernel: recorded, the others go on)
            rows["impls"][impl] = failure(err)
        rows["impls"][impl]["seconds"] = last_s = time.time() - t0
        save(out)
    return out


# ----------------------------------------------------------------------------- the train step


def _base_config(precision: str, moe_impl: str):
    """configs/base.py with the check's settings: `precision`, `moe_impl`, CIS."""
    try:
        from cisjax import config as config_lib  # lazy: ml_collections (carried to GPU machines: docs/gpu.md)
    except ModuleNotFoundError as err:
        raise RuntimeError(
            f"configs/base.py needs ml_collections ({err}): carry its wheel (docs/gpu.md; launchers/gpu_check.sh WHEELS)"
        ) from err
    cfg = config_lib.load(None)
    cfg.train.precision, cfg.model.moe_impl, cfg.correction.method = precision, moe_impl, "cis"
    return cfg


def model_of(size: str, seq: int, runtime_kwargs: dict):
    """(HF config dict, the family's config) of MODEL[size] for sequences of `seq` tokens."""
    hf = tiny_model.hf_config(argparse.Namespace(**dataclasses.asdict(MODEL[size])), max_positions=max(seq, 128))
    return hf, hf_io.model_config(hf, **runtime_kwargs)


def work(hf: dict, mcfg, rows: int, seq: int) -> dict:
    """The step's analytic FLOPs (cisjax.plan.flops: forward and backward of one micro-batch) and parameter counts,
    from the model's shapes alone (nothing allocated)."""
    model = nnx.merge(*hf_io.abstract_model(hf, mcfg))
    fwd = flops_lib.forward_flops(model, rows, seq)
    return dict(
        train_flops=sum(flops_lib.train_flops(fwd, 1).values()),
        params=flops_lib.total_params(model),
        active_params=flops_lib.active_params(model),
    )


# the train step's memory options, measured against the default state as "IMPL+OPTION" (issue 44): config overrides
STATE_OPTIONS = {
    "bf16moments": ("optimizer_state_dtype", "bfloat16"),
    "offload": ("offload_optimizer", True),
    "bf16sum": ("grad_sum_dtype", "bfloat16"),
}


class _Cut:
    """One impl's model and optimizer state, built once per process (random weights on the device) and trained on
    by every token shape after it: the step's program is compiled per shape, the weights are not rebuilt. `impl` may
    carry STATE_OPTIONS after a "+" (mgpu+offload: the moments in host memory)."""

    def __init__(self, size: str, impl: str, max_seq: int):
        # a run's spec reaches the rollout client's grpc, which the launcher carries to a GPU machine as a wheel
        from cisjax.train import build, validate  # lazy: grpc

        moe_impl, *options = impl.split("+")
        cfg = _base_config("bf16", moe_impl)
        for option in options:
            field, value = STATE_OPTIONS[option]
            cfg.train[field] = value
        train_spec = validate.check(cfg, inputs=False)
        self.spec = train_spec.step
        self.hf, self.mcfg = model_of(size, max_seq, self.spec.runtime.model_kwargs())
        t0 = time.perf_counter()
        # the run the loop builds (train.build), on random weights initialised on the mesh
        run = build.build_run(train_spec, params="random", hf=self.hf)
        self.mesh, self.rules, self.state, self.step = run.mesh, run.rules, run.state, run.train_step
        self.init_s = time.perf_counter() - t0

    def batch(self, size: str, rows: int, seq: int):
        mb = synthetic.train_batch(1, rows, seq, MODEL[size].vocab, logprobs=True)
        return sharding.place(mb, self.mesh, self.rules, sharding.BATCH_AXES)

    def compile(self, batch):
        """The step compiled ahead of time for this batch's shapes (the program the first call would compile),
        whose buffer assignment on this device can then be read."""
        return self.step.jitted.lower(self.state, batch).compile()

    def call(self, batch, compiled):
        self.state, met, _ = compiled(self.state, batch)
        return jax.block_until_ready(met)


def train_step(cut: _Cut, size: str, impl: str, rows: int, seq: int, trace_dir: str | None = None) -> dict:
    """The jitted GRPO step with CIS (bf16 compute, fp32 master weights, AdamW) of the cut's weights, `rows` x `seq`
    tokens: first call (compile), median step, tokens/s, analytic FLOPs and MFU, peak device memory of the process so
    far, and its parts (memory_split); with `trace_dir`, a profiler trace of one more step (gpu_profile.capture)."""
    batch = cut.batch(size, rows, seq)
    live = _bytes_in_use()  # the state and the batch, before this shape's compile
    t0 = time.perf_counter()
    compiled = cut.compile(batch)
    compile_s = time.perf_counter() - t0
    after_compile = memory()
    t0 = time.perf_counter()
    met = cut.call(batch, compiled)
    first_s = time.perf_counter() - t0
    times = []
    for _ in range(TIMED_STEPS[size]):
        t0 = time.perf_counter()
        met = cut.call(batch, compiled)
        times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    ref = mfu.peak(mfu.device_kind(), "bf16")
    counts = work(cut.hf, cut.mcfg, rows, seq)
    out = dict(
        status="ok",
        impl=impl,
        resolved_impl=moe.default_impl(jax.default_backend()) if impl.split("+")[0] == "auto" else impl,
        rows=rows,
        seq=seq,
        tokens=rows * seq,
        **counts,
        init_s=cut.init_s,
        compile_s=compile_s,
        first_call_s=first_s,
        step_s=times,
        median_s=median,
        tokens_per_s=rows * seq / median,
        **mfu.utilization(counts["train_flops"], median, ref),
        **ref,
        proximal=cut.spec.proximal,
        loss=float(met["loss"]),
        **memory(),
        memory_scope="the process's peak so far (its token shapes run smallest first)",
        # what `cisjax plan` compares with: the live arrays before the compile (the state), the process's peak after
        # the compile (its autotuning), the compiler's buffer assignment on this device, then the peak of the steps
        memory_split=dict(
            live_before_gib=None if live is None else live / 2**30,
            peak_after_compile_gib=after_compile.get("peak_gib"),
            compiled_gib=compiled_memory(compiled),
        ),
    )
    if trace_dir:
        out["trace"] = gpu_profile.capture(lambda: cut.call(batch, compiled), trace_dir, "train_step")
    return out


def train_steps(size: str, combos: list[list], deadline: float, save, trace_dir: str | None = None) -> dict:
    """train_step per (impl, rows, seq), in order, in this one process: each impl's weights built once (and again
    after a failure, which may have consumed the donated state), each combo recorded as it ends (out of memory as
    such); one that would start past `deadline` is skipped, saying so. The first combo that runs is traced."""
    cuts: dict[str, _Cut] = {}
    longest = {}
    for impl, _, seq in combos:
        longest[impl] = max(longest.get(impl, 0), seq)
    traced = []

    def one(impl, rows, seq):
        try:
            if impl not in cuts:
                cuts.clear()  # one impl's weights on the device at a time
                cuts[impl] = _Cut(size, impl, longest[impl])
            r = train_step(cuts[impl], size, impl, rows, seq, trace_dir if trace_dir and not traced else None)
            traced.append(bool(trace_dir))
            return r
        except Exception as err:  # noqa: BLE001  (out of memory included: recorded, the next goes on)
            cuts.clear()
            return dict(failure(err), impl=impl, rows=rows, seq=seq, **memory())

    return _time_boxed({}, combos, deadline, save, one)


def _time_boxed(out: dict, combos: list[list], deadline: float, save, run) -> dict:
    """out[f"{a}@{rows}x{seq}"] = run(a, rows, seq) for each combo in order, with its seconds, saved as each ends; one
    that would start past `deadline` (now + the last run's time) is skipped, saying so."""
    last_s = 0.0
    for a, rows, seq in combos:
        key = f"{a}@{rows}x{seq}"
        if time.time() + last_s > deadline:
            out[key] = dict(status="skipped", reason=f"time box (a step run took ~{last_s:.0f} s)")
            continue
        t0 = time.time()
        out[key] = run(a, rows, seq)
        out[key]["seconds"] = last_s = time.time() - t0
        save(out)
    return out


# ----------------------------------------------------------------------------- the torch reference


def torch_steps(size: str, combos: list[list], deadline: float, save) -> dict:
    """The same model and objective in transformers/torch (fp32 weights, bf16 autocast, sdpa attention, global-norm
    clipping and AdamW, fused on CUDA), per (experts implementation, rows, seq); in a process without JAX on the
    device (the two would share its memory)."""
    try:
        from cisjax.train import spec as spec_lib  # lazy: grpc (the rollout client), as in _Cut

        spec = spec_lib.step_of(_base_config("bf16", "auto"))
    except RuntimeError as err:  # no ml_collections: said once, for every combo
        return {f"{e}@{r}x{t}": dict(failure(err), rows=r, seq=t) for e, r, t in combos}
    dev = torch_step.device("cuda")  # "cpu" when torch sees no GPU
    kind = torch_step.device_kind(dev)
    ref = mfu.peak(kind, "bf16")

    def one(experts, rows, seq):
        model = run = None
        try:
            hf, mcfg = model_of(size, seq, spec.runtime.model_kwargs())
            counts = work(hf, mcfg, rows, seq)
            model = torch_step.build(hf, experts=experts, device=dev)
            mb = synthetic.train_batch(1, rows, seq, MODEL[size].vocab, logprobs=True)
            mb = TrainBatch(*(None if a is None else a[0] for a in mb))
            run = torch_step.TorchFwdBwd(model, mb, spec, precision="bf16", optimizer=True)
            info = run.info([harness.timed(run)[0] for _ in range(TIMED_STEPS[size])])
            result = dict(
                status="ok",
                rows=rows,
                seq=seq,
                tokens=rows * seq,
                tokens_per_s=rows * seq / info["median_s"],
                **counts,
                **mfu.utilization(counts["train_flops"], info["median_s"], ref),
                **info,
            )
        except Exception as err:  # noqa: BLE001  (out of memory included: recorded, the next goes on)
            result = dict(failure(err), rows=rows, seq=seq)
        del model, run
        torch_step.release(dev)
        return result

    return _time_boxed(dict(device=dev, device_kind=kind, **ref), combos, deadline, save, one)
