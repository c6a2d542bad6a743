"""Policy losses: decoupled PPO with a detached per-token weight, GSPO, optional k3 KL, global aggregation."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from cisjax import errors

AGGREGATIONS = ("token_mean", "seq_mean_token_mean")


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """A run's loss.* (configs/base.py) as policy_loss' keyword arguments; gspo: correction.method is "gspo"."""

    aggregation: str
    clip_low: float
    clip_high: float
    gspo: bool
    gspo_clip_low: float
    gspo_clip_high: float

    def kwargs(self) -> dict:
        return dataclasses.asdict(self)


def _check_aggregation(aggregation: str) -> None:
    if aggregation not in AGGREGATIONS:
        raise errors.UserError(f"unknown loss aggregation {aggregation!r}; expected one of {AGGREGATIONS}")


def loss_denominator(mask, aggregation: str = "token_mean") -> jax.Array:
    """The global normaliser of one optimizer step, from the step's full loss mask [..., T] (all micro-batches).

    token_mean: the number of valid tokens; seq_mean_token_mean: the number of rows with at least one
    valid token. `mask` is the loss (padding) mask, never the correction: tokens or responses that an
    operator zeroes (IcePop, KPop, Seq-MIS) stay counted here. At least 1, so an empty step gives a
    loss of 0 rather than NaN.
    """
    _check_aggregation(aggregation)
    m = jnp.asarray(mask).astype(bool)
    if aggregation == "token_mean":
        count = jnp.sum(m, dtype=jnp.float32)
    else:
        count = jnp.sum(jnp.any(m, axis=-1), dtype=jnp.float32)
    return jnp.maximum(count, 1.0)


def _aggregate(term_BxT, m_BxT, n_B, denominator, aggregation: str):
    """Sum of the per-token term under the aggregation, divided by the step's global denominator."""
    if aggregation == "token_mean":
        return jnp.sum(term_BxT * m_BxT) / denominator
    per_seq_B = jnp.sum(term_BxT * m_BxT, axis=-1) / jnp.maximum(n_B, 1.0)
    return jnp.sum(per_seq_B) / denominator


def policy_loss(
    logp_BxT,
    prox_logprobs_BxT,
    weights_BxT,
    advantages_BxT,
    mask_BxT,
    *,
    denominator,
    aggregation: str = "token_mean",
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    gspo: bool = False,
    gspo_clip_low: float = 3e-4,
    gspo_clip_high: float = 4e-4,
    ref_logprobs_BxT=None,
    kl_coef: float = 0.0,
):
    """(loss, metrics) of one micro-batch; summing `loss` over the step's micro-batches gives the step's loss.

    Token level (decoupled PPO, AReaL): rho_t = exp(logp_t - sg(prox_t)) and
        loss_t = w_t * max(-A_t rho_t, -A_t clip(rho_t, 1 - clip_low, 1 + clip_high))
    with w_t the correction weight (detached here again, whatever the caller passes); no dual clip.

    GSPO (gspo=True): one ratio per response, s_i = exp(mean_t(logp_t - prox_t)) over its valid tokens,
    Abar_i = mean advantage over its valid tokens, l_i = max(-Abar_i s_i, -Abar_i clip(s_i, 1 -
    gspo_clip_low, 1 + gspo_clip_high)). As in verl and TRL, l_i is broadcast to every valid token of
    the response (times w_t, 1 for the gspo operator) and then aggregated exactly like the token loss:
    seq_mean_token_mean gives sum_i l_i / n_seqs (the GSPO paper's objective), token_mean gives
    sum_i n_i l_i / n_tokens (a response weighs by its length, as token-level GRPO under token_mean).

    Aggregation (`denominator` from `loss_denominator` over the whole step's mask):
      token_mean:          sum_{valid t} loss_t / denominator
      seq_mean_token_mean: sum_i (sum_{valid t in i} loss_t / n_i) / denominator      (paper Eq. 1)
    Tokens whose weight is 0 leave the numerator only.

    KL (ref_logprobs_BxT given and kl_coef > 0): kl_coef * k3_t added to every valid token before
    aggregation, k3_t = exp(d) - d - 1 with d = clip(ref_t - logp_t, -20, 20); not multiplied by w_t
    (as TRL and verl: the correction weights the policy-gradient term only).

    Metrics (fp32 scalars over this micro-batch's valid tokens; combine micro-batches by a tokens-
    weighted mean, except keys starting with "seq_" by a seqs-weighted mean and keys ending in "_max"
    by max; "tokens"/"seqs" add up):
      pg_loss      token mean of the policy-gradient term (w_t times the surrogate): the step's value
                   under token_mean aggregation
      seq_pg_loss  mean over responses of its token mean: the step's value under seq_mean_token_mean
      clip_frac    fraction of valid tokens whose clipped branch is active and differs from the
                   unclipped one (for GSPO, tokens of clipped responses)
      ratio_mean, ratio_max   the token ratio rho_t (also under GSPO)
      seq_ratio_mean, seq_ratio_max, seq_clip_frac   (GSPO only) s_i and the fraction of clipped responses
      kl           token mean of k3 (only when the KL term is on)
      tokens, seqs counts of valid tokens and of rows with at least one valid token
    """
    _check_aggregation(aggregation)
    m_BxT = jnp.asarray(mask_BxT).astype(bool)
    mf_BxT = m_BxT.astype(jnp.float32)
    n_B = jnp.sum(mf_BxT, axis=-1)
    seq_B = (n_B > 0).astype(jnp.float32)
    tokens = jnp.sum(mf_BxT)
    seqs = jnp.sum(seq_B)
    tok_div = jnp.maximum(tokens, 1.0)
    seq_div = jnp.maximum(seqs, 1.0)
    denominator = jnp.asarray(denominator, jnp.float32)

    logp_BxT = jnp.asarray(logp_BxT, jnp.float32)
    prox_BxT = jax.lax.stop_gradient(jnp.asarray(prox_logprobs_BxT, jnp.float32))
    w_BxT = jnp.where(m_BxT, jax.lax.stop_gradient(jnp.asarray(weights_BxT, jnp.float32)), 0.0)
    adv_BxT = jnp.where(m_BxT, jnp.asarray(advantages_BxT, jnp.float32), 0.0)
    # Padding can hold any value: keep it out of exp (no inf there, no NaN in the gradient).
    log_ratio_BxT = jnp.where(m_BxT, logp_BxT - prox_BxT, 0.0)
    ratio_BxT = jnp.exp(log_ratio_BxT)

    metrics = {}
    if not gspo:
        unclipped_BxT = -adv_BxT * ratio_BxT
        clipped_BxT = -adv_BxT * jnp.clip(ratio_BxT, 1.0 - clip_low, 1.0 + clip_high)
        surrogate_BxT = jnp.maximum(unclipped_BxT, clipped_BxT)
        clipped_tok_BxT = (clipped_BxT > unclipped_BxT) & m_BxT
    else:
        ratio_B = jnp.exp(jnp.sum(log_ratio_BxT, axis=-1) / jnp.maximum(n_B, 1.0))
        adv_B = jnp.sum(adv_BxT, axis=-1) / jnp.maximum(n_B, 1.0)
        unclipped_B = -adv_B * ratio_B
        clipped_B = -adv_B * jnp.clip(ratio_B, 1.0 - gspo_clip_low, 1.0 + gspo_clip_high)
        surrogate_BxT = jnp.broadcast_to(jnp.maximum(unclipped_B, clipped_B)[:, None], m_BxT.shape)
        clipped_seq_B = (clipped_B > unclipped_B) & (n_B > 0)
        clipped_tok_BxT = clipped_seq_B[:, None] & m_BxT
        metrics["seq_ratio_mean"] = jnp.sum(ratio_B * seq_B) / seq_div
        metrics["seq_ratio_max"] = jnp.max(jnp.where(n_B > 0, ratio_B, 0.0))
        metrics["seq_clip_frac"] = jnp.sum(clipped_seq_B.astype(jnp.float32)) / seq_div

    pg_BxT = jnp.where(m_BxT, w_BxT * surrogate_BxT, 0.0)
    loss = _aggregate(pg_BxT, mf_BxT, n_B, denominator, aggregation)

    metrics["pg_loss"] = jnp.sum(pg_BxT) / tok_div
    metrics["seq_pg_loss"] = jnp.sum(jnp.sum(pg_BxT, axis=-1) / jnp.maximum(n_B, 1.0)) / seq_div
    metrics["clip_frac"] = jnp.sum(clipped_tok_BxT.astype(jnp.float32)) / tok_div
    metrics["ratio_mean"] = jnp.sum(ratio_BxT * mf_BxT) / tok_div
    metrics["ratio_max"] = jnp.max(jnp.where(m_BxT, ratio_BxT, 0.0))

    if ref_logprobs_BxT is not None and kl_coef > 0:
        ref_BxT = jax.lax.stop_gradient(jnp.asarray(ref_logprobs_BxT, jnp.float32))
        d_BxT = jnp.where(m_BxT, jnp.clip(ref_BxT - logp_BxT, -20.0, 20.0), 0.0)
        k3_BxT = jnp.where(m_BxT, jnp.exp(d_BxT) - d_BxT - 1.0, 0.0)
        loss = loss + kl_coef * _aggregate(k3_BxT, mf_BxT, n_B, denominator, aggregation)
        metrics["kl"] = jnp.sum(k3_BxT) / tok_div

    metrics["tokens"] = tokens
    metrics["seqs"] = seqs
    metrics = {key: jax.lax.stop_gradient(jnp.asarray(v, jnp.float32)) for key, v in metrics.items()}
    return loss, metrics
