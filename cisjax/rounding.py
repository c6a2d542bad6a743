"""Stochastic rounding of fp32 values to bfloat16: unbiased storage for bf16 moments, master weights and gradient sums."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def round_to_bf16(x_f32: jax.Array, key: jax.Array) -> jax.Array:
    """fp32 -> bfloat16 by stochastic rounding: up to the next bfloat16 with probability (the distance to the one below)
    / (their gap), so the result's expected value is x. Random 16 bits added below bfloat16's last mantissa bit, then
    truncated; exact where x is a bfloat16 already; inf stays inf, nan stays nan."""
    bits = jax.lax.bitcast_convert_type(x_f32.astype(jnp.float32), jnp.uint32)
    noise = jax.random.bits(key, x_f32.shape, jnp.uint32) >> 16
    rounded = (bits + jnp.where(jnp.isfinite(x_f32), noise, 0)) & jnp.uint32(0xFFFF0000)
    return jax.lax.bitcast_convert_type(rounded, jnp.float32).astype(jnp.bfloat16)
