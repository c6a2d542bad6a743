"""cisjax.models.gpu_grouped's Triton kernels (traced here, run on GPUs): every matmul inside them asks for full
precision, so fp32 blocks are not multiplied in TF32 (Triton's default on a GPU)."""

import jax
import jax.numpy as jnp
import numpy as np

from cisjax.models import gpu_grouped
from tests.support.programs import jaxpr_dots, jaxpr_eqns


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


def test_a_layer_of_a_stack_is_read_in_place():
    """W as stacked.LayerOf (a layer of an expert stack, a GPU decode's): the kernel takes the whole stack and the
    layer and reads the layer's groups, cast to x's dtype on its loads (an fp32 stack in a bf16 step); W whose
    dimensions need padding is sliced out first. Each equals gmm of the layer sliced out."""
    from cisjax.models import stacked

    rng = np.random.default_rng(0)
    sizes_G = jnp.array([10, 0, 30], jnp.int32)
    for n_dim, x_dtype in ((48, jnp.float32), (48, jnp.bfloat16), (40, jnp.float32)):  # 40: padded to 48
        x_RxK = jnp.asarray(rng.normal(size=(40, 32)), x_dtype)
        stack_nxGxKxN = jnp.asarray(rng.normal(size=(4, 3, 32, n_dim)), jnp.float32)
        layer = jnp.int32(2)
        view = stacked.LayerOf(stack_nxGxKxN, layer).astype(x_dtype)
        got = gpu_grouped.gmm(x_RxK, view, sizes_G, True)
        want = gpu_grouped.gmm(x_RxK, stack_nxGxKxN[2].astype(x_dtype), sizes_G, True)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
        kernels = [
            e
            for e, _ in jaxpr_eqns(jax.make_jaxpr(gpu_grouped.gmm, static_argnums=3)(x_RxK, view, sizes_G, True).jaxpr)
            if e.primitive.name == "pallas_call"
        ]
        shapes = [v.aval.shape for v in kernels[0].invars]
        assert (stack_nxGxKxN.shape in shapes) == (n_dim == 48), shapes
