"""Cost of the exact path on this CPU (issue 49, phase 2): per family, the trainer's forward and its gradient at a
demo-like micro-batch, and one sampler step (decode + draw) at R rows, plain vs exact. Median of 3 calls after a
warm-up; prints the load average (2 shared cores: compare ratios within one run).

Variants: exact_all = attention over all slots at once; exact_b32 = in key blocks of 32; /gather or /dense = MoE
experts gathered per token or every expert on every token. Gradients: "own" differentiates the exact forward itself,
"plain_vjp" is exact.with_plain_gradient (the exact value, the plain forward's VJP).

usage: python probe/exact_cost2.py FAMILIES [DTYPE] [B T R]"""
import sys, tempfile, time
import numpy as np, jax, jax.numpy as jnp, flax.nnx as nnx
from probe.exact_probe import model_dir_of
from cisjax import logprobs
from cisjax.engines.jax.sampling import sampling_logprobs
from cisjax.models import hf_io, exact, exact_head

fams = sys.argv[1].split(",")
dtype = sys.argv[2] if len(sys.argv) > 2 else "float32"
B, T, R = (int(a) for a in sys.argv[3:6]) if len(sys.argv) > 5 else (16, 128, 64)
S = T


def med(f, *a):
    jax.block_until_ready(f(*a))
    ts = []
    for _ in range(3):
        t0 = time.perf_counter(); jax.block_until_ready(f(*a)); ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e3


for fam in fams:
    model, _, _ = hf_io.load(model_dir_of(fam, tempfile.mkdtemp()), dtype=dtype, param_dtype="float32")
    graphdef, params = nnx.split(model)
    moe = bool(model.moe_layers)
    rng = np.random.default_rng(0)
    tok = jnp.asarray(rng.integers(2, 90, (B, T)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    tgt = jnp.roll(tok, -1, 1)
    w = jnp.asarray(rng.standard_normal((B, T)), jnp.float32)

    def plain(params, tok, pos, tgt):
        m = nnx.merge(graphdef, params)
        return logprobs.token_logprobs(m(tok, pos).hidden_BxLxD, m.unembedding_DxV(), tgt).logprobs_N

    def ex(block, impl):
        return lambda params, tok, pos, tgt: exact.exact_forward(
            nnx.merge(graphdef, params), tok, pos, tgt, slots=S, block=block, moe_impl=impl
        )

    kinds = [("all", None), ("b32", 32)]
    impls = ["gather", "dense"] if moe else ["gather"]
    rows = {}
    # value and gradient of a loss of the ratios exp(p) (so the cotangent needs p's value, as the train step's)
    grad = lambda f: jax.jit(jax.value_and_grad(lambda p: jnp.sum(w * jnp.exp(f(p, tok, pos, tgt)))))  # noqa: E731
    fwd = lambda f: jax.jit(lambda p: f(p, tok, pos, tgt))  # noqa: E731
    rows["plain"] = [med(fwd(plain), params), med(grad(plain), params)]
    for kname, blk in kinds:
        for impl in impls:
            f = ex(blk, impl)
            name = f"exact_{kname}/{impl}"
            own = med(grad(f), params) if (kname, impl) == ("b32", impls[-1]) else float("nan")
            rows[name] = [med(fwd(f), params), own, med(grad(exact.with_plain_gradient(f, plain)), params)]
    # a sampler step: R rows at position T // 2 over S slots, decode + head + draw (top-k 20 on every other row)
    r_tok = jnp.asarray(rng.integers(2, 90, (R,)), jnp.int32)
    r_pos = jnp.full((R,), T // 2, jnp.int32)
    top_k = jnp.where(jnp.arange(R) % 2 == 0, 20, 0).astype(jnp.int32)
    top_p = jnp.ones((R,), jnp.float32)
    key = jax.random.key(0)
    valid = jnp.arange(S)[None] <= r_pos[:, None]

    def plain_step(params, cache):
        m = nnx.merge(graphdef, params)
        out, cache = m.cached(r_tok[:, None], r_pos[:, None], cache, r_pos, valid)
        wv = m.unembedding_DxV().astype(m.cfg.dtype)
        z = jnp.einsum("bd,dv->bv", out.hidden_BxLxD[:, 0].astype(m.cfg.dtype), wv, preferred_element_type=jnp.float32)
        lp = sampling_logprobs(z, jnp.ones(R), top_k, top_p, jnp.zeros(R, bool))
        t = jax.random.categorical(key, lp, axis=-1)
        return t, jnp.take_along_axis(lp, t[:, None], -1), cache

    def ex_step(block, impl):
        def f(params, cache):
            z, lse, cache = exact.exact_step(nnx.merge(graphdef, params), cache, r_tok, r_pos, block=block, moe_impl=impl)
            keep, has = exact_head.sampling_support(z, top_k, top_p)
            t = jax.random.categorical(key, jnp.where(keep, z, -jnp.inf), axis=-1).astype(jnp.int32)
            return t, exact.logprob(z, lse, t, keep, has), cache
        return f

    dec = {"plain": med(jax.jit(plain_step), params, model.init_cache(R, S))}
    ecache = exact.init_cache(model, R, S)
    for kname, blk in kinds:
        for impl in impls:
            dec[f"exact_{kname}/{impl}"] = med(jax.jit(ex_step(blk, impl)), params, ecache)
    print(f"## {fam} {dtype} B={B} T={T} S={S} R={R} load={open('/proc/loadavg').read().split()[0]}")
    p_fwd, p_grad = rows["plain"]
    print(f"  {'variant':20s} {'forward ms':>16s} {'grad own ms':>17s} {'grad plain_vjp ms':>20s} {'sampler step ms':>18s}")
    for name, r in rows.items():
        own = r[1] if len(r) == 2 else r[1]
        pv = r[2] if len(r) == 3 else r[1]
        print(f"  {name:20s} {r[0]:7.2f} ({r[0] / p_fwd:4.2f}x) {own:8.2f} ({own / p_grad:5.2f}x) {pv:9.2f} ({pv / p_grad:4.2f}x) {dec[name]:8.2f} ({dec[name] / dec['plain']:4.2f}x)")
    sys.stdout.flush()
