import jax, jax.numpy as jnp, numpy as np
rng = np.random.default_rng(0)
f = jax.jit(lambda x, w: jnp.einsum("md,dv->mv", x, w, preferred_element_type=jnp.float32))
for dt in (jnp.float32, jnp.bfloat16):
  for D, V in ((32, 97), (64, 128), (512, 2048), (2048, 1024)):
    x = jnp.asarray(rng.standard_normal((2048, D)), dt)
    w = jnp.asarray(rng.standard_normal((D, V)), dt)
    ref = np.asarray(f(x, w))
    res = {}
    for m in (40, 48, 56, 63, 64, 65, 100, 777, 1024, 2048):
        for off in (0, 5):
            y = np.asarray(f(x[off:off+m], w))
            res[(m, off)] = round(float(np.mean(y == ref[off:off+m])), 3)
    print(jnp.dtype(dt).name, D, V, res)
