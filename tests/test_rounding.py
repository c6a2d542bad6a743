"""Stochastic rounding to bfloat16: exact on bfloat16 values, the right odds between the two neighbours."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cisjax.rounding import round_to_bf16

BF16_GAP_AT_1 = 2.0**-7  # bfloat16 keeps 7 mantissa bits: 1, 1 + 2^-7, ...


def test_round_to_bf16_is_exact_on_bf16_values_and_keeps_inf_and_nan():
    x = jnp.array([0.0, 1.0, -2.5, 1.0 + BF16_GAP_AT_1, 2.0**-66, jnp.inf, -jnp.inf], jnp.float32)
    y = round_to_bf16(x, jax.random.key(1))
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(x))
    assert bool(jnp.isnan(round_to_bf16(jnp.array([jnp.nan]), jax.random.key(1)))[0])


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_round_to_bf16_picks_a_neighbour_with_the_right_odds(sign):
    """1 + 2^-9 lies a quarter of the way from 1 to the next bfloat16, 1 + 2^-7: it rounds up one time in four, so the
    mean of the rounded values is x itself (to sampling error: 4 sigma of 65,536 draws)."""
    n, lo, hi = 65536, 1.0, 1.0 + BF16_GAP_AT_1
    x = sign * (1.0 + 2.0**-9)
    y = np.asarray(round_to_bf16(jnp.full((n,), x, jnp.float32), jax.random.key(0)), np.float64)
    assert set(np.unique(np.abs(y))) == {lo, hi}
    up = np.mean(np.abs(y) == hi)
    assert abs(up - 0.25) < 4 * np.sqrt(0.25 * 0.75 / n), up
    assert abs(y.mean() - x) < 4 * BF16_GAP_AT_1 * np.sqrt(0.25 * 0.75 / n)
