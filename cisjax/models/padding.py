"""Padding to whole blocks for the kernels that need them: a size rounded up, an array padded at the end of axes."""

from __future__ import annotations

import jax.numpy as jnp


def round_up(n: int, multiple: int) -> int:
    """The least multiple of `multiple` at or above n."""
    return -(-n // multiple) * multiple


def pad_axes(x, sizes: dict[int, int], value=0):
    """x padded with `value` at the end of each axis in `sizes` to that size (at least x's); x itself if none grows."""
    pads = [(0, sizes.get(axis, d) - d) for axis, d in enumerate(x.shape)]
    if any(p < 0 for _, p in pads):
        raise ValueError(f"pad_axes: sizes {sizes} below the shape {x.shape}")
    return x if not any(p for _, p in pads) else jnp.pad(x, pads, constant_values=value)
