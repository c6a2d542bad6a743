"""cisjax.rl.advantages against hand values and an independent numpy float64 recipe."""

from __future__ import annotations

import numpy as np
import pytest

from cisjax.rl.advantages import batch_normalize, compute_advantages, group_normalize, shape_rewards
from configs.base import get_config


def _np_recipe(rewards_GxN, mask_GxNxT, scale=10.0, bias=-0.5, group_norm=True, batch_norm=True, eps=1e-5):
    """The paper's recipe in float64 numpy: shape, group mean/unbiased std, broadcast, token-weighted batch norm."""
    r = (np.asarray(rewards_GxN, np.float64) + bias) * scale
    if group_norm:
        r = (r - r.mean(axis=1, keepdims=True)) / (r.std(axis=1, ddof=1, keepdims=True) + eps)
    m = np.asarray(mask_GxNxT, bool)
    a = np.where(m, r[..., None], 0.0)
    if batch_norm:
        valid = a[m]
        a = np.where(m, (a - valid.mean()) / (valid.std(ddof=1) + eps), 0.0)
    return a


def _mask(lengths_GxN, t):
    return np.arange(t)[None, None, :] < np.asarray(lengths_GxN)[..., None]


def test_shape_rewards_hand():
    np.testing.assert_allclose(np.asarray(shape_rewards(np.array([0.0, 1.0, 0.5]))), [-5.0, 5.0, 0.0])
    np.testing.assert_allclose(np.asarray(shape_rewards(np.array([2.0]), scale=3.0, bias=1.0)), [9.0])


def test_group_normalize_hand_unbiased_std():
    # Shaped rewards of one group: [5, -5, -5, -5]: mean -2.5, deviations [7.5, -2.5 x3],
    # sum of squares 75, unbiased variance 75 / 3 = 25, std 5.
    out = np.asarray(group_normalize(np.array([[5.0, -5.0, -5.0, -5.0]])))
    np.testing.assert_allclose(out, [[7.5 / 5.00001, -2.5 / 5.00001, -2.5 / 5.00001, -2.5 / 5.00001]], rtol=1e-6)
    # [-5, 5, -5, 5]: mean 0, unbiased std sqrt(100 / 3) = 10 / sqrt(3); the biased one would give +-1.
    out = np.asarray(group_normalize(np.array([[-5.0, 5.0, -5.0, 5.0]])))
    expected = 5.0 / (10.0 / np.sqrt(3.0) + 1e-5)  # = sqrt(3) / 2 up to eps
    np.testing.assert_allclose(out, [[-expected, expected, -expected, expected]], rtol=1e-6)
    assert abs(out[0, 1] - 1.0) > 0.1  # not the population std


def test_group_normalize_random_matches_numpy_float64():
    rng = np.random.default_rng(0)
    v = rng.normal(size=(5, 7)) * 3.0 + 1.0
    expected = (v - v.mean(1, keepdims=True)) / (v.std(1, ddof=1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(np.asarray(group_normalize(v.astype(np.float32))), expected, rtol=2e-5, atol=2e-6)
    expected = (v - v.mean(1, keepdims=True)) / (v.std(1, ddof=1, keepdims=True) + 0.5)
    np.testing.assert_allclose(
        np.asarray(group_normalize(v.astype(np.float32), eps=0.5)), expected, rtol=2e-5, atol=2e-6
    )


def test_all_equal_group_and_single_sample_give_zero():
    out = np.asarray(group_normalize(np.array([[5.0, 5.0, 5.0, 5.0], [-5.0, -5.0, -5.0, -5.0]])))
    assert np.all(out == 0.0)
    out = np.asarray(group_normalize(np.full((1, 6), 0.3)))
    np.testing.assert_allclose(out, 0.0, atol=1e-6)
    out = np.asarray(group_normalize(np.array([[3.0], [-7.0]])))  # N = 1: std taken as 1, value is its own mean
    assert np.all(out == 0.0)


def test_batch_normalize_hand_token_weighted():
    # Valid tokens: 1, 1, 1 (row 0) and -2, -2 (row 1): token mean -0.2 (a per-row mean would be -0.5),
    # deviations 1.2 x3 and -1.8 x2, sum of squares 10.8, unbiased variance 10.8 / 4 = 2.7.
    adv = np.array([[1.0, 1.0, 1.0, 99.0], [-2.0, -2.0, 99.0, np.nan]])
    mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], bool)
    std = np.sqrt(2.7) + 1e-5
    expected = np.array([[1.2 / std, 1.2 / std, 1.2 / std, 0.0], [-1.8 / std, -1.8 / std, 0.0, 0.0]])
    np.testing.assert_allclose(np.asarray(batch_normalize(adv, mask)), expected, rtol=1e-6, atol=1e-7)


def test_batch_normalize_random_and_degenerate():
    rng = np.random.default_rng(1)
    a = rng.normal(size=(3, 4, 9)) * 2.0 + 0.7
    m = rng.random(size=a.shape) < 0.6
    valid = a[m]
    expected = np.where(m, (a - valid.mean()) / (valid.std(ddof=1) + 1e-5), 0.0)
    np.testing.assert_allclose(np.asarray(batch_normalize(a.astype(np.float32), m)), expected, rtol=2e-5, atol=2e-6)
    # One valid token: it is its own mean, std taken as 1. No valid token: all zeros, no NaN.
    one = np.zeros((2, 3), bool)
    one[1, 2] = True
    assert np.all(np.asarray(batch_normalize(np.full((2, 3), 4.0), one)) == 0.0)
    assert np.all(np.asarray(batch_normalize(np.full((2, 3), 4.0), np.zeros((2, 3), bool))) == 0.0)


def test_compute_advantages_recipe_defaults_match_numpy():
    rewards = np.array([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])  # last: all-equal group
    lengths = np.array([[3, 5, 1, 6], [6, 2, 4, 4], [5, 5, 3, 2]])
    mask = _mask(lengths, 6)
    cfg = get_config().advantages
    out = np.asarray(compute_advantages(rewards, mask, **cfg))  # the config's field names are the keywords
    assert out.shape == (3, 4, 6) and out.dtype == np.float32
    np.testing.assert_allclose(out, _np_recipe(rewards, mask), rtol=2e-5, atol=2e-6)
    assert np.all(out[~mask] == 0.0)
    # The config defaults are the recipe's and the function's defaults.
    assert (cfg.reward_scale, cfg.reward_bias, cfg.group_norm, cfg.group_eps, cfg.batch_norm, cfg.batch_eps) == (
        10.0,
        -0.5,
        True,
        1e-5,
        True,
        1e-5,
    )
    np.testing.assert_array_equal(np.asarray(compute_advantages(rewards, mask)), out)


def test_compute_advantages_switches():
    rewards = np.array([[1.0, 0.0], [0.0, 0.0]])
    mask = _mask(np.array([[2, 1], [3, 0]]), 3)
    # No normalisation: (r - 0.5) * 10 on the valid tokens.
    out = np.asarray(compute_advantages(rewards, mask, group_norm=False, batch_norm=False))
    np.testing.assert_array_equal(out, [[[5, 5, 0], [-5, 0, 0]], [[-5, -5, -5], [0, 0, 0]]])
    # Group only: [5, -5] -> +-5 / (sqrt(50) + eps); the all-zero group -> 0.
    out = np.asarray(compute_advantages(rewards, mask, batch_norm=False))
    g = 5.0 / (np.sqrt(50.0) + 1e-5)
    np.testing.assert_allclose(out, [[[g, g, 0], [-g, 0, 0]], [[0, 0, 0], [0, 0, 0]]], rtol=1e-6)
    # Other scale/bias, batch only.
    rewards = np.array([[0.2, 0.9, 0.4]])
    mask = _mask(np.array([[4, 2, 3]]), 5)
    out = np.asarray(
        compute_advantages(rewards, mask, reward_scale=2.0, reward_bias=0.1, group_norm=False, batch_eps=1e-3)
    )
    ref = _np_recipe(rewards, mask, scale=2.0, bias=0.1, group_norm=False, eps=1e-3)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("group_eps", [1e-5, 0.3])
def test_compute_advantages_group_eps_is_used(group_eps):
    rewards = np.array([[1.0, 0.0, 1.0]])
    mask = np.ones((1, 3, 2), bool)
    out = np.asarray(compute_advantages(rewards, mask, group_eps=group_eps, batch_norm=False))
    r = np.array([5.0, -5.0, 5.0])
    expected = (r - r.mean()) / (r.std(ddof=1) + group_eps)
    np.testing.assert_allclose(out[0, :, 0], expected, rtol=1e-6)
