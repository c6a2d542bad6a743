"""The GPU check's sampler part: the JAX sampler's prefill and decode speed, roofline, logprob agreement, a trace."""

from __future__ import annotations

import statistics
import time

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np

from cisjax import forward, runtime, sharding
from cisjax.bench import gpu_parts, gpu_profile, mfu
from cisjax.bench.gpu_torch_generate import WORKLOAD, batch_key, prompt_ids, timed_calls
from cisjax.engines.jax import costs, programs
from cisjax.engines.jax.sampling import key_data
from cisjax.models import hf_io
from cisjax.plan import flops as flops_lib
from cisjax.plan import hardware

# the fp32 agreement's batch (an fp32 engine and trainer: twice the weights' bytes): prompts, n, new tokens
FP32_BATCH = {"full": (4, 2, 64), "small": (2, 2, 16)}
# A unit's seconds at size full on an H200 (measured 2026-11-28 and 2026-11-30, the larger, jax 0.11.2; init includes
# JAX's start on the device; batch 256 less the timed call TIMED_S leaves out): what the time box expects of it;
# elsewhere (small) the unit before it is the estimate.
FULL_UNIT_S = {"init": 25.0, "64": 25.0, "256": 28.0, "profile": 9.5, "bfloat16": 10.0, "float32": 60.0}
CHUNK = 1024  # the trainer forward's logprob chunk (configs/base.py logprobs.chunk_size)
METHOD = (
    "the Engine's programs (cisjax.engines.jax.programs.split_fns: prefill, then every sample in a decode row of its "
    "own) as two jitted programs per batch on a one-device mesh, each timed alone: the prompts' prefill, then the "
    "rows' entering and the decode loop; no stop "
    "token, so every row decodes new_tokens tokens; sampling at temperature 1 without truncation (RL rollouts)"
)


def _dtype_kwargs(precision: str) -> dict:
    """hf_io.model_config's options of the trainer at `precision` (cisjax.runtime; configs/base.py's defaults)."""
    return runtime.make_runtime(precision).model_kwargs()


def _sampler_kwargs(dtype: str) -> dict:
    """The sampler's model options as colocated mode builds them (cisjax.engines.jax.backend): the trainer's, with the
    weights and compute in `dtype`, no remat."""
    return dict(_dtype_kwargs("bf16"), dtype=dtype, param_dtype=dtype, remat="none")


def sampler_programs(graphdef, mesh, rules, n: int, max_new: int):
    """(prefill, decode), jitted: `(params, tokens_BxP, valid_BxP) -> Prompts` (the prompts' cache of P slots) and
    `(params, Prompts, Rows) -> Decoded` (every sample in a row of its own, to the end: programs.split_fns)."""
    pre_fn, dec_fn = programs.split_fns(graphdef, n=n, max_new=max_new, mesh=mesh, rules=rules)
    # not donated: the unit times the same Prompts again
    return jax.jit(pre_fn), jax.jit(dec_fn)


def rows_of(rows: int, prompt_len: int, new_tokens: int, seed: int = 0) -> programs.Rows:
    """Every row at temperature 1, no top-k / top-p, `new_tokens` to produce, no stop token; a seed per row."""
    full = lambda v, dt: jnp.full((rows,), v, dt)  # noqa: E731
    return programs.Rows(
        prompt_len_B=full(prompt_len, jnp.int32),
        temperature_B=full(1.0, jnp.float32),
        top_k_B=full(0, jnp.int32),
        top_p_B=full(1.0, jnp.float32),
        greedy_B=full(False, jnp.bool_),
        key_data_Bx2=jnp.asarray(np.stack([key_data(seed * 1_000_003 + i) for i in range(rows)])),
        max_new_B=full(new_tokens, jnp.int32),
        stop_ids_BxT=jnp.full((rows, programs.STOP_SLOTS), -1, jnp.int32),
    )


# ----------------------------------------------------------------------------- work and bytes, from the shapes


def prefill_flops(model, prompts: int, prompt_len: int) -> float:
    """The prefill's analytic FLOPs (cisjax.plan.flops' forward) with the head on each prompt's last position only."""
    fwd = flops_lib.forward_flops(model, prompts, prompt_len)
    return sum(v for kind, v in fwd.items() if kind != "head") + 2.0 * prompts * model.cfg.hidden_size * (
        model.cfg.vocab_size
    )


def _bandwidth(kind: str) -> dict:
    bw = hardware.device_bandwidth(kind)
    if bw is None:
        return dict(roofline_omitted=f"no HBM bandwidth for device kind {kind!r} (hardware.DEVICE_BANDWIDTH_CHIPS)")
    return dict(hbm_bytes_per_s=bw[0], hbm_source=bw[1])


# ----------------------------------------------------------------------------- the units


def _timed(fn, deadline: float) -> tuple[float, list, str | None, object]:
    """(first call's seconds, timed calls' seconds, why fewer, the first call's output), each call synchronised."""
    t0 = time.perf_counter()
    first = jax.block_until_ready(fn())
    first_s = time.perf_counter() - t0
    times, note = timed_calls(lambda: jax.block_until_ready(fn()), deadline, first_s)
    return first_s, times, note, first


def _figures(first_s: float, times: list, note: str | None, tokens: int) -> dict:
    median = statistics.median(times) if times else first_s
    out = dict(first_call_s=first_s, times_s=times, timed_calls=len(times), median_s=median, tokens=tokens)
    if note:
        out["note"] = note + ("; the first call's time used" if not times else "")
    return dict(out, tokens_per_s=tokens / median)


def measure_batch(ctx: dict, prompts: int, n: int, deadline: float) -> tuple[dict, dict]:
    """One batch in bf16: prefill and decode timed apart (first call, median of timed calls), prefill MFU and the
    decode's roofline fraction; and what the later units take of it (the programs, inputs, tokens and logprobs)."""
    size, model = ctx["size"], ctx["abstract"]
    p, new = WORKLOAD[size]["prompt_len"], WORKLOAD[size]["new_tokens"]
    rows = prompts * n
    pre_fn, dec_fn = sampler_programs(ctx["graphdef_bf16"], ctx["mesh"], ctx["rules"], n, new)
    params = ctx["params_bf16"]
    tokens = jnp.asarray(prompt_ids(size, prompts, model.cfg.vocab_size))
    valid = jnp.ones(tokens.shape, bool)
    sample_rows = rows_of(rows, p, new)
    first_s, times, note, pre = _timed(lambda: pre_fn(params, tokens, valid), deadline)
    prefill = _figures(first_s, times, note, prompts * p)
    prefill["flops"] = prefill_flops(model, prompts, p)
    prefill.update(mfu.utilization(prefill["flops"], prefill["median_s"], ctx["peak"]))
    first_s, times, note, dec = _timed(lambda: dec_fn(params, pre, sample_rows), deadline)
    decode = _figures(first_s, times, note, rows * new)
    step_s = decode["median_s"] / new
    need = costs.step_of(model, ctx["counts"], rows, p + new)  # bf16 weights
    decode.update(step_s=step_s, bytes_per_step=need)
    if "hbm_bytes_per_s" in ctx["bandwidth"]:
        decode["roofline_step_s"] = need["bytes"] / ctx["bandwidth"]["hbm_bytes_per_s"]
        decode["roofline_fraction"] = costs.roofline_fraction(
            need["bytes"], step_s, ctx["bandwidth"]["hbm_bytes_per_s"]
        )
    else:
        decode.update(
            roofline_step_s=None, roofline_fraction=None, roofline_omitted=ctx["bandwidth"]["roofline_omitted"]
        )
    lengths = np.asarray(dec.lengths_B)
    result = dict(
        status="ok",
        prompts=prompts,
        n=n,
        rows=rows,
        prompt_len=p,
        new_tokens=new,
        full_length=bool((lengths == new).all()),
        prefill=prefill,
        decode=decode,
        generate_tokens_per_s=rows * new / (prefill["median_s"] + decode["median_s"]),
        # the headline figures, flat (gpu_report's table and targets)
        prefill_tokens_per_s=prefill["tokens_per_s"],
        decode_tokens_per_s=decode["tokens_per_s"],
        decode_roofline=decode["roofline_fraction"],
        **({"decode_roofline_omitted": decode["roofline_omitted"]} if "roofline_omitted" in decode else {}),
        **gpu_parts.memory(),
    )
    kept = dict(
        decode=lambda: dec_fn(params, pre, sample_rows),
        seq=np.concatenate([np.repeat(np.asarray(tokens), n, axis=0), np.asarray(dec.tokens_BxN)], axis=1),
        logq=np.asarray(dec.logprobs_BxN),
    )
    return result, kept


def trainer_logprobs(graphdef, mesh, rules, precision: str, round_to: str | None):
    """Jitted `(params, tokens_BxT) -> [B, T]` logprob of each next token under the trainer's forward
    (forward.make_forward at temperature 1, chunked), the params rounded to `round_to` first as the canary does
    (forward.round_params: the weights the engine was given)."""
    fwd = forward.make_forward(graphdef, mesh, rules, precision=precision, temperature=1.0, chunk_size=CHUNK)

    def run(params, tokens_BxT):
        b, t = tokens_BxT.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        targets = jnp.concatenate([tokens_BxT[:, 1:], jnp.zeros((b, 1), tokens_BxT.dtype)], axis=1)
        ones = jnp.ones((b, t), jnp.int32)
        return fwd(forward.round_params(params, round_to), tokens_BxT, positions, ones, targets).stats.logprobs_N

    return jax.jit(run)


def log_k_stats(logp_RxN, logq_RxN) -> dict:
    """|log k| = |log p - log q| of the trainer's p against the sampler's q over the tokens: mean, max, signed mean."""
    log_k = np.asarray(logp_RxN, np.float64) - np.asarray(logq_RxN, np.float64)
    return dict(
        tokens=int(log_k.size),
        mean_abs_log_k=float(np.abs(log_k).mean()),
        max_abs_log_k=float(np.abs(log_k).max()),
        mean_log_k=float(log_k.mean()),
        finite=bool(np.isfinite(log_k).all()),
    )


def agreement(ctx: dict, graphdef_train, precision: str, round_to, seq, logq, prompt_len: int) -> dict:
    """The trainer forward's logprobs of the sampled tokens (`seq`: prompt + sampled tokens) against the sampler's."""
    fn = trainer_logprobs(graphdef_train, ctx["mesh"], ctx["rules"], precision, round_to)
    t0 = time.perf_counter()
    logp = np.asarray(fn(ctx["params"], jnp.asarray(seq)))
    new = logq.shape[1]
    stats = log_k_stats(logp[:, prompt_len - 1 : prompt_len - 1 + new], logq)
    return dict(status="ok", rows=int(seq.shape[0]), trainer_s=time.perf_counter() - t0, **stats)


def fp32_agreement(ctx: dict, deadline: float) -> dict:
    """An fp32 engine (its own small batch) against the fp32 trainer forward on the same weights."""
    size = ctx["size"]
    prompts, n, new = FP32_BATCH[size]
    p = WORKLOAD[size]["prompt_len"]
    graphdef = ctx["graphdef_fp32"]
    pre_fn, dec_fn = sampler_programs(graphdef, ctx["mesh"], ctx["rules"], n, new)
    tokens = jnp.asarray(prompt_ids(size, prompts, ctx["abstract"].cfg.vocab_size))
    t0 = time.perf_counter()
    pre = pre_fn(ctx["params"], tokens, jnp.ones(tokens.shape, bool))
    dec = jax.block_until_ready(dec_fn(ctx["params"], pre, rows_of(prompts * n, p, new, seed=1)))
    sampler_s = time.perf_counter() - t0
    seq = np.concatenate([np.repeat(np.asarray(tokens), n, axis=0), np.asarray(dec.tokens_BxN)], axis=1)
    res = agreement(ctx, graphdef, "fp32", None, seq, np.asarray(dec.logprobs_BxN), p)
    return dict(res, prompts=prompts, n=n, new_tokens=new, sampler_s=sampler_s)


def _build(size: str) -> dict:
    """The model (random fp32 master weights built on the device, as the train step's), its bf16 copy for the
    sampler, the graphdefs of the bf16 sampler, the bf16 trainer and the fp32 engine/trainer, counts and peaks."""
    w = WORKLOAD[size]
    seq = w["prompt_len"] + max(w["new_tokens"], FP32_BATCH[size][2])
    hf, cfg_train = gpu_parts.model_of(size, seq, _dtype_kwargs("bf16"))
    graphdef_train, _ = hf_io.abstract_model(hf, cfg_train)
    graphdef_bf16, abstract = hf_io.abstract_model(hf, hf_io.model_config(hf, **_sampler_kwargs("bfloat16")))
    graphdef_fp32, _ = hf_io.abstract_model(hf, hf_io.model_config(hf, **_dtype_kwargs("fp32")))
    params = jax.jit(lambda: nnx.split(hf_io.init_model(hf, cfg_train, 0), nnx.Param)[1])()
    params_bf16 = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(jnp.bfloat16), p))(params)
    jax.block_until_ready(params_bf16)
    kind = mfu.device_kind()
    abstract_model = nnx.merge(graphdef_bf16, abstract)
    return dict(
        size=size,
        mesh=sharding.make_mesh({"fsdp": -1}, jax.devices()[:1]),
        rules=sharding.DEFAULT_TABLE,
        params=params,
        params_bf16=params_bf16,
        graphdef_train=graphdef_train,
        graphdef_bf16=graphdef_bf16,
        graphdef_fp32=graphdef_fp32,
        abstract=abstract_model,
        counts=costs.param_counts(abstract_model),
        device_kind=kind,
        peak=mfu.peak(kind, "bf16"),
        bandwidth=_bandwidth(kind),
    )


def run(size: str, deadline: float, save, trace_dir=None) -> dict:
    """The JAX sampler on the full-width cut (gpu_parts.MODEL; random weights built on the device) in bf16: per batch
    of WORKLOAD, prefill tokens/s and MFU, decode tokens/s and its fraction of the memory-bound roofline; the sampled
    tokens' logprobs against the trainer forward's (|log k|) in bf16 and, on a small batch, fp32; with `trace_dir`, a
    profiler trace of one decode call (gpu_profile.capture). Units in that order, each recorded as it ends (`save`);
    one that would end past `deadline` (time.time(); FULL_UNIT_S, or the unit before it) is skipped, saying so;
    a failure (out of memory flagged) is recorded and the next unit goes on."""
    w = WORKLOAD[size]
    out = dict(size=size, dtype="bfloat16", method=METHOD, prompt_len=w["prompt_len"], new_tokens=w["new_tokens"])
    out.update(init=None, batches={}, profile=dict(status="skipped", reason="no trace_dir given"), agreement={})
    state = dict(last_s=0.0)

    def unit(where: dict, key: str, fn, needs=None):
        est = FULL_UNIT_S.get(key, state["last_s"]) if size == "full" else state["last_s"]
        if time.time() + est > deadline:
            where[key] = dict(status="skipped", reason=f"time box: it would end past the deadline (~{est:.0f} s)")
            return
        if needs is not None and needs not in state:
            where[key] = dict(status="skipped", reason=f"needs {needs}, which did not run")
            return
        t0 = time.time()
        try:
            where[key] = fn()
        except Exception as err:  # noqa: BLE001  (out of memory included: recorded, the next unit goes on)
            where[key] = dict(gpu_parts.failure(err), **gpu_parts.memory())
        where[key]["seconds"] = state["last_s"] = time.time() - t0
        save(out)

    def build():
        state["ctx"] = ctx = _build(size)
        counts = dict(ctx["counts"], active=flops_lib.active_params(ctx["abstract"]))
        out.update(device_kind=ctx["device_kind"], **ctx["peak"], **ctx["bandwidth"], params=counts)
        return dict(status="ok", **gpu_parts.memory())

    unit(out, "init", build)
    for i, (prompts, n) in enumerate(w["batches"]):

        def one(prompts=prompts, n=n, first=i == 0):
            res, kept = measure_batch(state["ctx"], prompts, n, deadline)
            state["last_batch"] = kept
            if first:
                state["first_batch"] = {k: kept[k] for k in ("seq", "logq")}
            return res

        unit(out["batches"], batch_key(prompts, n), one, needs="ctx")
    if trace_dir is not None:
        unit(out, "profile", lambda: dict(status="ok", **gpu_profile.capture(
            state["last_batch"]["decode"], trace_dir, f"sampler_decode_{size}"
        )), needs="last_batch")  # fmt: skip
    state.pop("last_batch", None)  # its KV cache freed

    def bf16():
        ctx, kept = state["ctx"], state["first_batch"]
        res = agreement(ctx, ctx["graphdef_train"], "bf16", "bfloat16", kept["seq"], kept["logq"], w["prompt_len"])
        return dict(res, batch=batch_key(*w["batches"][0]))

    unit(out["agreement"], "bfloat16", bf16, needs="first_batch")
    unit(out["agreement"], "float32", lambda: fp32_agreement(state["ctx"], deadline), needs="ctx")
    out["status"] = "ok"
    out.update(gpu_parts.memory())
    save(out)
    return out
