"""Training-inference mismatch corrections: the per-token weight of every operator (paper Table 7), and its metrics."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import checkify

from cisjax import errors

METHODS = (
    "none",
    "exact",
    "tis",
    "icepop",
    "kpop",
    "kpop_shipped",
    "seq_tis",
    "seq_mis",
    "gspo",
    "fp16",
    "cis",
    "cis_two_sided",
)
# Default [low, high] bounds of the masking operators (paper Table 7).
DEFAULT_BOUNDS = {"icepop": (0.5, 5.0), "seq_mis": (0.5, 2.0)}
# The exact arm's clamp of k, applied in log space so that no weight is ever inf (also bounds KPop's kept k).
EXACT_LOGK_MIN, EXACT_LOGK_MAX = math.log(1e-6), math.log(1e6)
# Seq-TIS / Seq-MIS: the summed log k of a response is clipped to [-20, 20] before exp.
SEQ_LOGK_CLIP = 20.0
# KPop's probability clamp [1e-8, 1 - 1e-8] (applied in log space by the corrected metric).
KPOP_PROB_MIN = 1e-8
# Metric keys that add up over micro-batches; "acted_seq_frac" and keys starting with "seq_" combine by "seqs",
# keys ending in "_max" by max, every other key by "tokens" (see combine_metrics).
SUM_KEYS = frozenset({"tokens", "seqs", "nan_logprobs", "nonfinite_logk"})


@dataclasses.dataclass(frozen=True)
class CorrectionSpec:
    """The operator of a run and its hyperparameters, as correction() takes them (configs/base.py correction.* is
    the one source of their values). low/high None: the method's default bounds (DEFAULT_BOUNDS)."""

    method: str
    lam: float  # CIS: slope of the cap 1 + lam * max(1 - p, kappa)
    kappa: float  # CIS: floor of 1 - p in the cap
    cap: float  # TIS / Seq-TIS: C in min(k, C)
    threshold: float  # KPop: phi, the bound on the larger binary KL
    low: float | None = None  # IcePop / Seq-MIS bounds
    high: float | None = None

    def hparams(self) -> dict:
        """The keyword arguments of correction() / correction_weights() besides the method."""
        return dict(
            lam=self.lam, kappa=self.kappa, cap=self.cap, low=self.low, high=self.high, threshold=self.threshold
        )


class Correction(NamedTuple):
    weights_BxT: jax.Array  # fp32, stop-gradient, 0 on padding (and on tokens with a NaN logprob)
    acted_BxT: jax.Array  # bool, the operator acted on the token (for the token dump); False on padding
    metrics: dict  # fp32 scalars, see correction()


def _check_hparams(method, lam, kappa, cap, low, high, threshold):
    """Validate static hyperparameters; returns the effective (low, high) of masking methods (else (None, None))."""
    if method not in METHODS:
        raise errors.UserError(f"unknown correction method {method!r}; valid methods: {', '.join(METHODS)}")
    lam, kappa, cap, threshold = float(lam), float(kappa), float(cap), float(threshold)
    if not (math.isfinite(lam) and lam >= 0):
        raise errors.UserError(f"lam={lam} must be finite and >= 0")
    if not (0.0 <= kappa <= 1.0):
        raise errors.UserError(f"kappa={kappa} must lie in [0, 1]")
    if not (math.isfinite(cap) and cap > 0):
        raise errors.UserError(f"cap={cap} must be finite and > 0")
    if not (threshold >= 0):  # inf allowed: never mask
        raise errors.UserError(f"threshold={threshold} must be >= 0")
    if method not in DEFAULT_BOUNDS:
        return None, None
    d_low, d_high = DEFAULT_BOUNDS[method]
    low = d_low if low is None else float(low)
    high = d_high if high is None else float(high)
    if not (math.isfinite(low) and low >= 0):
        raise errors.UserError(f"{method}: low={low} must be finite and >= 0 (None: the default {d_low})")
    if not (high > 0):
        raise errors.UserError(f"{method}: high={high} must be > 0 (None: the default {d_high})")
    if low > high:
        raise errors.UserError(f"{method}: low={low} > high={high}")
    return low, high


def kpop_metric(train_logprobs_BxT, infer_logprobs_BxT, *, shipped: bool = False):
    """KPop's metric max(KL_B(p||q), KL_B(q||p)), KL_B(p||q) = p log(p/q) + (1-p) log((1-p)/(1-q)), fp32 [B, T].

    shipped=False (KPop-dagger): p and q clamped to [1e-8, 1 - 1e-8] first and a NaN metric mapped to 0, as the paper's
      float64 recomputation, but in fp32: a global x64 flag is not acceptable, and `with jax.enable_x64(True)` inside
      jit does emit float64 ops on CPU/GPU but TPUs have no float64. Instead the clamp is applied to log p, log(1 - p) =
      log(-expm1(log p)) stays accurate up to p = 1 - 1e-8, and KL = p (lp - lq) + (1 - p) (l1p - l1q). Every log is
      bounded by |log 1e-8| = 18.4, so the fp32 metric is within ~1e-5 of float64's (measured: <= 4e-6 on 8e5 random
      pairs, <= 1.2e-6 where it is near phi = 2): the mask decision equals float64's except within that band of phi.
    shipped=True: the released fp32 formula literally: p = exp(logp), clamp in fp32 (1 - 1e-8 rounds to 1, so the upper
      clamp is a no-op) and p log(p/q) + ...: NaN where p == 1 or q == 1 in fp32 (0 * log(0/0), 0 * log(0/x)), which
      the bounds check then masks.
    """
    lp_BxT = jnp.asarray(train_logprobs_BxT, jnp.float32)
    lq_BxT = jnp.asarray(infer_logprobs_BxT, jnp.float32)
    if shipped:
        p_BxT = jnp.clip(jnp.exp(lp_BxT), KPOP_PROB_MIN, jnp.float32(1.0 - KPOP_PROB_MIN))
        q_BxT = jnp.clip(jnp.exp(lq_BxT), KPOP_PROB_MIN, jnp.float32(1.0 - KPOP_PROB_MIN))

        def kl(a, b):
            return a * jnp.log(a / b) + (1.0 - a) * jnp.log((1.0 - a) / (1.0 - b))

        return jnp.maximum(kl(p_BxT, q_BxT), kl(q_BxT, p_BxT))
    lo, hi = math.log(KPOP_PROB_MIN), math.log1p(-KPOP_PROB_MIN)
    a_p, a_q = jnp.clip(lp_BxT, lo, hi), jnp.clip(lq_BxT, lo, hi)  # log p, log q (clamped)
    m_p, m_q = -jnp.expm1(a_p), -jnp.expm1(a_q)  # 1 - p, 1 - q, >= ~1e-8
    b_p, b_q = jnp.log(m_p), jnp.log(m_q)  # log(1 - p), log(1 - q)
    kl_pq = jnp.exp(a_p) * (a_p - a_q) + m_p * (b_p - b_q)
    kl_qp = jnp.exp(a_q) * (a_q - a_p) + m_q * (b_q - b_p)
    metric_BxT = jnp.maximum(kl_pq, kl_qp)
    return jnp.where(jnp.isnan(metric_BxT), 0.0, metric_BxT)


def _k3(x):
    """k - 1 - log k for log k = x, accurate for small |x| (series below 0.1, where expm1(x) - x cancels)."""
    series = x * x * (0.5 + x * (1 / 6 + x * (1 / 24 + x * (1 / 120 + x / 720))))
    return jnp.where(jnp.abs(x) < 0.1, series, jnp.expm1(x) - x)


def correction(
    method: str,
    train_logprobs,
    infer_logprobs,
    mask,
    *,
    lam: float,
    kappa: float,
    cap: float,
    threshold: float,
    low: float | None = None,
    high: float | None = None,
) -> Correction:
    """Correction weights, the per-token acted-on flag and the metrics of one [B, T] micro-batch (one response per row).

    train_logprobs = log p (the trainer's proximal logprob), infer_logprobs = log q (the rollout engine's at sampling),
    mask true on response tokens. Common to all operators: log k = log p - log q in fp32; a non-finite log k (q = 0,
    p = 0) is replaced by 0, i.e. the token is weighted as if k = 1 (KPop still masks it on its KL metric); the
    weight is detached; padding weighs 0. Weights (k = exp(log k), p = exp(log p), bounds inclusive):
      none, gspo, fp16  1 (gspo's sequence surrogate and fp16's precision live in the loss / step)
      exact             exp(clip(log k, log 1e-6, log 1e6))
      tis               min(k, cap)
      icepop            k * 1{low <= k <= high}, default [0.5, 5]
      kpop              k_exact * 1{kpop_metric <= threshold} (KPop-dagger); k_exact as in `exact`, so that a kept
                        token never weighs inf (the metric clamps q at 1e-8, so it keeps tokens with any k)
      kpop_shipped      the same with the shipped fp32 metric: p == 1 or q == 1 gives NaN, masked
      seq_tis           min(K, cap) on every token of the response, K = exp(clip(sum_valid log k, -20, 20))
      seq_mis           K * 1{low <= K <= high} on every token of the response, default [0.5, 2]
      cis               min(k, 1 + lam * max(1 - p, kappa))
      cis_two_sided     max(min(k, 1 + lam * max(1 - p, kappa)), (1 + p) / 2)
    low/high None -> the method's default; cap is C of tis / seq_tis; threshold is KPop's phi. All static floats,
    with no defaults here: a run takes them from its CorrectionSpec (configs/base.py).

    Acted on: masks (icepop, kpop, kpop_shipped): the token is masked; caps (exact, tis, cis, cis_two_sided): the
    weight differs from k; sequence operators: every valid token of a capped (seq_tis) or rejected (seq_mis) response;
    none, gspo, fp16: never (they apply no correction to k; the paper's table reports 0 for them).

    NaN logprobs (they must never occur): a jitted function cannot raise, so a valid token with a NaN
    logprob (i) weighs 0, (ii) is counted in metrics["nan_logprobs"], which the step reports, and (iii) fails a
    `checkify.debug_check`, which raises when the caller runs under `checkify.checkify(..., errors=
    checkify.user_checks)` (a no-op otherwise). Its log k counts as 0 in the other metrics.

    Metrics (fp32 scalars; means over valid tokens, 0 when there are none):
      acted_frac      fraction of valid tokens acted on
      acted_seq_frac  fraction of sequences (rows with >= 1 valid token) with an acted-on token
      abs_logk_mean, abs_logk_max, logk_mean   of the sanitised log k
      k3              mean(k - 1 - log k)  (inf if some k overflows fp32: log k > 88.7)
      chi2            E[k^2] - 1           (inf if some k^2 overflows fp32: log k > 44.4)
      weight_mean, weight_max
      tokens, seqs    valid tokens, rows with >= 1 valid token
      nan_logprobs    valid tokens with a NaN train or infer logprob
      nonfinite_logk  other valid tokens whose log k is not finite (treated as log k = 0)
    Combine micro-batches with combine_metrics.
    """
    low, high = _check_hparams(method, lam, kappa, cap, low, high, threshold)
    lp_BxT = lax.stop_gradient(jnp.asarray(train_logprobs).astype(jnp.float32))
    lq_BxT = lax.stop_gradient(jnp.asarray(infer_logprobs).astype(jnp.float32))
    mask_BxT = jnp.asarray(mask).astype(bool)
    if lp_BxT.ndim != 2 or lp_BxT.shape != lq_BxT.shape or lp_BxT.shape != mask_BxT.shape:
        raise ValueError(
            f"train_logprobs {lp_BxT.shape}, infer_logprobs {lq_BxT.shape} and mask {mask_BxT.shape} "
            "must be the same [B, T] shape"
        )

    nan_BxT = mask_BxT & (jnp.isnan(lp_BxT) | jnp.isnan(lq_BxT))
    raw_logk_BxT = lp_BxT - lq_BxT
    finite_BxT = jnp.isfinite(raw_logk_BxT)
    logk_BxT = jnp.where(finite_BxT & mask_BxT, raw_logk_BxT, 0.0)  # sanitised; 0 on padding
    k_BxT = jnp.exp(logk_BxT)
    # p as the reference, except NaN / padding -> 1 and p <= 1: a log p that rounds above 0 gives the same CIS cap
    # (1 - p < kappa either way) and keeps cis_two_sided's floor (1 + p) / 2 <= 1 (never inf).
    p_BxT = jnp.exp(jnp.minimum(jnp.where(mask_BxT & ~nan_BxT, lp_BxT, 0.0), 0.0))

    n_B = jnp.sum(mask_BxT, axis=-1)
    has_tokens_B = n_B > 0
    acted_B = None  # set by sequence operators
    if method in ("none", "gspo", "fp16"):
        w_BxT = jnp.ones_like(k_BxT)
        acted_BxT = jnp.zeros_like(mask_BxT)
    elif method == "exact":
        w_BxT = jnp.exp(jnp.clip(logk_BxT, EXACT_LOGK_MIN, EXACT_LOGK_MAX))
        acted_BxT = (logk_BxT < jnp.float32(EXACT_LOGK_MIN)) | (logk_BxT > jnp.float32(EXACT_LOGK_MAX))
    elif method == "tis":
        w_BxT = jnp.minimum(k_BxT, cap)
        acted_BxT = k_BxT > jnp.float32(cap)
    elif method == "icepop":
        keep_BxT = (k_BxT >= jnp.float32(low)) & (k_BxT <= jnp.float32(high))
        w_BxT = jnp.where(keep_BxT, k_BxT, 0.0)
        acted_BxT = ~keep_BxT
    elif method in ("kpop", "kpop_shipped"):
        metric_BxT = kpop_metric(lp_BxT, lq_BxT, shipped=method == "kpop_shipped")
        keep_BxT = metric_BxT <= jnp.float32(threshold)  # NaN / inf -> masked
        w_BxT = jnp.where(keep_BxT, jnp.exp(jnp.clip(logk_BxT, EXACT_LOGK_MIN, EXACT_LOGK_MAX)), 0.0)
        acted_BxT = ~keep_BxT
    elif method in ("seq_tis", "seq_mis"):
        big_k_B = jnp.exp(jnp.clip(jnp.sum(logk_BxT, axis=-1), -SEQ_LOGK_CLIP, SEQ_LOGK_CLIP))
        if method == "seq_tis":
            w_B = jnp.minimum(big_k_B, cap)
            acted_B = big_k_B > jnp.float32(cap)
        else:
            keep_B = (big_k_B >= jnp.float32(low)) & (big_k_B <= jnp.float32(high))
            w_B = jnp.where(keep_B, big_k_B, 0.0)
            acted_B = ~keep_B
        acted_B = acted_B & has_tokens_B
        w_BxT = jnp.broadcast_to(w_B[:, None], k_BxT.shape)
        acted_BxT = jnp.broadcast_to(acted_B[:, None], mask_BxT.shape)
    else:  # cis, cis_two_sided
        cap_BxT = 1.0 + lam * jnp.maximum(1.0 - p_BxT, kappa)
        w_BxT = jnp.minimum(k_BxT, cap_BxT)
        if method == "cis_two_sided":
            w_BxT = jnp.maximum(w_BxT, (1.0 + p_BxT) / 2.0)
        acted_BxT = w_BxT != k_BxT

    valid_BxT = mask_BxT & ~nan_BxT
    w_BxT = lax.stop_gradient(jnp.where(valid_BxT, w_BxT, 0.0).astype(jnp.float32))
    acted_BxT = acted_BxT & valid_BxT
    if acted_B is None:
        acted_B = jnp.any(acted_BxT, axis=-1)

    nan_count = jnp.sum(nan_BxT)
    checkify.debug_check(nan_count == 0, "correction_weights: {n} valid tokens have a NaN logprob", n=nan_count)

    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    tokens, seqs = f32(jnp.sum(mask_BxT)), f32(jnp.sum(has_tokens_B))
    tok_div, seq_div = jnp.maximum(tokens, 1.0), jnp.maximum(seqs, 1.0)
    abs_logk_BxT = jnp.abs(logk_BxT)  # 0 on padding
    tok_mean = lambda x_BxT: jnp.sum(jnp.where(mask_BxT, x_BxT, 0.0)) / tok_div  # noqa: E731
    metrics = dict(
        acted_frac=f32(jnp.sum(acted_BxT)) / tok_div,
        acted_seq_frac=f32(jnp.sum(acted_B & has_tokens_B)) / seq_div,
        abs_logk_mean=jnp.sum(abs_logk_BxT) / tok_div,
        abs_logk_max=jnp.max(abs_logk_BxT, initial=0.0),
        logk_mean=jnp.sum(logk_BxT) / tok_div,
        k3=tok_mean(_k3(logk_BxT)),
        chi2=tok_mean(jnp.expm1(2.0 * logk_BxT)),
        weight_mean=jnp.sum(w_BxT) / tok_div,
        weight_max=jnp.max(w_BxT, initial=0.0),
        tokens=tokens,
        seqs=seqs,
        nan_logprobs=f32(nan_count),
        nonfinite_logk=f32(jnp.sum(mask_BxT & ~finite_BxT & ~nan_BxT)),
    )
    metrics = {key: lax.stop_gradient(f32(v)) for key, v in metrics.items()}
    return Correction(w_BxT, acted_BxT, metrics)


def correction_weights(method: str, train_logprobs, infer_logprobs, mask, **hparams) -> tuple[jax.Array, dict]:
    """(weights [B, T] fp32 stop-gradient, metrics) of the operator `method`; `hparams` and the semantics are
    correction()'s."""
    out = correction(method, train_logprobs, infer_logprobs, mask, **hparams)
    return out.weights_BxT, out.metrics


def combine_metrics(metrics) -> dict:
    """Metrics of several micro-batches -> the metrics of their union, exactly (up to fp32 rounding).

    `metrics` is a sequence of dicts with the same keys, or one dict of arrays stacked along axis 0 (lax.scan's
    output). Every dict must hold "tokens" and "seqs". Rules: keys in SUM_KEYS ("tokens", "seqs", "nan_logprobs",
    "nonfinite_logk") add up; keys ending in "_max" combine by max; "acted_seq_frac" and keys starting with "seq_"
    (cisjax.rl.loss's per-response metrics) are means over sequences, weighted by "seqs"; every other key is a mean
    over valid tokens, weighted by "tokens". Micro-batches without tokens (means 0) contribute nothing.
    """
    if isinstance(metrics, Mapping):
        stacked = {key: jnp.asarray(v, jnp.float32) for key, v in metrics.items()}
    else:
        if not isinstance(metrics, Sequence) or not metrics:
            raise ValueError("combine_metrics needs a non-empty list of metric dicts or a dict of stacked arrays")
        keys = set(metrics[0])
        for m in metrics[1:]:
            if set(m) != keys:
                raise ValueError(f"micro-batch metrics differ in keys: {sorted(keys ^ set(m))}")
        stacked = {key: jnp.stack([jnp.asarray(m[key], jnp.float32) for m in metrics]) for key in metrics[0]}
    for key in ("tokens", "seqs"):
        if key not in stacked:
            raise ValueError(f"combine_metrics needs the {key!r} count in every micro-batch's metrics")
    tokens_M, seqs_M = stacked["tokens"], stacked["seqs"]
    out = {}
    for key, v_M in stacked.items():
        if key in SUM_KEYS:
            out[key] = jnp.sum(v_M)
        elif key.endswith("_max"):
            out[key] = jnp.max(v_M)
        elif key == "acted_seq_frac" or key.startswith("seq_"):
            out[key] = jnp.sum(v_M * seqs_M) / jnp.maximum(jnp.sum(seqs_M), 1.0)
        else:
            out[key] = jnp.sum(v_M * tokens_M) / jnp.maximum(jnp.sum(tokens_M), 1.0)
    return out
