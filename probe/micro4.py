import jax, jax.numpy as jnp, numpy as np
from jax import lax
rng = np.random.default_rng(0)
def tiled(x, w, mt):
    n = x.shape[0]
    xs = x.reshape(n // mt, mt, x.shape[1])
    return lax.map(lambda t: jnp.dot(t, w, preferred_element_type=jnp.float32), xs).reshape(n, -1)
for dt in (jnp.float32, jnp.bfloat16):
  for D, V in ((32, 97), (64, 128), (256, 1024)):
    x = jnp.asarray(rng.standard_normal((1024, D)), dt); w = jnp.asarray(rng.standard_normal((D, V)), dt)
    for mt in (8, 16, 64):
        ref = np.asarray(jax.jit(tiled, static_argnums=2)(x, w, mt))
        # the same rows, shifted within tiles (position dependence) and fewer tiles
        res = []
        for n, off in ((mt, 0), (mt, 3), (4 * mt, 1), (256, 7)):
            y = np.asarray(jax.jit(tiled, static_argnums=2)(x[off:off + n], w, mt))
            res.append(round(float(np.mean(y == ref[off:off + n])), 3))
        # a single row padded to a tile
        one = jnp.zeros((mt, D), dt).at[0].set(x[9])
        y1 = np.asarray(jax.jit(tiled, static_argnums=2)(one, w, mt))[0]
        res.append(bool(np.all(y1 == ref[9])))
        print(jnp.dtype(dt).name, D, V, "mt", mt, res)
# elementwise-mul + reduce formulation
f = jax.jit(lambda x, w: jnp.sum(x[:, :, None].astype(jnp.float32) * w[None].astype(jnp.float32), axis=1))
for D, V in ((32, 97), (64, 128)):
    x = jnp.asarray(rng.standard_normal((512, D)), jnp.float32); w = jnp.asarray(rng.standard_normal((D, V)), jnp.float32)
    ref = np.asarray(f(x, w))
    print("mulreduce", D, V, [round(float(np.mean(np.asarray(f(x[:m], w)) == ref[:m])), 3) for m in (1, 2, 3, 16, 64, 511)])
    # and vs a sequential numpy sum order
    seq = np.zeros((512, V), np.float32)
    xn, wn = np.asarray(x), np.asarray(w)
    for k in range(D): seq = (seq + xn[:, k:k+1] * wn[k:k+1]).astype(np.float32)
    print("  == sequential k order:", float(np.mean(seq == ref)))
