"""Shared layers: params with logical axes, RMSNorm, dense MLP, rotary (default/linear/yarn)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np

from cisjax import errors, sharding

# Initializers only matter for random-init models; loaded checkpoints overwrite every value.
_normal = jax.nn.initializers.normal(stddev=0.02)


def param(rngs: nnx.Rngs, shape: Sequence[int], axes: Sequence[str | None], dtype, init=_normal) -> nnx.Param:
    """An nnx.Param carrying its logical axis names (the sharding table maps them to the mesh)."""
    if len(shape) != len(axes):
        raise ValueError(f"shape {tuple(shape)} and axes {tuple(axes)} differ in rank")
    return nnx.Param(init(rngs.params(), tuple(shape), dtype), axes=tuple(axes))


def ones_param(shape, axes, dtype) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, dtype), axes=tuple(axes))


class RMSNorm(nnx.Module):
    """y = w * (x / sqrt(mean(x^2) + eps)), statistics in fp32, cast back before the scale (as HF)."""

    def __init__(self, dim: int, eps: float, *, param_dtype, axes=("norm",)):
        self.eps = eps
        self.weight = ones_param((dim,), axes, param_dtype)

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        dtype = x_BxLxD.dtype
        x = x_BxLxD.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(dtype) * x.astype(dtype)


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(x @ gate) * (x @ up))."""

    def __init__(self, d_model: int, d_ff: int, *, rngs: nnx.Rngs, param_dtype, dtype):
        self.dtype = dtype
        self.wg_DxF = param(rngs, (d_model, d_ff), ("embed", "mlp"), param_dtype)
        self.wu_DxF = param(rngs, (d_model, d_ff), ("embed", "mlp"), param_dtype)
        self.wo_FxD = param(rngs, (d_ff, d_model), ("mlp", "embed"), param_dtype)

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        x = x_BxLxD.astype(self.dtype)
        g_BxLxF = jnp.einsum("bld,df->blf", x, self.wg_DxF[...].astype(self.dtype))
        u_BxLxF = jnp.einsum("bld,df->blf", x, self.wu_DxF[...].astype(self.dtype))
        h_BxLxF = sharding.constrain(jax.nn.silu(g_BxLxF) * u_BxLxF, ("batch", "length", "act_mlp"))
        return jnp.einsum("blf,fd->bld", h_BxLxF, self.wo_FxD[...].astype(self.dtype))


def dense(x: jax.Array, w: nnx.Param, dtype, b: nnx.Param | None = None) -> jax.Array:
    """x @ w (+ b) in the compute dtype; w is stored [in, out]."""
    y = jnp.einsum("...i,io->...o", x.astype(dtype), w[...].astype(dtype))
    return y if b is None else y + b[...].astype(dtype)


# ----------------------------------------------------------------------------- rotary


def rope_frequencies(rope: Mapping, dim: int, max_position_embeddings: int) -> tuple[np.ndarray, float]:
    """(inv_freq [dim/2] float32, attention_scaling) for rope types default, linear and yarn.

    Mirrors transformers' `modeling_rope_utils` in float32 so that angles agree with the reference.
    """
    rope_type = rope.get("rope_type", "default")
    base = np.float32(rope["rope_theta"])
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    pos_freqs = base**exponents
    inv_freq = (np.float32(1.0) / pos_freqs).astype(np.float32)
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return (inv_freq / np.float32(rope["factor"])).astype(np.float32), 1.0
    if rope_type != "yarn":
        raise errors.UserError(f"unsupported rope_type {rope_type!r} (supported: default, linear, yarn)")

    factor = rope.get("factor")
    orig_max = rope.get("original_max_position_embeddings") or max_position_embeddings
    if factor is None:
        factor = max_position_embeddings / orig_max
    attention_factor = rope.get("attention_factor")
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = rope.get("beta_fast") or 32
    beta_slow = rope.get("beta_slow") or 1
    truncate = rope.get("truncate", True)

    def correction_dim(num_rotations):
        return (dim * math.log(orig_max / (num_rotations * 2 * math.pi))) / (2 * math.log(float(rope["rope_theta"])))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrap = (np.float32(1) - ramp).astype(np.float32)
    inv_interp = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    inv_freq = inv_interp * (np.float32(1) - extrap) + inv_freq * extrap
    return inv_freq.astype(np.float32), float(attention_factor)


def rope_cos_sin(positions_BxL: jax.Array, inv_freq: np.ndarray, scaling: float, dtype) -> tuple[jax.Array, jax.Array]:
    """cos/sin [B, L, dim] in the HF layout (frequencies repeated: [f, f]), cast to the compute dtype."""
    freqs_BxLxF = positions_BxL.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    emb = jnp.concatenate([freqs_BxLxF, freqs_BxLxF], axis=-1)
    return (jnp.cos(emb) * scaling).astype(dtype), (jnp.sin(emb) * scaling).astype(dtype)


def apply_rope(
    x_BxLxNxH: jax.Array, cos_BxLxH: jax.Array, sin_BxLxH: jax.Array, interleaved: bool = False
) -> jax.Array:
    """HF rotate-half rotary. `interleaved` (DeepSeek): pairs (x0,x1),(x2,x3)... rotate as complex
    numbers; we de-interleave them to the half layout first. That permutes the head dims the same
    way for q and k, so every q.k product equals the reference's."""
    if interleaved:
        b, l, n, h = x_BxLxNxH.shape
        x_BxLxNxH = x_BxLxNxH.reshape(b, l, n, h // 2, 2).swapaxes(-1, -2).reshape(b, l, n, h)
    half = x_BxLxNxH.shape[-1] // 2
    rotated = jnp.concatenate([-x_BxLxNxH[..., half:], x_BxLxNxH[..., :half]], axis=-1)
    return x_BxLxNxH * cos_BxLxH[:, :, None, :] + rotated * sin_BxLxH[:, :, None, :]
