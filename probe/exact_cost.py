"""Rough cost of the prototype on tiny Qwen2 (fp32): exact_forward vs the model's forward at [12, 64]; exact_step vs
model.cached decode step at 16 rows over 64 slots (median of 20 calls after compile)."""
import tempfile, time, numpy as np, jax, jax.numpy as jnp
from probe.exact_probe import model_dir_of
from cisjax.models import hf_io, exact
model, cfg, _ = hf_io.load(model_dir_of("qwen2", tempfile.mkdtemp()), dtype="float32", param_dtype="float32")
def med(f, *a):
    jax.block_until_ready(f(*a)); ts = []
    for _ in range(20):
        t = time.perf_counter(); jax.block_until_ready(f(*a)); ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e3
B, T = 12, 64
tok = jnp.asarray(np.random.default_rng(0).integers(2, 90, (B, T)), jnp.int32); pos = jnp.broadcast_to(jnp.arange(T), (B, T))
base = jax.jit(lambda m, t, p: m.logits(m(t, p).hidden_BxLxD))
ex = jax.jit(lambda m, t, p: exact.exact_forward(m, t, p, t, slots=T))
print("forward ms: model", med(base, model, tok, pos), "exact", med(ex, model, tok, pos))
R = 16
cache = model.init_cache(R, T); valid = jnp.ones((R, T), bool)
dec = jax.jit(lambda m, c, t, i: m.cached(t[:, None], i[:, None], c, i, valid))
ecache = exact.init_cache(model, R, T)
edec = jax.jit(exact.exact_step)
i = jnp.full((R,), 30, jnp.int32); t = tok[:, 0].repeat(2)[:R]
print("decode step ms: model.cached", med(dec, model, cache, t, i), "exact_step", med(edec, model, ecache, t, i))
