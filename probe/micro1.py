import jax, jax.numpy as jnp, numpy as np
rng = np.random.default_rng(0)
def rowinv(D, V, dt, ms=(1,2,3,4,7,8,12,16,32,64,128,256)):
    x = jnp.asarray(rng.standard_normal((256, D)), dt)
    w = jnp.asarray(rng.standard_normal((D, V)), dt)
    f = jax.jit(lambda x, w: jnp.einsum("md,dv->mv", x, w, preferred_element_type=jnp.float32))
    ref = np.asarray(f(x, w))
    out = {}
    for m in ms:
        y = np.asarray(f(x[:m], w))
        out[m] = float(np.mean(y == ref[:m]))
    # row position: the row placed at index 5 of 8 vs alone
    return out
for dt in (jnp.float32, jnp.bfloat16):
    for D, V in ((32, 97), (64, 97), (48, 56), (256, 1024), (1024, 1024)):
        print(jnp.dtype(dt).name, D, V, rowinv(D, V, dt))
