"""cisjax.models.exact (issue 49 prototype): the batch-invariant KV-cache decode's q equals the batch-invariant
forward's p bit for bit, whatever the trainer's batch (other rows, their order, its length T), under
differentiation too; and one reduction done in another order breaks it."""

import functools

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cisjax.engines.jax.sampling import sampling_logprobs
from cisjax.models import exact, hf_io

SLOTS, NEW = 64, 12


def _run(tiny_hf_dir, dtype):
    model, _, _ = hf_io.load(tiny_hf_dir("qwen2"), dtype=dtype, param_dtype="float32")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 90, int(rng.integers(2, 12))).tolist() for _ in range(5)]
    toks, q = exact.sample(model, prompts, NEW, jax.random.key(0), slots=SLOTS)
    return model, prompts, np.asarray(toks), np.asarray(q), rng


def _batch(prompts, toks, order, extra, t, rng):
    rows = [prompts[i] + toks[i].tolist() for i in order]
    rows += [rng.integers(2, 90, int(rng.integers(3, t))).tolist() for _ in range(extra)]
    tokens, targets = np.zeros((len(rows), t), np.int32), np.zeros((len(rows), t), np.int32)
    for b, r in enumerate(rows):
        tokens[b, : len(r)] = r
        targets[b, : len(r) - 1] = r[1:]
    return tokens, np.broadcast_to(np.arange(t, dtype=np.int32), tokens.shape), targets


def _response_p(p, prompts, order):
    return np.concatenate([p[b, len(prompts[i]) - 1 : len(prompts[i]) - 1 + NEW] for b, i in enumerate(order)])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_q_equals_forward_p_bitwise(tiny_hf_dir, dtype):
    model, prompts, toks, q, rng = _run(tiny_hf_dir, dtype)
    forward = jax.jit(exact.exact_forward, static_argnames=("slots",))
    for order, extra, t in (([0, 1, 2, 3, 4], 0, 32), ([4, 2, 0, 1, 3], 3, 64), ([3, 1], 6, 40)):
        tokens, positions, targets = _batch(prompts, toks, order, extra, t, rng)
        p = _response_p(np.asarray(forward(model, tokens, positions, targets, slots=SLOTS)), prompts, order)
        np.testing.assert_array_equal(p, q[order].reshape(-1))
    # as a train step computes it: inside value_and_grad, p as the loss's aux
    tokens, positions, targets = _batch(prompts, toks, range(5), 0, 32, rng)
    graphdef, params = nnx.split(model)

    def loss(params):
        lp = exact.exact_forward(nnx.merge(graphdef, params), tokens, positions, targets, slots=SLOTS)
        return jnp.sum(lp), lp

    (_, p), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    np.testing.assert_array_equal(_response_p(np.asarray(p), prompts, range(5)), q.reshape(-1))
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


def test_one_reduction_in_another_order_breaks_it(tiny_hf_dir):
    """The trainer's attention over 40 key slots instead of the decode's 64 (the softmax's sum and the values' matmul
    over S in another order: the masked slots alone differ) and the sampler's own log_softmax instead of the
    trainer's z - logsumexp(z): each alone leaves most tokens' q != p (by an ulp or so)."""
    model, prompts, toks, q, rng = _run(tiny_hf_dir, "float32")
    tokens, positions, targets = _batch(prompts, toks, range(5), 0, 32, rng)
    forward = jax.jit(exact.exact_forward, static_argnames=("slots",))
    same = _response_p(np.asarray(forward(model, tokens, positions, targets, slots=SLOTS)), prompts, range(5))
    np.testing.assert_array_equal(same, q.reshape(-1))
    other_s = _response_p(np.asarray(forward(model, tokens, positions, targets, slots=40)), prompts, range(5))
    assert np.mean(other_s == q.reshape(-1)) < 0.9
    np.testing.assert_allclose(other_s, q.reshape(-1), rtol=0, atol=1e-5)
    # the sampler's formula on the decode's own logits
    cache = exact.init_cache(model, 5, SLOTS)
    z, lp, _ = jax.jit(functools.partial(exact.exact_step))(
        model, cache, jnp.asarray(tokens[:, 0]), jnp.zeros(5, jnp.int32)
    )
    ones = jnp.ones(5)
    theirs = sampling_logprobs(z, ones, jnp.zeros(5, jnp.int32), ones, jnp.zeros(5, bool))
    assert np.mean(np.asarray(theirs) == np.asarray(lp)) < 0.9
