"""The exact path's head and logprobs on a row tile: final norm, unembedding, and one logprob formula for the sampler's
q and the trainer's p, plain or renormalised over a top-k / top-p support given as a [V] mask.

The formula is the trainer's (logprobs._stats_from_logits, forward.make_forward): p = (z_t - lse) - m, lse the
logsumexp of z = logits / temperature over the vocabulary, m = lse_S - lse the support's log mass (0 on a row that
does not truncate), lse_S the logsumexp of z over the support. Here lse_S reduces a [V] row masked to -inf off the
support, whatever the support's size, where the trainer's default path gathers the support's ids padded to a
batch-dependent width (another reduction length: another order). `renormalised` runs isolated (`isolated`: behind
optimization barriers) in the trainer's head tile and in the sampler's own tile, so its one reduction is compiled alike
in both."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

# every loop over row tiles or key blocks runs at least this many trips (exact.tiled, exact_attention.attend_blocked):
# XLA inlines a loop of one trip, and its optimised code then computes the body otherwise
MIN_TRIPS = 2


def isolated(fn, *args):
    """fn(*args) behind optimization barriers on its inputs and outputs: XLA fuses nothing around it into it."""
    return lax.optimization_barrier(fn(*lax.optimization_barrier(args)))


def logits(model, x_TxD, temperature: float):
    """(z = logits / temperature [T, V] fp32, logsumexp(z) [T]) of a tile: the final norm, the unembedding in the
    compute dtype with fp32 accumulation."""
    dt = jnp.dtype(model.cfg.dtype)
    h_TxD = model.norm(x_TxD)
    z_TxV = jnp.einsum(
        "td,dv->tv", h_TxD.astype(dt), model.unembedding_DxV().astype(dt), preferred_element_type=jnp.float32
    )
    z_TxV = z_TxV / temperature
    return z_TxV, jax.nn.logsumexp(z_TxV, axis=-1)


def renormalised(z_TxV, lse_T, t_T, keep_TxV, has_T):
    """log p(t) [T] fp32: z_t - lse, minus the support's log mass lse_S - lse where has_T (the row truncates; keep_TxV
    its support). A target outside [0, V) gives NaN (as token_logprobs)."""
    v = z_TxV.shape[1]
    t_T = t_T.astype(jnp.int32)
    z_t_T = jnp.take_along_axis(z_TxV, jnp.clip(t_T, 0, v - 1)[:, None], axis=-1)[:, 0]
    lp_T = jnp.where((t_T >= 0) & (t_T < v), z_t_T - lse_T, jnp.nan)
    keep_TxV = keep_TxV | ~has_T[:, None]  # no -inf row (and no NaN gradient) where nothing is truncated
    lse_s_T = jax.nn.logsumexp(jnp.where(keep_TxV, z_TxV, -jnp.inf), axis=-1)
    return lp_T - jnp.where(has_T, lse_s_T - lse_T, 0.0)


def support_mask(ids_TxS, v: int):
    """(keep [T, V] bool, has [T] bool) of support ids [T, S] (< 0: padding; a row without any: no truncation)."""
    valid_TxS = ids_TxS >= 0
    rows_TxS = jnp.broadcast_to(jnp.arange(ids_TxS.shape[0])[:, None], ids_TxS.shape)
    keep_TxV = (
        jnp.zeros((ids_TxS.shape[0], v), bool).at[rows_TxS, jnp.where(valid_TxS, ids_TxS, v)].set(True, mode="drop")
    )
    return keep_TxV, jnp.any(valid_TxS, axis=-1)


def train_tile(model, x_TxD, t_T, ids_TxS, temperature: float):
    """The trainer's head on a tile: log p of the targets [T] (renormalised over the support ids [T, S] where given)."""
    z_TxV, lse_T = isolated(lambda x: logits(model, x, temperature), x_TxD)
    v = z_TxV.shape[1]
    if ids_TxS is None:
        keep_TxV, has_T = jnp.ones((t_T.shape[0], v), bool), jnp.zeros(t_T.shape, bool)
    else:
        keep_TxV, has_T = isolated(lambda s: support_mask(s, v), ids_TxS)
    return isolated(renormalised, z_TxV, lse_T, t_T, keep_TxV, has_T)
