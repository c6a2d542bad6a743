"""Exactness of every MoE dispatch impl and attention core against a float64 reference, values and gradients."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from cisjax import errors, runtime, sharding
from cisjax.models import attention, moe

# Bounds on the max-normalised error, max |got - ref| / max |ref|, of each output and gradient against float64 on the
# same (dtype-rounded) inputs. fp32: the 1e-5. bf16: four units of bf16 rounding (2^-8 each: 8 mantissa bits):
# the inputs, the SwiGLU's (or the attention probabilities') bf16 intermediate, the output and a gradient's own
# rounding each cost one.
BOUNDS = {"float32": 1e-5, "bfloat16": 4 * 2.0**-8}
DTYPES = tuple(BOUNDS)

# (tokens N, hidden D, experts E, top-k, expert width F). Routing is drawn so that groups are ragged and two are
# empty (EMPTY_EXPERTS). full: the kernels' real block sizes (multiples of 128); small: a CPU run in Pallas'
# interpreter.
MOE_SHAPES = {"full": (2048, 512, 16, 4, 256), "small": (48, 32, 6, 2, 32)}
EMPTY_EXPERTS = (1, 4)
# (rows B, length L, query heads, key/value heads, head width): row 0 holds two segments and trailing padding, row 1
# one segment over the whole length (attention.Segments: 0 = padding).
ATTENTION_SHAPES = {"full": (2, 512, 8, 2, 128), "small": (2, 64, 4, 2, 32)}


def impls_to_check(impls: tuple[str, ...], default: str) -> list[str]:
    """An IMPLS tuple's impls in the order the check runs them: what "auto" picks on this platform first (a section
    cut short by its time box keeps the one that matters), then the rest as listed."""
    rest = [i for i in impls if i != "auto"]
    return ([default] if default in rest else []) + [i for i in rest if i != default]


def max_rel(got, ref) -> float:
    """max |got - ref| / max |ref| in float64 (0 when the reference is all zeros and so is got)."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    scale = np.abs(ref).max()
    err = np.abs(got - ref).max()
    return float(err / scale) if scale > 0 else float(err)


def _rounded(a: np.ndarray, dtype) -> np.ndarray:
    """`a` as the kernel sees it in `dtype`, back in float64."""
    return np.asarray(jnp.asarray(a, dtype).astype(jnp.float32), np.float64)


def _silu(z):
    return z / (1.0 + np.exp(-z))


def _dsilu(z):
    s = 1.0 / (1.0 + np.exp(-z))
    return s * (1.0 + z * (1.0 - s))


# ----------------------------------------------------------------------------- MoE


def moe_inputs(size: str, seed: int = 0) -> dict:
    """float64 inputs of moe_ffn: x, wg, wu, wo, gate weights w, expert ids (ragged, EMPTY_EXPERTS get no token) and
    the loss cotangent ct; `sizes` the tokens per expert."""
    n, d, e, k, f = MOE_SHAPES[size]
    rng = np.random.default_rng(seed)
    p_E = (np.arange(e) + 1.0) ** 2  # ragged: expert e drawn ~ (e + 1)^2
    p_E[list(EMPTY_EXPERTS)] = 0.0
    ids_NxK = np.stack([rng.choice(e, k, replace=False, p=p_E / p_E.sum()) for _ in range(n)]).astype(np.int32)
    return dict(
        x=rng.standard_normal((n, d)),
        wg=rng.standard_normal((e, d, f)) / np.sqrt(d),
        wu=rng.standard_normal((e, d, f)) / np.sqrt(d),
        wo=rng.standard_normal((e, f, d)) / np.sqrt(f),
        w=rng.uniform(0.1, 1.0, (n, k)),
        ids=ids_NxK,
        ct=rng.standard_normal((n, d)),
        sizes=np.bincount(ids_NxK.ravel(), minlength=e),
    )


def moe_reference(x, wg, wu, wo, w, ids, ct) -> dict:
    """float64 y = sum_k w[n,k] * SwiGLU_{ids[n,k]}(x[n]) and the gradients of <y, ct> by hand (the chain rule), one
    expert's assignments at a time."""
    n, k = ids.shape
    out = {name: np.zeros_like(a) for name, a in dict(y=x, dx=x, dwg=wg, dwu=wu, dwo=wo, dw=w).items()}
    for e in range(wg.shape[0]):
        token_R, slot_R = np.nonzero(ids == e)  # this expert's assignments: (token, which of its k)
        if not len(token_R):
            continue
        x_RxD, w_R, ct_RxD = x[token_R], w[token_R, slot_R], ct[token_R]
        g_RxF, u_RxF = x_RxD @ wg[e], x_RxD @ wu[e]
        a_RxF = _silu(g_RxF) * u_RxF
        y_RxD = a_RxF @ wo[e]
        np.add.at(out["y"], token_R, w_R[:, None] * y_RxD)
        out["dw"][token_R, slot_R] = np.einsum("rd,rd->r", y_RxD, ct_RxD)
        dy_RxD = w_R[:, None] * ct_RxD
        da_RxF = dy_RxD @ wo[e].T
        du_RxF, dg_RxF = da_RxF * _silu(g_RxF), da_RxF * u_RxF * _dsilu(g_RxF)
        out["dwo"][e], out["dwg"][e], out["dwu"][e] = a_RxF.T @ dy_RxD, x_RxD.T @ dg_RxF, x_RxD.T @ du_RxF
        np.add.at(out["dx"], token_R, dg_RxF @ wg[e].T + du_RxF @ wu[e].T)
    return out


def check_moe(impl: str, dtype: str, inputs: dict, reference=moe_reference) -> dict:
    """One impl in one dtype: moe_ffn's output and the gradients of <y, ct> (x, the three expert stacks, the gate
    weights) against `reference` on the dtype-rounded inputs; and whether the empty experts' weight gradients are
    exactly zero."""
    dt = jnp.dtype(dtype)
    arrays = {k: jnp.asarray(inputs[k], dt) for k in ("x", "wg", "wu", "wo")}
    w, ids, ct = jnp.asarray(inputs["w"], dt), jnp.asarray(inputs["ids"]), jnp.asarray(inputs["ct"], jnp.float32)

    def loss(x, wg, wu, wo, w):
        y = moe.moe_ffn(x, wg, wu, wo, ids, w, impl=impl)
        return jnp.sum(y.astype(jnp.float32) * ct), y

    with runtime.matmul_precision(dt):  # as the trainer traces a program of this dtype
        fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))
        (_, y), grads = jax.block_until_ready(fn(*arrays.values(), w))
    seen = {k: _rounded(inputs[k], dt) for k in ("x", "wg", "wu", "wo", "w")}
    ref = reference(seen["x"], seen["wg"], seen["wu"], seen["wo"], seen["w"], inputs["ids"], inputs["ct"])
    got = dict(zip(("y", "dx", "dwg", "dwu", "dwo", "dw"), (y, *grads)))
    errs = {name: max_rel(got[name], ref[name]) for name in got}
    empty = inputs["sizes"] == 0
    zero = all(bool(np.all(np.asarray(got[g], np.float64)[empty] == 0)) for g in ("dwg", "dwu", "dwo"))
    return _verdict(errs, dtype, empty_groups_zero_grad=zero)


# ----------------------------------------------------------------------------- attention


def attention_inputs(size: str, seed: int = 0) -> dict:
    """float64 q [B, L, N, H], k and v [B, L, K, H], segment ids (row 0: two segments then padding; row 1: one
    segment) and a cotangent that is zero on padded queries (their outputs are nobody's)."""
    b, length, n, kv, h = ATTENTION_SHAPES[size]
    rng = np.random.default_rng(seed)
    ids_BxL = np.ones((b, length), np.int32)
    first, real = length * 3 // 8, length * 7 // 8
    ids_BxL[0, first:real], ids_BxL[0, real:] = 2, 0
    ct = rng.standard_normal((b, length, n, h)) * (ids_BxL > 0)[:, :, None, None]
    return dict(
        q=rng.standard_normal((b, length, n, h)),
        k=rng.standard_normal((b, length, kv, h)),
        v=rng.standard_normal((b, length, kv, h)),
        ids=ids_BxL,
        ct=ct,
        scale=h**-0.5,
    )


def attention_reference(q, k, v, ids, ct, scale: float) -> dict:
    """float64 causal attention within segments (padding sees only padding) and the gradients of <o, ct>."""
    b, length, n, h = q.shape
    g = n // k.shape[2]
    kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)  # query head i reads key/value head i // g
    mask_BxLxS = (ids[:, :, None] == ids[:, None, :]) & np.tril(np.ones((length, length), bool))[None]
    s_BxNxLxS = np.einsum("blnh,bsnh->bnls", q, kr) * scale
    s_BxNxLxS = np.where(mask_BxLxS[:, None], s_BxNxLxS, -np.inf)
    p_BxNxLxS = np.exp(s_BxNxLxS - s_BxNxLxS.max(-1, keepdims=True))
    p_BxNxLxS /= p_BxNxLxS.sum(-1, keepdims=True)
    o = np.einsum("bnls,bsnh->blnh", p_BxNxLxS, vr)
    dp_BxNxLxS = np.einsum("blnh,bsnh->bnls", ct, vr)
    ds_BxNxLxS = p_BxNxLxS * (dp_BxNxLxS - (dp_BxNxLxS * p_BxNxLxS).sum(-1, keepdims=True))
    dq = np.einsum("bnls,bsnh->blnh", ds_BxNxLxS, kr) * scale
    dk = np.einsum("bnls,blnh->bsnh", ds_BxNxLxS, q) * scale
    dv = np.einsum("bnls,blnh->bsnh", p_BxNxLxS, ct)
    fold = lambda a: a.reshape(b, length, n // g, g, h).sum(3)  # noqa: E731  (grouped heads' gradients add up)
    return dict(o=o, dq=dq, dk=fold(dk), dv=fold(dv))


def check_attention(impl: str, dtype: str, inputs: dict, reference=attention_reference) -> dict:
    """One attention core in one dtype: its output on the real (unpadded) queries and the gradients of <o, ct>
    against `reference` on the dtype-rounded inputs."""
    dt = jnp.dtype(dtype)
    q, k, v = (jnp.asarray(inputs[name], dt) for name in ("q", "k", "v"))
    segments, ct = attention.Segments(jnp.asarray(inputs["ids"])), jnp.asarray(inputs["ct"], jnp.float32)

    def loss(q, k, v):
        o = attention.attention(q, k, v, segments, inputs["scale"], impl=impl)
        return jnp.sum(o.astype(jnp.float32) * ct), o

    with runtime.matmul_precision(dt):
        (_, o), grads = jax.block_until_ready(jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v))
    seen = {name: _rounded(inputs[name], dt) for name in ("q", "k", "v")}
    ref = reference(seen["q"], seen["k"], seen["v"], inputs["ids"], inputs["ct"], inputs["scale"])
    real = inputs["ids"] > 0
    got = dict(zip(("o", "dq", "dk", "dv"), (o, *grads)))
    errs = {
        name: max_rel(
            np.asarray(got[name])[real] if name == "o" else got[name], ref[name][real] if name == "o" else ref[name]
        )
        for name in got
    }
    return _verdict(errs, dtype)


# ----------------------------------------------------------------------------- the section


def _verdict(errs: dict, dtype: str, **extra) -> dict:
    worst = max(errs.values())
    ok = bool(np.isfinite(worst) and worst <= BOUNDS[dtype]) and all(extra.values())
    return dict(max_rel=errs, worst=worst, bound=BOUNDS[dtype], ok=ok, **extra)


def run(size: str, deadline: float, save, references=None, cases=None) -> dict:
    """Every impl of moe.IMPLS and attention.IMPLS (what "auto" picks first) in fp32 and bf16, or only `cases`
    ([kind, impl, dtype] each: a worker's share); `save(result)` after each, so that a run cut short keeps what it
    measured. An impl the platform refuses (errors.UserError) is recorded as such; one that would start past
    `deadline` (time.time()) is skipped, saying so. `references`: {"moe": fn, "attention": fn} in place of the float64
    references (a test breaks one to see the check fail)."""
    wanted = None if cases is None else {tuple(c) for c in cases}
    references = references or {}
    platform = sharding.current_platform()
    kinds = {
        "moe": (moe_inputs(size), impls_to_check(moe.IMPLS, moe.default_impl(platform)), check_moe),
        "attention": (
            attention_inputs(size),
            impls_to_check(attention.IMPLS, attention.default_impl(platform, jnp.bfloat16)),
            check_attention,
        ),
    }
    res = dict(bounds=BOUNDS, moe_shape=dict(zip("NDEKF", MOE_SHAPES[size])), attention_shape=ATTENTION_SHAPES[size])
    res["moe_group_sizes"] = kinds["moe"][0]["sizes"].tolist()
    last_s = 0.0
    for kind, (inputs, impls, check) in kinds.items():
        res[kind] = {}
        for impl in impls:
            row = {}
            for dtype in DTYPES:
                if wanted is not None and (kind, impl, dtype) not in wanted:
                    continue
                res[kind][impl] = row
                if time.time() + last_s > deadline:
                    row[dtype] = dict(skipped=f"time box: would end past the section's deadline (~{last_s:.0f} s)")
                    continue
                t0 = time.time()
                try:
                    kwargs = {"reference": references[kind]} if kind in references else {}
                    row[dtype] = check(impl, dtype, inputs, **kwargs)
                except errors.UserError as err:
                    row[dtype] = dict(skipped=f"not on {platform}: {err}")
                except Exception as err:  # noqa: BLE001  (a kernel that fails is a finding, recorded)
                    row[dtype] = dict(error=f"{type(err).__name__}: {str(err)[:1500]}", ok=False)
                row[dtype]["seconds"] = last_s = time.time() - t0
                save(res)
    failures = [
        f"{kind} {impl} {dtype}"
        for kind in kinds
        for impl, row in res[kind].items()
        for dtype, r in row.items()
        if r.get("ok") is False
    ]
    res.update(ok=not failures, failures=failures)
    return res
