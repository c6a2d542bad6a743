"""`cisjax bench moe`: MoE layer fwd+bwd time per dispatch impl, as a ratio to a dense SwiGLU MLP of equal active FLOPs."""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from cisjax import errors
from cisjax.bench import harness, mfu
from cisjax.models import moe, moe_tiled, routing

TARGET_RATIO = 2.0  # default impl's MoE time / dense MLP time
# ExKxF: Mixtral-like top-2 of 8, and Qwen1.5-MoE-A2.7B (hidden 2048, 60 experts of width 1408,
# top-4) scaled down 4x with the default --hidden 512.
DEFAULT_SHAPES = ("8x2x256", "60x4x352")
SLOW_FOLD = 8  # on CPU, impls doing E/k-fold work (dense; ragged lowers to it) are skipped above this unless named


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=list(DEFAULT_SHAPES),
        metavar="ExKxF",
        help="experts x top-k x expert width, one entry per shape (default: %(default)s)",
    )
    parser.add_argument("--tokens", type=int, default=4096, help="tokens N (default: %(default)s)")
    parser.add_argument("--hidden", type=int, default=512, help="model width D (default: %(default)s)")
    parser.add_argument(
        "--impls",
        nargs="+",
        default=None,
        metavar="IMPL",
        help="moe impls to time (default: every impl of cisjax.models.moe.IMPLS but auto, those the platform refuses "
        f"skipped; on CPU ragged, triton and dense only where E/k <= {SLOW_FOLD}, as they do E/k-fold work or run "
        "in an interpreter there; naming them here forces them)",
    )
    parser.add_argument(
        "--tile", type=int, default=None, help="largest tile for the tiled impl (default: moe_tiled.choose_tile)"
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="activation and weight dtype, MoE and dense alike (default: %(default)s)",
    )
    harness.add_repeats(parser, 9, "timed calls per candidate, interleaved")
    parser.add_argument(
        "--slow-repeats", type=int, default=2, help="timed calls for the E/k-fold impls (default: %(default)s)"
    )
    harness.add_seed(parser)
    harness.add_json(parser)


def parse_shape(spec: str) -> tuple[int, int, int]:
    try:
        e, k, f = (int(v) for v in spec.lower().split("x"))
    except ValueError:
        raise errors.UserError(f"bad --shapes entry {spec!r}; expected ExKxF, e.g. 60x4x352") from None
    if not 1 <= k <= e or f < 1:
        raise errors.UserError(f"bad --shapes entry {spec!r}: need 1 <= k <= E and F >= 1")
    return e, k, f


def _candidates(e: int, k: int, f: int, n: int, d: int, dtype, impls, tile, seed: int) -> dict:
    """name -> (jitted fwd+bwd, args). Loss = <y, fixed random cotangent>; MoE grads w.r.t. x, router
    and expert weights, routing (fp32 router, softmax top-k) inside; dense grads w.r.t. x and its weights."""
    keys = iter(jax.random.split(jax.random.key(seed), 10))

    def normal(shape, fan_in, dt=dtype):
        return (jax.random.normal(next(keys), shape, jnp.float32) * fan_in**-0.5).astype(dt)

    x_NxD = normal((n, d), 1)
    ct_NxD = normal((n, d), 1)
    router_DxE = normal((d, e), d, jnp.float32)
    experts = (normal((e, d, f), d), normal((e, d, f), d), normal((e, f, d), f))
    mlp = (normal((d, k * f), d), normal((d, k * f), d), normal((k * f, d), k * f))

    def dense_loss(x, wg, wu, wo):
        y = (jax.nn.silu(x @ wg) * (x @ wu)) @ wo
        return jnp.sum((y * ct_NxD).astype(jnp.float32))

    def moe_loss(impl):
        def loss(x, r, wg, wu, wo):
            w_NxK, ids_NxK = routing.route(jnp.einsum("nd,de->ne", x.astype(jnp.float32), r), k=k)
            y = moe.moe_ffn(x, wg, wu, wo, ids_NxK, w_NxK, impl=impl, tile=tile)
            return jnp.sum((y * ct_NxD).astype(jnp.float32))

        return loss

    def route_loss(x, r):  # the routing part alone, for its share of the MoE time
        w_NxK, _ = routing.route(jnp.einsum("nd,de->ne", x.astype(jnp.float32), r), k=k)
        return jnp.sum(w_NxK * ct_NxD[:, :k].astype(jnp.float32))

    cands = {"dense_mlp": (jax.jit(jax.grad(dense_loss, argnums=(0, 1, 2, 3))), (x_NxD, *mlp))}
    for impl in impls:
        cands[f"moe_{impl}"] = (
            jax.jit(jax.grad(moe_loss(impl), argnums=(0, 1, 2, 3, 4))),
            (x_NxD, router_DxE, *experts),
        )
    cands["routing_only"] = (jax.jit(jax.grad(route_loss, argnums=(0, 1))), (x_NxD, router_DxE))
    return cands


def layer_flops(candidate: str, e: int, k: int, f: int, n: int, d: int) -> float:
    """Analytic FLOPs of a candidate's forward + backward (2 per multiply-add; the backward twice the forward): the
    MoE layers and the dense MLP count the experts' three matmuls at the active width k F (the router's own matmul,
    2 N D E forward, is routing_only's); work an impl does beyond that (padding, E-fold dense work) is not counted."""
    if candidate == "routing_only":
        return 6.0 * n * d * e
    return 18.0 * n * d * k * f


def bench_shape(e, k, f, *, n, d, impls, forced, tile, dtype_name, repeats, slow_repeats, seed) -> dict:
    cpu = jax.default_backend() == "cpu"
    resolved = {impl: moe.default_impl() if impl == "auto" else impl for impl in impls}
    # off GPU "triton" runs in Pallas's interpreter: a test path, not a timing
    slow = {impl for impl, r in resolved.items() if r == "dense" or (r in ("ragged", "triton") and cpu)}
    skipped = [impl for impl in impls if impl in slow and e / k > SLOW_FOLD and impl not in forced]
    run_impls = [impl for impl in impls if impl not in skipped]
    cands = _candidates(e, k, f, n, d, jnp.dtype(dtype_name), run_impls, tile, seed)

    first_call_s, refused = {}, {}
    for name, (fn, args) in list(cands.items()):  # compile + one warm-up call, outside the timings
        t0 = time.perf_counter()
        try:
            compiled = fn.lower(*args).compile()
        except errors.UserError as err:  # an impl this platform does not run (e.g. a TPU kernel on a GPU)
            refused[name[4:]] = f"not on {jax.default_backend()}: {err}"
            del cands[name]
            continue
        jax.block_until_ready(compiled(*args))
        first_call_s[name] = time.perf_counter() - t0
        cands[name] = (compiled, args)

    calls = {name: (lambda fn=fn, args=args: jax.block_until_ready(fn(*args))) for name, (fn, args) in cands.items()}
    slow_calls = {name: slow_repeats for name in cands if name.startswith("moe_") and name[4:] in slow}
    times = harness.interleave(calls, repeats, cpu_clock=time.process_time, limit=slow_calls)
    ref = mfu.peak(mfu.device_kind(), dtype_name)
    base, base_min = times.median("dense_mlp"), times.min("dense_mlp")
    base_cpu = harness.median(times.cpu_s["dense_mlp"])
    rows = [
        dict(
            candidate=name,
            impl=resolved.get(name[4:], name),
            ms=times.median(name) * 1e3,
            min_ms=times.min(name) * 1e3,
            ratio=times.median(name) / base,
            ratio_min=times.min(name) / base_min,
            cpu_ratio=harness.median(times.cpu_s[name]) / base_cpu,
            repeats=len(times.wall_s[name]),
            first_call_s=first_call_s[name],
            **mfu.utilization(layer_flops(name, e, k, f, n, d), times.median(name), ref),
        )
        for name in cands
    ]
    rows += [
        dict(
            candidate=f"moe_{impl}",
            impl=resolved[impl],
            skipped=f"E/k = {e / k:g} > {SLOW_FOLD}-fold work on CPU; --impls {impl} forces it",
        )
        for impl in skipped
    ]
    rows += [dict(candidate=f"moe_{impl}", impl=resolved[impl], skipped=why) for impl, why in refused.items()]
    default = next((r for r in rows if r["impl"] == moe.default_impl() and "ratio" in r), None)
    return dict(
        E=e,
        k=k,
        F=f,
        N=n,
        D=d,
        dense_width=k * f,
        dtype=dtype_name,
        device_kind=mfu.device_kind(),
        **ref,
        tile=moe_tiled.tile_sizes(min(tile or moe_tiled.choose_tile(n * k, e), n * k)),
        default_impl=moe.default_impl(),
        default_ratio=default["ratio"] if default else None,
        target_met=default["ratio"] <= TARGET_RATIO if default else None,
        rows=rows,
    )


def _print(res: dict) -> None:
    title = (
        f"E={res['E']} k={res['k']} F={res['F']}, N={res['N']} D={res['D']} {res['dtype']}, "
        f"dense MLP width {res['dense_width']}, tiles {','.join(map(str, res['tile']))}"
    )
    notes = [
        "fwd+bwd of <y, ct>; ratio: median / dense_mlp median (min: min / min, cpu: process CPU time); TFLOP/s: the "
        "analytic work (bench_moe.layer_flops) per median second",
        f"{res['device_kind']}: {mfu.describe(res)}",
    ]
    cells = []
    for row in res["rows"]:
        name = row["candidate"].removeprefix("moe_")
        if "skipped" in row:
            notes.append(f"{name} skipped: {row['skipped']}")
            continue
        ratio = f"{row['ratio']:.2f}x"
        if row["candidate"].startswith("moe_") and row["impl"] == res["default_impl"]:
            name += " (default)"
            ratio = f"[{'green' if row['ratio'] <= TARGET_RATIO else 'red'}]{ratio}[/]"
        cells.append(
            (
                name,
                f"{row['ms']:.1f}",
                f"{row['min_ms']:.1f}",
                ratio,
                f"{row['ratio_min']:.2f}x",
                f"{row['cpu_ratio']:.2f}x",
                str(row["repeats"]),
                f"{row['first_call_s']:.1f}",
                f"{row['tflops']:.3g}",
                "-" if row["mfu"] is None else f"{row['mfu']:.1%}",
            )
        )
    columns = ("candidate", "ms", "min ms", "ratio", "min", "cpu", "n", "1st s", "TFLOP/s", "MFU")
    harness.console(140).print(harness.table(title, columns, cells, "\n".join(notes)))


def run(args, overrides=()) -> int:
    shapes = [parse_shape(s) for s in args.shapes]
    impls = args.impls or [i for i in moe.IMPLS if i != "auto"]
    for impl in impls:
        if impl not in moe.IMPLS:
            raise errors.UserError(f"unknown impl {impl!r}; one of {moe.IMPLS}")
    results = []
    for e, k, f in shapes:
        results.append(
            bench_shape(
                e,
                k,
                f,
                n=args.tokens,
                d=args.hidden,
                impls=impls,
                forced=set(args.impls or ()),
                tile=args.tile,
                dtype_name=args.dtype,
                repeats=args.repeats,
                slow_repeats=args.slow_repeats,
                seed=args.seed,
            )
        )
        _print(results[-1])
    verdicts = [f"E={r['E']} k={r['k']}: {r['default_ratio']:.2f}x" for r in results if r["default_ratio"] is not None]
    met = all(r["target_met"] for r in results if r["target_met"] is not None)
    print(
        f"default impl {moe.default_impl()!r} vs dense MLP (target <= {TARGET_RATIO:g}x): {', '.join(verdicts)} -> "
        f"{'target met' if met else 'TARGET MISSED'}"
    )
    device = dict(backend=jax.default_backend(), device=str(jax.devices()[0]))
    harness.write_json(
        args.json, dict(bench="moe", **device, target_ratio=TARGET_RATIO, repeats=args.repeats, shapes=results)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(harness.main("moe", add_args, run))
