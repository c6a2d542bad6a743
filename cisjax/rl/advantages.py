"""GRPO advantages: reward shaping, per-group and token-weighted batch normalisation (the paper's recipe)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class AdvantageSpec:
    """A run's advantages.* (configs/base.py), as compute_advantages' keyword arguments."""

    reward_scale: float
    reward_bias: float
    group_norm: bool
    group_eps: float
    batch_norm: bool
    batch_eps: float

    def kwargs(self) -> dict:
        return dataclasses.asdict(self)


def shape_rewards(rewards, *, scale: float = 10.0, bias: float = -0.5) -> jax.Array:
    """(r + bias) * scale in fp32: the recipe's (r - 0.5) * 10 maps a 0/1 reward to -5/+5."""
    return (jnp.asarray(rewards, jnp.float32) + bias) * scale


def group_normalize(values_GxN, *, eps: float = 1e-5) -> jax.Array:
    """(v - mean) / (std + eps) within each group (row) of N samples; std is the unbiased (N - 1) one.

    As AReaL's `Normalization` (std_unbiased=True): eps is added to the std, not under the square
    root, so a group of identical values gives exactly 0 (no signal from an all-right or all-wrong
    group). A group of one sample (N = 1) has no unbiased std: it is taken as 1 (AReaL's special
    case), and since the sample is its own mean the result is 0.
    """
    v_GxN = jnp.asarray(values_GxN, jnp.float32)
    n = v_GxN.shape[-1]
    mean_Gx1 = jnp.mean(v_GxN, axis=-1, keepdims=True)
    centered_GxN = v_GxN - mean_Gx1
    if n > 1:
        std_Gx1 = jnp.sqrt(jnp.sum(centered_GxN**2, axis=-1, keepdims=True) / (n - 1))
    else:
        std_Gx1 = jnp.ones_like(mean_Gx1)
    return centered_GxN / (std_Gx1 + eps)


def batch_normalize(adv_BxT, mask_BxT, *, eps: float = 1e-5) -> jax.Array:
    """(a - mean) / (std + eps) over the valid tokens of the whole array (any shape, e.g. GxNxT), 0 elsewhere.

    Token-weighted: a response of n tokens counts n times. std is the unbiased one over the n_valid
    tokens (divisor n_valid - 1); with fewer than two valid tokens it is taken as 1 (AReaL). Pass the
    whole optimizer step (all micro-batches) so that the statistics are global.
    """
    a = jnp.asarray(adv_BxT, jnp.float32)
    m = jnp.asarray(mask_BxT).astype(jnp.float32)
    a = jnp.where(m > 0, a, 0.0)  # padding may hold anything; it never enters the statistics
    n = jnp.sum(m)
    mean = jnp.sum(a * m) / jnp.maximum(n, 1.0)
    centered = (a - mean) * m
    var = jnp.sum(centered**2) / jnp.maximum(n - 1.0, 1.0)
    std = jnp.where(n > 1, jnp.sqrt(var), 1.0)
    return centered / (std + eps)


def compute_advantages(
    rewards_GxN,
    mask_GxNxT,
    *,
    reward_scale: float = 10.0,
    reward_bias: float = -0.5,
    group_norm: bool = True,
    group_eps: float = 1e-5,
    batch_norm: bool = True,
    batch_eps: float = 1e-5,
) -> jax.Array:
    """Per-token advantages [G, N, T] (fp32, 0 on masked tokens) from the rewards of G groups of N samples.

    The recipe (AReaL's GRPO path, paper Appendix C): shape the scalar rewards, normalise them within
    each group, broadcast each response's value over its valid tokens (GAE with gamma = lambda = 1,
    no critic, no KL reward), then normalise over all valid tokens of the batch. The keyword names
    are the fields of AdvantageSpec (`config.advantages`).
    """
    r_GxN = shape_rewards(rewards_GxN, scale=reward_scale, bias=reward_bias)
    if group_norm:
        r_GxN = group_normalize(r_GxN, eps=group_eps)
    m_GxNxT = jnp.asarray(mask_GxNxT).astype(jnp.float32)
    adv_GxNxT = r_GxN[..., None] * m_GxNxT
    if batch_norm:
        adv_GxNxT = batch_normalize(adv_GxNxT, m_GxNxT, eps=batch_eps)
    return adv_GxNxT
