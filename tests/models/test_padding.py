"""Padding to whole blocks: sizes rounded up and arrays padded at the ends of axes, against hand-written values."""

import jax.numpy as jnp
import numpy as np
import pytest

from cisjax.models.padding import pad_axes, round_up


@pytest.mark.parametrize("n, multiple, want", [(0, 8, 0), (1, 8, 8), (8, 8, 8), (9, 8, 16), (130, 128, 256)])
def test_round_up(n, multiple, want):
    assert round_up(n, multiple) == want


def test_pad_axes_pads_the_named_axes_at_their_ends_with_the_value():
    x = jnp.array([[1, 2], [3, 4]])
    got = pad_axes(x, {0: 3, 1: 4}, value=-1)
    np.testing.assert_array_equal(got, [[1, 2, -1, -1], [3, 4, -1, -1], [-1, -1, -1, -1]])
    np.testing.assert_array_equal(pad_axes(x, {1: 3}), [[1, 2, 0], [3, 4, 0]])


def test_pad_axes_returns_the_array_itself_when_nothing_grows():
    x = jnp.ones((2, 3))
    assert pad_axes(x, {0: 2, 1: 3}) is x
    assert pad_axes(x, {}) is x


def test_pad_axes_refuses_a_size_below_the_shape():
    with pytest.raises(ValueError, match="below the shape"):
        pad_axes(jnp.ones((4, 3)), {0: 2})
