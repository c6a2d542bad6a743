"""The demo's warm-up: its config, and the A = 1 policy gradient of its batches equal to the cross-entropy gradient."""

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cisjax import sharding
from cisjax.data import PromptFormatter
from cisjax.demo import model as demo_model
from cisjax.demo import sft, task
from cisjax.demo.warmup import warmup_config
from cisjax.models import hf_io
from cisjax.train import step as step_lib
from tests.support.runs import spec_of


def _tiny(tok_dir):
    """A random cisjax model of the demo's config, the warm-up config, a single-device mesh and an SFT batch."""
    cfg = warmup_config()
    fmt = PromptFormatter(tok_dir)
    hf = demo_model.model_config(len(fmt.tokenizer), fmt.tokenizer.eos_token_id, fmt.tokenizer.pad_token_id)
    model = hf_io.init_model(hf, hf_io.model_config(hf, **spec_of(cfg).runtime.model_kwargs()), seed=0)
    mesh = sharding.make_mesh({}, jax.devices()[:1])
    rules = sharding.rules_from_config({})
    rows = task.make_task(0, heldout=8)[0][:6]
    arrays = sft.sft_arrays(fmt, rows)
    return cfg, fmt, model, mesh, rules, arrays


@pytest.mark.slow  # three compiles of the demo model (rescoring, the step's loss gradient, cross-entropy's)
def test_a1_policy_gradient_is_cross_entropy_gradient(tok_dir):
    cfg, _, model, mesh, rules, arrays = _tiny(tok_dir)
    graphdef, params = nnx.split(model, nnx.Param)
    batch = sft.sft_batch(arrays, np.arange(6))
    prox = np.asarray(step_lib.make_rescore(graphdef, spec_of(cfg).step, mesh, rules)(params, batch))
    batch = sft.sft_batch(arrays, np.arange(6), prox)
    assert (
        np.allclose(batch.prox_logprobs_MxBxT, batch.infer_logprobs_MxBxT)
        and batch.advantages_MxBxT.sum() == batch.loss_mask_MxBxT.sum()
    )
    mb = type(batch)(*(None if x is None else x[0] for x in batch))  # the [B, T] micro-batch the step's loss sees
    loss_fn = step_lib.make_loss_fn(graphdef, spec_of(cfg).step, mesh, rules)
    denominator = float(mb.loss_mask_MxBxT.sum())
    g_pg, aux = jax.jit(jax.grad(loss_fn, has_aux=True))(params, mb, denominator)

    def cross_entropy(p):
        m = nnx.merge(graphdef, p)
        logits = m.logits(m(mb.tokens_MxBxT, mb.positions_MxBxT, mb.segment_ids_MxBxT).hidden_BxLxD)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, mb.targets_MxBxT)
        return jnp.sum(jnp.where(mb.loss_mask_MxBxT, ce, 0.0)) / denominator

    ce, g_ce = jax.jit(jax.value_and_grad(cross_entropy))(params)
    assert float(aux["loss"]) == pytest.approx(-1.0, abs=1e-6)  # -A * ratio, token mean
    assert float(ce) == pytest.approx(-prox[0][mb.loss_mask_MxBxT].mean(), rel=1e-5)
    flat_pg, flat_ce = jax.tree.leaves(g_pg), jax.tree.leaves(g_ce)
    assert len(flat_pg) == len(flat_ce) > 10
    for a, b in zip(flat_pg, flat_ce):
        a, b = np.asarray(a), np.asarray(b)
        assert np.abs(b).max() > 0
        np.testing.assert_allclose(a, b, atol=1e-6 + 1e-4 * np.abs(b).max(), rtol=1e-4)
