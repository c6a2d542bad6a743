"""cisjax.engines.jax.sampling against hand-computed distributions, and the draw's frequencies against them."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cisjax.engines.jax.sampling import block_width, draw, key_data, sampling_logprobs

NEG = -math.inf


def _lp(logits, temperature=1.0, top_k=0, top_p=1.0, greedy=False):
    out = sampling_logprobs(
        jnp.asarray([logits], jnp.float32),
        jnp.asarray([temperature], jnp.float32),
        jnp.asarray([top_k], jnp.int32),
        jnp.asarray([top_p], jnp.float32),
        jnp.asarray([greedy]),
    )
    return np.asarray(out[0], np.float64)


def _log_normalised(weights):
    total = sum(w for w in weights)
    return [math.log(w / total) if w else NEG for w in weights]


def test_temperature_divides_the_logits():
    e = math.exp
    want = _log_normalised([e(2 / 0.5), e(1 / 0.5), e(0 / 0.5)])
    np.testing.assert_allclose(_lp([2.0, 1.0, 0.0], temperature=0.5), want, atol=1e-6)


def test_top_k_keeps_ties():
    # k = 1 with two tokens at the top: both kept, half each; the rest -inf
    np.testing.assert_allclose(_lp([1.0, 1.0, 0.0, -1.0], top_k=1), [math.log(0.5)] * 2 + [NEG] * 2, atol=1e-6)
    # k = 2 keeps the two best of distinct logits; k = 0 and k >= V keep everything
    e = math.exp
    np.testing.assert_allclose(_lp([3.0, 1.0, 2.0], top_k=2), _log_normalised([e(3), 0, e(2)]), atol=1e-6)
    for k in (0, 3, 7):
        np.testing.assert_allclose(_lp([3.0, 1.0, 2.0], top_k=k), _log_normalised([e(3), e(1), e(2)]), atol=1e-6)


def test_top_p_keeps_the_tokens_whose_mass_above_is_below_p():
    e = math.exp
    z = e(2) + e(1) + e(0)
    p0, p1 = e(2) / z, e(1) / z  # 0.665, 0.245: mass above the tokens 0, 0.665, 0.910
    np.testing.assert_allclose(_lp([2.0, 1.0, 0.0], top_p=0.5), [0.0, NEG, NEG], atol=1e-6)  # the best token always
    np.testing.assert_allclose(_lp([2.0, 1.0, 0.0], top_p=0.7), _log_normalised([p0, p1, 0]), atol=1e-6)
    np.testing.assert_allclose(_lp([2.0, 1.0, 0.0], top_p=0.95), _log_normalised([p0, p1, e(0) / z]), atol=1e-6)


def test_top_p_acts_on_the_distribution_after_temperature_and_top_k():
    # temperature 0.5 -> logits [4, 2, 0, -2]; top-k 3 drops the last; top-p 0.9 on the renormalised three
    e = math.exp
    w = [e(4), e(2), e(0)]
    q = [x / sum(w) for x in w]  # 0.867, 0.117, 0.016: mass above 0, 0.867, 0.984 -> the first two
    want = _log_normalised([q[0], q[1], 0, 0])
    np.testing.assert_allclose(_lp([2.0, 1.0, 0.0, -1.0], temperature=0.5, top_k=3, top_p=0.9), want, atol=1e-6)


def test_greedy_is_the_unfiltered_temperature_one_distribution():
    e = math.exp
    want = _log_normalised([e(2), e(1), e(0)])
    np.testing.assert_allclose(_lp([2.0, 1.0, 0.0], temperature=0.3, top_k=1, top_p=0.1, greedy=True), want, atol=1e-6)


def test_rows_take_their_own_parameters():
    logits = jnp.asarray([[2.0, 1.0, 0.0]] * 3)
    out = np.asarray(
        sampling_logprobs(
            logits,
            jnp.asarray([1.0, 1.0, 1.0]),
            jnp.asarray([1, 0, 0]),
            jnp.asarray([1.0, 0.7, 1.0]),
            jnp.asarray([False, False, True]),
        )
    )
    assert np.isfinite(out[0]).sum() == 1 and np.isfinite(out[1]).sum() == 2 and np.isfinite(out[2]).all()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 4, 1.0), (1.3, 0, 0.8), (0.8, 5, 0.9)])
def test_draw_frequencies_match_the_distribution(temperature, top_k, top_p):
    """20,000 draws from a 6-token vocabulary: each token's count within 5 standard errors of the hand-computed
    probability (a wrong temperature, top-k or top-p order moves some token by far more)."""
    logits = [1.5, 1.2, 0.4, 0.3, -0.5, -2.0]
    x = [v / temperature for v in logits]
    order = sorted(range(6), key=lambda i: -x[i])
    keep = set(order[:top_k]) if top_k else set(range(6))
    w = [math.exp(x[i]) if i in keep else 0.0 for i in range(6)]
    probs = [v / sum(w) for v in w]
    above, kept = 0.0, set()
    for i in order:
        if probs[i] > 0 and above < top_p:
            kept.add(i)
        above += probs[i]
    w = [probs[i] if i in kept else 0.0 for i in range(6)]
    want = np.array([v / sum(w) for v in w])

    n = 20_000
    lp_NxV = sampling_logprobs(
        jnp.asarray([logits] * n, jnp.float32),
        jnp.full((n,), temperature, jnp.float32),
        jnp.full((n,), top_k, jnp.int32),
        jnp.full((n,), top_p, jnp.float32),
        jnp.zeros((n,), bool),
    )
    keys = jax.random.split(jax.random.key(0), n)
    counts = np.bincount(np.asarray(draw(keys, lp_NxV, jnp.zeros((n,), bool))), minlength=6)
    se = np.sqrt(n * want * (1 - want)) + 1e-9
    assert np.all(np.abs(counts - n * want) <= 5 * se + (want == 0) * 0), (counts, n * want)
    assert np.all(counts[want == 0] == 0)


@pytest.mark.parametrize(("v", "width"), [(1, 1), (6, 4), (1000, 32), (8192, 128), (151_936, 512)])
def test_block_width_is_the_power_of_two_at_or_above_sqrt_v(v, width):
    assert block_width(v) == width


def test_draw_over_many_blocks_matches_the_distribution():
    """V = 1,000: 32 blocks of 32, the last padded; whole blocks filtered out, mass spread from 0.3 to 1e-3 over
    tokens in different blocks, the rest a flat tail. Each token's count within 5 sigma of n p; filtered tokens never."""
    v, n = 1000, 40_000
    probs = np.zeros(v)
    probs[[3, 40, 500, 999]] = [0.3, 0.2, 0.1, 0.05]  # blocks 0, 1, 15, 31 (the padded one)
    tail = np.r_[64:128, 700:900]  # blocks 2-3 and 21-28: 264 tokens
    probs[tail] = (1 - probs.sum()) / len(tail)
    lp_V = np.where(probs > 0, np.log(np.where(probs > 0, probs, 1)), NEG).astype(np.float32)
    keys = jax.random.split(jax.random.key(7), n)
    tokens = np.asarray(draw(keys, jnp.asarray(np.tile(lp_V, (n, 1))), jnp.zeros((n,), bool)))
    counts = np.bincount(tokens, minlength=v)
    want = n * probs
    se = np.sqrt(want * (1 - probs))
    assert np.all(np.abs(counts - want) <= 5 * se + 1e-9), np.flatnonzero(np.abs(counts - want) > 5 * se)
    assert counts[probs == 0].sum() == 0
    # the tail's tokens together (0.35): within 1% of their share
    assert abs(counts[tail].sum() / n - probs[tail].sum()) < 0.01


def test_greedy_draw_is_the_first_best_token_across_blocks():
    """Greedy rows (their keys unused): the first index of the largest logprob, ties in two blocks and in one block."""
    v = 100  # blocks of 16, the last padded
    lp = np.full((3, v), -5.0, np.float32)
    lp[0, [20, 70]] = -0.1  # a tie across blocks 1 and 4: the first
    lp[1, [66, 67]] = -0.2  # a tie in block 4
    lp[2, 99] = -0.3  # in the padded block
    keys = jax.random.split(jax.random.key(0), 3)
    tokens = np.asarray(draw(keys, jnp.asarray(lp), jnp.ones((3,), bool)))
    np.testing.assert_array_equal(tokens, [20, 66, 99])


def test_key_data_keeps_all_64_bits():
    np.testing.assert_array_equal(key_data((7 << 32) | 9), [7, 9])
    assert not np.array_equal(key_data(1 << 40), key_data(0))
