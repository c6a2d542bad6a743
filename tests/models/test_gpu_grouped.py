"""cisjax.models.gpu_grouped's Triton kernels (traced here, run on GPUs): every matmul inside them asks for full
precision, so fp32 blocks are not multiplied in TF32 (Triton's default on a GPU)."""

import jax
import jax.numpy as jnp
import numpy as np

from cisjax.models import gpu_grouped
from tests.helpers import jaxpr_dots


def test_every_kernel_matmul_is_full_precision():
    x_RxK = jnp.ones((40, 32), jnp.float32)
    w_GxKxN = jnp.ones((3, 32, 48), jnp.float32)
    sizes_G = jnp.array([10, 0, 30], jnp.int32)

    def loss(x, w):
        return jnp.sum(gpu_grouped.gmm(x, w, sizes_G, True) ** 2)

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x_RxK, w_GxKxN).jaxpr
    dots = [eqn for eqn, inside in jaxpr_dots(jaxpr) if inside]
    assert len(dots) == 3  # the forward, the input gradient's (W transposed in the kernel), the weight gradient's
    highest = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
    assert all(eqn.params["precision"] == highest for eqn in dots), [eqn.params["precision"] for eqn in dots]
    # and the values: the interpreter's result equals a float64 reference
    got = gpu_grouped.gmm(x_RxK * 0.5, w_GxKxN, sizes_G, True)
    want = np.concatenate([np.full((10, 48), 16.0), np.full((30, 48), 16.0)])
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=0)
