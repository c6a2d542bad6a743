"""rollout.exact's trainer forward: the exact path's logprobs, bit for bit, with the plain forward's gradient."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from cisjax import exact_forward, forward
from tests.support import steps as U
from tests.support.runs import spec_of


def test_exact_forward_values_exact_gradient_plain():
    cfg = U.make_cfg()
    mesh = U.mesh_for("single")
    graphdef, _, rules, state = U.build(cfg, mesh)
    params = state.params
    batch = U.host_batch()
    tok, pos, seg, tgt = (np.asarray(a[0]) for a in batch[:4])  # the first micro-batch [B, T]
    w_BxT = jnp.asarray(np.random.default_rng(0).standard_normal(tok.shape), jnp.float32)
    kw = dataclasses.replace(spec_of(cfg).step, exact=False).forward_kwargs()

    def value_and_grad(fwd):
        def loss(p):
            lp = fwd(p, tok, pos, seg, tgt).stats.logprobs_N
            return jnp.sum(w_BxT * lp), lp

        return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

    (_, lp_plain), g_plain = value_and_grad(forward.make_forward(graphdef, mesh, rules, **kw))
    (_, lp_exact), g_exact = value_and_grad(forward.make_forward(graphdef, mesh, rules, **{**kw, "exact": True}))
    want = jax.jit(
        lambda p: exact_forward.exact_value(graphdef, mesh, rules, kw["temperature"], p, tok, pos, tgt, None)
    )
    # the value: the exact path's (what the exact sampler's q equals), not the plain forward's
    np.testing.assert_array_equal(np.asarray(lp_exact), np.asarray(want(params)))
    on = seg > 0  # the sequences' positions (padding attends otherwise in the plain forward: its own segment)
    assert np.mean(np.asarray(lp_exact)[on] == np.asarray(lp_plain)[on]) < 1.0
    np.testing.assert_allclose(np.asarray(lp_exact)[on], np.asarray(lp_plain)[on], rtol=0, atol=1e-5)
    # the gradient: the plain forward's (its VJP with the same cotangent; XLA fuses it in another program: to rounding)
    for a, b in zip(jax.tree.leaves(g_exact), jax.tree.leaves(g_plain)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
