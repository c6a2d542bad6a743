"""`cisjax bench logprobs`: chunked vs naive token logprobs fwd+bwd — peak memory, time and value agreement in one run."""

from __future__ import annotations

import argparse
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import psutil

from cisjax.bench import harness
from cisjax.logprobs import naive_token_logprobs, token_logprobs

TARGET_PEAK_RATIO = 0.25  # chunked peak memory / naive peak memory
GIB_COLUMNS = ("xla_temp_bytes", "xla_argument_bytes", "xla_output_bytes", "xla_peak_bytes", "rss_peak_delta_bytes")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vocab", type=int, default=151_936, help="vocabulary size V (default: %(default)s, Qwen)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens N (default: %(default)s)")
    parser.add_argument("--hidden", type=int, default=1024, help="model width D (default: %(default)s)")
    parser.add_argument("--chunk-size", type=int, default=1024, help="tokens per chunk (default: %(default)s)")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="storage and compute dtype of hidden and unembedding (default: %(default)s)",
    )
    parser.add_argument("--top-k", type=int, default=0, help="also compute top-k logprobs (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=1.0)
    harness.add_repeats(parser, 3, "timed calls per candidate after the first")
    harness.add_seed(parser)
    harness.add_json(parser)


class _RssPeak:
    """Samples this process's resident set size in a thread: the high-water mark above a baseline."""

    def __init__(self, interval_s: float = 0.002):
        self._proc = psutil.Process()
        self._interval = interval_s
        self._stop = threading.Event()
        self.base = self.peak = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(self._interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)

    @property
    def delta(self) -> int:
        return self.peak - self.base


def _fwd_bwd(fn, *, temperature: float, chunk_size: int, top_k: int):
    """(h, w, t) -> (stats, (d/dh, d/dw)) of sum(logprobs) + sum(entropy) (+ sum(top-k logprobs))."""

    def run(h_NxD, w_DxV, t_N):
        def stats(h_NxD, w_DxV):
            s = fn(h_NxD, w_DxV, t_N, temperature=temperature, chunk_size=chunk_size, top_k=top_k)
            return s.logprobs_N, s.entropy_N, s.topk_logprobs_NxK

        def loss(h_NxD, w_DxV):
            lp, ent, topk = stats(h_NxD, w_DxV)
            return jnp.sum(lp) + jnp.sum(ent) + (jnp.sum(topk) if top_k else 0.0), (lp, ent, topk)

        grads, aux = jax.grad(loss, argnums=(0, 1), has_aux=True)(h_NxD, w_DxV)
        return aux, grads

    return run


def bench(
    *,
    vocab: int,
    tokens: int,
    hidden: int,
    chunk_size: int,
    dtype_name: str,
    top_k: int,
    temperature: float,
    repeats: int,
    seed: int,
) -> dict:
    """Each of chunked and naive compiled, its XLA memory analysis, then a first call and `repeats` timed calls under
    an RSS sampler (one candidate after the other: each peak is its own); the ratios and the values' differences."""
    dtype = jnp.dtype(dtype_name)
    k = jax.random.split(jax.random.key(seed), 3)
    h_NxD = jax.random.normal(k[0], (tokens, hidden), jnp.float32).astype(dtype)
    w_DxV = (jax.random.normal(k[1], (hidden, vocab), jnp.float32) * 2.0 * hidden**-0.5).astype(dtype)
    t_N = jax.random.randint(k[2], (tokens,), 0, vocab, jnp.int32)
    inputs = jax.block_until_ready((h_NxD, w_DxV, t_N))
    rows, values = [], {}
    for name, fn in (("chunked", token_logprobs), ("naive", naive_token_logprobs)):
        run = _fwd_bwd(fn, temperature=temperature, chunk_size=chunk_size, top_k=top_k)
        row, values[name] = _measure(name, run, inputs, repeats)
        rows.append(row)
    ch, nv = rows
    ratios = dict(
        xla_peak=ch["xla_peak_bytes"] / nv["xla_peak_bytes"],
        xla_temp=ch["xla_temp_bytes"] / nv["xla_temp_bytes"],
        rss_peak_delta=ch["rss_peak_delta_bytes"] / nv["rss_peak_delta_bytes"]
        if nv["rss_peak_delta_bytes"] > 0
        else None,
        median_time=ch["median_s"] / nv["median_s"],
    )
    return dict(
        V=vocab,
        N=tokens,
        D=hidden,
        chunk_size=chunk_size,
        dtype=dtype_name,
        top_k=top_k,
        temperature=temperature,
        rows=rows,
        ratios=ratios,
        diffs=_diffs(values["chunked"], values["naive"]),
        target_peak_ratio=TARGET_PEAK_RATIO,
        meets_target=ratios["xla_peak"] <= TARGET_PEAK_RATIO,
    )


def _measure(name: str, run, inputs: tuple, repeats: int) -> tuple[dict, dict]:
    """One candidate: its row (XLA memory, RSS peak, compile, first call and timed calls) and its values (host
    arrays of the last call's outputs)."""
    compile_s, compiled = harness.timed(lambda: jax.jit(run).lower(*inputs).compile())
    m = compiled.memory_analysis()
    with _RssPeak() as rss:
        first_s = harness.timed(lambda: jax.block_until_ready(compiled(*inputs)))[0]  # allocation, warm-up
        times = harness.interleave({name: lambda: jax.block_until_ready(compiled(*inputs))}, repeats)
    out = times.last.pop(name) if repeats else compiled(*inputs)
    (lp, ent, topk), (dh, dw) = out
    values = dict(
        logprobs=np.asarray(lp),
        entropy=np.asarray(ent),
        topk_logprobs=None if topk is None else np.asarray(topk),
        grad_hidden=np.asarray(dh, np.float32),
        grad_unembed=np.asarray(dw, np.float32),
    )
    del out, lp, ent, topk, dh, dw
    wall = times.wall_s[name]
    row = dict(
        candidate=name,
        xla_temp_bytes=m.temp_size_in_bytes,
        xla_argument_bytes=m.argument_size_in_bytes,
        xla_output_bytes=m.output_size_in_bytes,
        xla_alias_bytes=m.alias_size_in_bytes,
        xla_peak_bytes=m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes,
        rss_peak_delta_bytes=rss.delta,
        compile_s=compile_s,
        first_call_s=first_s,
        median_s=harness.median(wall) if wall else first_s,
        min_s=min(wall) if wall else first_s,
        repeats=len(wall),
    )
    return row, values


def _diffs(c: dict, n: dict) -> dict:
    """Per quantity: max |chunked - naive|, max |naive| and their ratio."""
    diffs = {}
    for key in c:
        if c[key] is None:
            continue
        scale = float(np.max(np.abs(n[key])))
        err = float(np.max(np.abs(c[key].astype(np.float64) - n[key].astype(np.float64))))
        diffs[key] = dict(max_abs_diff=err, max_abs_naive=scale, max_rel_diff=err / scale if scale else err)
    return diffs


def _print(res: dict) -> None:
    gib = 2.0**30
    title = (
        f"token logprobs fwd+bwd: V={res['V']} N={res['N']} D={res['D']} chunk={res['chunk_size']} "
        f"{res['dtype']} top_k={res['top_k']} T={res['temperature']} (memory in GiB; peak = temp + args + outs)"
    )
    columns = ("candidate", "XLA temp", "args", "outs", "XLA peak", "RSS peak Δ", "median s", "min s", "compile s")
    cells = [
        (
            r["candidate"],
            *(f"{r[k] / gib:.2f}" for k in GIB_COLUMNS),
            f"{r['median_s']:.2f}",
            f"{r['min_s']:.2f}",
            f"{r['compile_s']:.1f}",
        )
        for r in res["rows"]
    ]
    q = res["ratios"]
    colour = "green" if res["meets_target"] else "red"
    rss = "n/a" if q["rss_peak_delta"] is None else f"{q['rss_peak_delta']:.3f}x"
    peak = f"[{colour}]{q['xla_peak']:.3f}x[/]"
    cells.append(("ratio", f"{q['xla_temp']:.3f}x", "", "", peak, rss, f"{q['median_time']:.2f}x", "", ""))
    console = harness.console(120)
    console.print(harness.table(title, columns, cells))
    diffs = [
        (key, f"{v['max_abs_diff']:.3g}", f"{v['max_abs_naive']:.3g}", f"{v['max_rel_diff']:.3g}")
        for key, v in res["diffs"].items()
    ]
    columns = ("quantity", "max |chunked - naive|", "max |naive|", "relative")
    console.print(harness.table("chunked vs naive values", columns, diffs))
    console.print(
        f"target: XLA peak (temp + arguments + outputs) ratio <= {res['target_peak_ratio']}: "
        f"{harness.verdict(res['meets_target'])}"
    )


def run(args, overrides=()) -> int:
    if args.chunk_size < 1 or args.tokens < 1 or args.vocab < 1 or args.hidden < 1 or args.repeats < 0:
        raise SystemExit("--vocab, --tokens, --hidden and --chunk-size must be positive, --repeats non-negative")
    res = bench(
        vocab=args.vocab,
        tokens=args.tokens,
        hidden=args.hidden,
        chunk_size=args.chunk_size,
        dtype_name=args.dtype,
        top_k=args.top_k,
        temperature=args.temperature,
        repeats=args.repeats,
        seed=args.seed,
    )
    return harness.report(dict(backend=jax.default_backend(), devices=str(jax.devices()), **res), _print, args.json)


if __name__ == "__main__":
    raise SystemExit(harness.main("logprobs", add_args, run))
