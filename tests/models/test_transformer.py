"""The shared decoder shell: rematerialisation (model.remat) changes what the backward pass stores, not its results."""

import re

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cisjax import errors
from cisjax.models import hf_io

REMAT = re.compile(r"\b(?:remat2?|checkpoint)\[")  # jax.checkpoint's primitive in a printed jaxpr


def _loss_and_grads(model_dir, remat):
    """value_and_grad of sum(logits * ct) w.r.t. every parameter, and the jaxpr of that function."""
    model, _, _ = hf_io.load(model_dir, remat=remat)
    graphdef, params = nnx.split(model, nnx.Param)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, model.cfg.vocab_size, (2, 12)), jnp.int32)
    ct = jnp.asarray(rng.standard_normal((2, 12, model.cfg.vocab_size)), jnp.float32)

    def loss(p):
        # one row at a time under lax.map, the model merged inside the body, as the loop's rescoring does
        def row(args):
            tokens_1xL, ct_1xLxV = args
            m = nnx.merge(graphdef, p)
            return jnp.sum(m.logits(m(tokens_1xL).hidden_BxLxD) * ct_1xLxV)

        return jnp.sum(jax.lax.map(row, (tokens[:, None], ct[:, None])))

    fn = jax.value_and_grad(loss)
    value, grads = jax.jit(fn)(params)
    return float(value), jax.tree.leaves(grads), str(jax.make_jaxpr(fn)(params))


# deepseek_v2: a dense first layer then MoE layers (two kinds of decoder block); qwen2_moe: attention with biases.
# The fast tier (make test-fast) runs qwen2_moe with full remat; CI all four.
@pytest.mark.parametrize(
    "family, remat",
    [
        pytest.param(f, r, marks=() if (f, r) == ("qwen2_moe", "full") else pytest.mark.slow)
        for f in ("deepseek_v2", "qwen2_moe")
        for r in ("minimal", "full")
    ],
)
def test_remat_policies_give_the_same_loss_and_gradients(tiny_hf_dir, family, remat):
    model_dir = tiny_hf_dir(family)
    ref_value, ref_grads, ref_jaxpr = _loss_and_grads(model_dir, "none")
    assert not REMAT.findall(ref_jaxpr)
    value, grads, jaxpr = _loss_and_grads(model_dir, remat)
    assert len(REMAT.findall(jaxpr)) >= 2  # a rematerialised block per decoder layer
    assert value == pytest.approx(ref_value, rel=1e-6)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6 * np.abs(r).max())


def test_unknown_remat_policy_is_named(tiny_hf_dir):
    model, _, _ = hf_io.load(tiny_hf_dir("qwen2_moe"), remat="some")
    with pytest.raises(errors.UserError, match="model.remat='some'"):
        model(jnp.zeros((1, 4), jnp.int32))
