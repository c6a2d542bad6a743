"""Cost of the exact path on this CPU (issue 49, phase 2): per family, the trainer's forward (and forward + backward)
at a demo-like micro-batch and one decode step, plain vs exact (attention over all slots / in key blocks; MoE experts
gathered per token / dense over all experts). Median of 3 calls after a warm-up; prints the load average.

usage: python probe/exact_cost2.py FAMILIES [DTYPE] [B T R]"""
import sys, tempfile, time
import numpy as np, jax, jax.numpy as jnp, flax.nnx as nnx
from probe.exact_probe import model_dir_of
from cisjax import logprobs
from cisjax.models import hf_io, exact

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


def load():
    return open("/proc/loadavg").read().split()[0]


for fam in fams:
    model, _, _ = hf_io.load(model_dir_of(fam, tempfile.mkdtemp()), dtype=dtype, param_dtype="float32")
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(0)
    tok = jnp.asarray(rng.integers(2, 90, (B, T)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    tgt = jnp.roll(tok, -1, 1)

    def plain(params):
        m = nnx.merge(graphdef, params)
        h = m(tok, pos).hidden_BxLxD
        return logprobs.token_logprobs(h, m.unembedding_DxV(), tgt, chunk_size=1024).logprobs_N

    def ex(block, impl):
        return lambda params: exact.exact_forward(
            nnx.merge(graphdef, params), tok, pos, tgt, slots=S, block=block, moe_impl=impl
        )

    variants = {"plain": plain, "exact_all": ex(None, "gather"), "exact_b16": ex(16, "gather"), "exact_b32": ex(32, "gather")}
    if fam in ("demo", "qwen2_moe"):
        variants["exact_b32_dense_moe"] = ex(32, "dense")
    res = {}
    for name, f in variants.items():
        fwd = jax.jit(f)
        grad = jax.jit(jax.grad(lambda p, f=f: jnp.sum(f(p))))
        res[name] = (med(fwd, params), med(grad, params))
    # decode step: R rows at position T // 2 over S slots
    r_tok = jnp.asarray(rng.integers(2, 90, (R,)), jnp.int32)
    r_pos = jnp.full((R,), T // 2, jnp.int32)
    cache = model.init_cache(R, S)
    valid = jnp.arange(S)[None] <= r_pos[:, None]

    def plain_step(params, cache):
        m = nnx.merge(graphdef, params)
        out, cache = m.cached(r_tok[:, None], r_pos[:, None], cache, r_pos, valid)
        w = m.unembedding_DxV().astype(m.cfg.dtype)
        z = jnp.einsum("bd,dv->bv", out.hidden_BxLxD[:, 0].astype(m.cfg.dtype), w, preferred_element_type=jnp.float32)
        return jax.nn.log_softmax(z, -1), cache

    def ex_step(block, impl):
        def f(params, cache):
            z, lse, cache = exact.exact_step(nnx.merge(graphdef, params), cache, r_tok, r_pos, block=block, moe_impl=impl)
            return z - lse[:, None], cache
        return f

    ecache = exact.init_cache(model, R, S)
    dec = {"plain": med(jax.jit(plain_step), params, cache)}
    for name, blk, impl in (("exact_all", None, "gather"), ("exact_b16", 16, "gather"), ("exact_b32", 32, "gather"), ("exact_b32_dense_moe", 32, "dense")):
        if impl == "dense" and fam not in ("demo", "qwen2_moe"):
            continue
        dec[name] = med(jax.jit(ex_step(blk, impl)), params, ecache)
    print(f"## {fam} {dtype} B={B} T={T} S={S} R={R} load={load()}")
    for name, (fw, gr) in res.items():
        print(f"  forward {name:22s} {fw:8.2f} ms ({fw / res['plain'][0]:.2f}x)   grad {gr:8.2f} ms ({gr / res['plain'][1]:.2f}x)   decode step {dec.get(name, float('nan')):7.2f} ms ({dec.get(name, float('nan')) / dec['plain']:.2f}x)")
    sys.stdout.flush()
