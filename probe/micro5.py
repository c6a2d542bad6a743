import jax, jax.numpy as jnp, numpy as np
rng = np.random.default_rng(0)
x = jnp.asarray(rng.standard_normal((2048, 97)) * 3, jnp.float32)
fns = {
 "sum": lambda a: jnp.sum(a, -1),
 "lse": lambda a: jax.nn.logsumexp(a, -1),
 "logsoftmax": lambda a: jax.nn.log_softmax(a, -1),
 "rms": lambda a: a * jax.lax.rsqrt(jnp.mean(a * a, -1, keepdims=True) + 1e-6),
 "softmax": lambda a: jax.nn.softmax(a, -1),
}
for V in (97, 64, 1000):
  xv = jnp.asarray(rng.standard_normal((2048, V)) * 3, jnp.float32)
  for name, f in fns.items():
    jf = jax.jit(f); ref = np.asarray(jf(xv))
    print(V, name, [round(float(np.mean(np.asarray(jf(xv[:m])) == ref[:m])), 3) for m in (1, 2, 3, 16, 17, 100, 1000)])
# batched dot: per-batch element result vs batch count
for (m, k, n) in ((8, 16, 16), (8, 32, 32), (16, 16, 64), (1, 16, 32)):
  a = jnp.asarray(rng.standard_normal((512, m, k)), jnp.float32); b = jnp.asarray(rng.standard_normal((512, k, n)), jnp.float32)
  f = jax.jit(lambda a, b: jnp.einsum("bmk,bkn->bmn", a, b))
  ref = np.asarray(f(a, b))
  print("bdot", m, k, n, [round(float(np.mean(np.asarray(f(a[:c], b[:c])) == ref[:c])), 3) for c in (1, 2, 7, 64, 511)])
