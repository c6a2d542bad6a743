"""AdamW with bfloat16 moments: stochastic rounding to bfloat16, the update against fp32 Adam, the config's choice."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cisjax.train import optim

BF16_GAP_AT_1 = 2.0**-7  # bfloat16 keeps 7 mantissa bits: 1, 1 + 2^-7, ...


def _spec(**kw) -> optim.OptimSpec:
    base = dict(lr=0.1, weight_decay=0.0, b1=0.9, b2=0.999, eps=1e-8, grad_clip=0.0)
    return optim.OptimSpec(**{**base, **kw})


def test_first_update_is_fp32_adams_and_the_moments_are_stored_in_bf16():
    """Adam's first step is -lr * g / (|g| + eps) (bias correction undoes (1 - b1) and (1 - b2)); the bf16 state
    computes it from fp32 moments, so it is the fp32 update, and it stores mu = 0.1 g and nu = 0.001 g^2 rounded to a
    bfloat16 neighbour."""
    g = jnp.array([0.5, -2.0, 3e-3], jnp.float32)
    params = {"w": jnp.zeros(3, jnp.float32)}
    tx = optim.make_optimizer(_spec(optimizer_state_dtype="bfloat16"))
    state = tx.init(params)
    adam = state[0]
    assert adam.mu["w"].dtype == jnp.bfloat16 and adam.nu["w"].dtype == jnp.bfloat16
    updates, state = jax.jit(tx.update)({"w": g}, state, params)
    expected = -0.1 * np.asarray(g) / (np.abs(np.asarray(g)) + 1e-8)
    # to fp32's rounding of b1, b2 and the bias corrections (1 - 0.999 in fp32 is 1.00005e-3)
    np.testing.assert_allclose(np.asarray(updates["w"]), expected, rtol=1e-4)
    for stored, exact in ((state[0].mu["w"], 0.1 * g), (state[0].nu["w"], 0.001 * g * g)):
        exact = np.asarray(exact, np.float64)
        stored = np.asarray(stored, np.float64)
        gap = 2.0 ** (np.floor(np.log2(np.abs(exact))) - 7)  # the bfloat16 spacing at each value
        assert np.all(np.abs(stored - exact) < gap), (stored, exact)


def test_bf16_moments_follow_fp32_adamw_over_steps():
    """20 AdamW steps (weight decay on) on 4,096 parameters with random gradients, where fp32 AdamW (optax.adamw, which
    the fp32 choice is, bit for bit) moves a parameter 6 lr (median): the bf16 state's parameters stay within 0.15 lr
    of fp32's, 0.02 lr at the median (measured: 0.10 and 0.012; rounding to nearest: 0.09 and 0.009). A stored
    moment is off by less than one bfloat16 gap (2^-8 to 2^-7 of it), and where mu changes sign the error it carries
    is large next to the small new mu: hence the max."""
    steps, lr = 20, 0.1
    spec = _spec(lr=lr, weight_decay=0.01)
    grads = jax.random.normal(jax.random.key(3), (steps, 4096), jnp.float32) + 0.3
    params = {"w": jax.random.normal(jax.random.key(4), (4096,), jnp.float32)}

    def run(tx):
        def body(carry, g):
            p, s = carry
            u, s = tx.update({"w": g}, s, p)
            return (optax.apply_updates(p, u), s), None

        (p, _), _ = jax.lax.scan(body, (params, tx.init(params)), grads)
        return np.asarray(p["w"])

    reference = run(optax.adamw(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01))
    np.testing.assert_array_equal(run(optim.make_optimizer(spec)), reference)
    low = run(optim.make_optimizer(dataclasses.replace(spec, optimizer_state_dtype="bfloat16")))
    off = np.abs(low - reference) / lr
    assert np.median(np.abs(reference - np.asarray(params["w"]))) / lr > 5.0  # the scale of the comparison
    assert 0 < np.max(off) < 0.15 and np.median(off) < 0.02, (np.max(off), np.median(off))


def test_second_moment_decays_in_bf16_where_rounding_to_nearest_would_stall_it():
    """nu from 1.0 under 2,000 steps of g = 0.1: nu_t = 0.999^t + 0.01 (1 - 0.999^t) = 0.1437 at t = 2000. Each step
    changes nu by 0.1%, less than bfloat16's half-gap (2^-9): rounded to nearest it would stay at 1.0; rounded
    stochastically its mean over 1,024 parameters follows fp32 to 1%."""
    n, steps, b2 = 1024, 2000, 0.999
    tx = optim.scale_by_adam_bf16(0.9, b2, 1e-8)
    params = jnp.zeros(n, jnp.float32)
    state = tx.init(params)
    state = state._replace(nu=jnp.ones(n, jnp.bfloat16))
    g = jnp.full((n,), 0.1, jnp.float32)

    def body(s, _):
        return tx.update(g, s)[1], None

    state, _ = jax.lax.scan(body, state, None, length=steps)
    expected = b2**steps + 0.01 * (1 - b2**steps)
    assert abs(expected - 0.1437) < 1e-3
    mean = float(jnp.mean(state.nu.astype(jnp.float32)))
    assert abs(mean / expected - 1) < 0.01, (mean, expected)
    nearest = jnp.ones((), jnp.bfloat16)
    assert float((b2 * nearest.astype(jnp.float32) + (1 - b2) * 0.01).astype(jnp.bfloat16)) == 1.0  # the stall


def test_unknown_state_dtype_is_refused():
    with pytest.raises(ValueError, match="optimizer_state_dtype 'float16'"):
        optim.make_optimizer(_spec(optimizer_state_dtype="float16"))


def test_bf16_master_weights_take_the_update_by_stochastic_rounding():
    """p = 1 in bf16 plus u = 2^-10 (an eighth of bf16's gap at 1, 2^-7): rounding to nearest drops it; stochastic
    rounding moves one value in eight up a gap, so the mean is 1 + 2^-10 (to 4 sigma of 65,536 draws). fp32 params
    take optax's update exactly."""
    n, u = 65536, 2.0**-10
    params = {"w": jnp.ones((n,), jnp.bfloat16), "b": jnp.ones((3,), jnp.float32)}
    updates = {"w": jnp.full((n,), u, jnp.float32), "b": jnp.full((3,), u, jnp.float32)}
    new = optim.apply_updates(params, updates, jnp.int32(3))
    assert new["w"].dtype == jnp.bfloat16 and new["b"].dtype == jnp.float32
    assert np.all(np.asarray(optax.apply_updates(params, updates)["w"], np.float32) == 1.0)  # nearest: lost
    w = np.asarray(new["w"], np.float64)
    assert set(np.unique(w)) == {1.0, 1.0 + BF16_GAP_AT_1}
    up = np.mean(w > 1.0)
    assert abs(up - 0.125) < 4 * np.sqrt(0.125 * 0.875 / n), up
    np.testing.assert_array_equal(np.asarray(new["b"]), np.full(3, 1.0 + u, np.float32))
    # another step, another layer (salt): other random bits
    other = np.asarray(optim.apply_updates(params, updates, jnp.int32(4))["w"], np.float64)
    salted = np.asarray(optim.apply_updates(params, updates, jnp.int32(3), salt=1)["w"], np.float64)
    assert np.mean(other != w) > 0.1 and np.mean(salted != w) > 0.1


def test_bf16_master_weights_keep_the_moments_dtype_of_the_config():
    """init_view: bf16 master weights get fp32 moments (optimizer_state_dtype=float32), not optax's bf16 ones."""
    params = {"w": jnp.zeros((4,), jnp.bfloat16)}
    for dtype, want in (("float32", jnp.float32), ("bfloat16", jnp.bfloat16)):
        tx = optim.make_optimizer(_spec(optimizer_state_dtype=dtype))
        adam = tx.init(optim.init_view(params))[0]
        assert adam.mu["w"].dtype == want and adam.nu["w"].dtype == want
    fp32 = optim.make_optimizer(_spec(optimizer_state_dtype="float32"))
    assert fp32.init(params)[0].mu["w"].dtype == jnp.bfloat16  # optax's own choice, which the view avoids
    abstract = optim.init_view({"w": jax.ShapeDtypeStruct((4,), jnp.bfloat16)})
    assert abstract["w"].dtype == jnp.float32
