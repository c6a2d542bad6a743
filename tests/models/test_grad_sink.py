"""In-place gradient accumulation: each layer's gradient lands in its row of the carried sum; a bfloat16 sum is
stochastically rounded (unbiased) where rounding to nearest would lose the gradient."""

import jax
import jax.numpy as jnp
import numpy as np

from cisjax.models import grad_sink


def _accumulate(acc_NxD, c_NxD, key):
    """acc + the gradient of sum_j <w_j, c_j> w.r.t. the layers' weights w (whose gradient is c), taken as the train
    step does: the layers' scan carries the sum through grad_sink.into_layer, differentiated with its cotangent
    seeded with the sum so far."""
    w_NxD = jnp.zeros_like(c_NxD)

    def forward(acc_NxD):
        def layer(carry, xs):
            total, acc = carry
            w_D, c_D, j = xs
            state, acc = grad_sink.into_layer({"w": w_D}, {"w": acc}, j, key)
            return (total + jnp.sum(state["w"] * c_D), acc["w"]), None

        (total, acc_NxD), _ = jax.lax.scan(layer, (0.0, acc_NxD), (w_NxD, c_NxD, jnp.arange(c_NxD.shape[0])))
        return total, acc_NxD

    (total, _), pullback = jax.vjp(forward, acc_NxD)
    (new,) = pullback((jnp.ones_like(total), acc_NxD))
    return new


def test_each_layers_gradient_lands_in_its_row():
    """fp32 sum: acc + c exactly (values with few bits), each layer in its own row."""
    acc = jnp.array([[1.0, 2.0], [-3.0, 0.5], [0.0, 8.0]], jnp.float32)
    c = jnp.array([[0.25, -1.0], [2.0, 0.125], [-4.0, 1.5]], jnp.float32)
    out = jax.jit(_accumulate, static_argnums=2)(acc, c, None)
    np.testing.assert_array_equal(np.asarray(out), [[1.25, 1.0], [-1.0, 0.625], [-4.0, 9.5]])


def test_a_bf16_sum_is_unbiased_where_rounding_to_nearest_loses_everything():
    """1 + 64 gradients of 2^-10 in a bfloat16 sum (gap 2^-7 at 1): rounded to nearest, each 1 + 2^-10 rounds back to
    1 and the sum never moves; stochastically rounded, the mean over 2 x 4,096 sums is 1 + 64 / 1024 = 1.0625 (to
    4 sigma: each addition adds at most a gap's Bernoulli noise, so a sum's standard deviation is at most 2^-7 * 8 / 2).
    The two layers' rows draw different bits (their key folds in the layer)."""
    n, d, adds, g = 2, 4096, 64, 2.0**-10
    c = jnp.full((n, d), g, jnp.float32)
    base = jax.random.key_data(jax.random.key(3))
    step = jax.jit(lambda acc, key: _accumulate(acc, c, key))
    nearest, stochastic = jnp.ones((n, d), jnp.bfloat16), jnp.ones((n, d), jnp.bfloat16)
    for m in range(adds):
        nearest = jax.jit(lambda acc: _accumulate(acc, c, None))(nearest)
        stochastic = step(stochastic, grad_sink.fold(base, m))
    assert nearest.dtype == stochastic.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(nearest, np.float32), 1.0)
    s = np.asarray(stochastic, np.float64)
    sigma = 2.0**-7 * np.sqrt(adds) / 2 / np.sqrt(n * d)
    assert abs(s.mean() - (1 + adds * g)) < 4 * sigma, s.mean()
    assert not np.array_equal(s[0], s[1])


def test_add_rounds_only_a_bf16_sum_with_a_key():
    """add: an fp32 sum adds as such (key or not); a bf16 sum without a key rounds to nearest."""
    key = jax.random.key_data(jax.random.key(0))
    x = jnp.float32(1.0)
    assert grad_sink.add(x, jnp.float32(2.0**-20), key) == 1.0 + 2.0**-20
    assert grad_sink.add(x.astype(jnp.bfloat16), jnp.float32(2.0**-10), None) == 1.0
    assert grad_sink.fold(None, 1, 2) is None
