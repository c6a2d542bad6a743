"""Statistics of the training-inference mismatch (paper Appendix A, Sections 3-4): numpy over flat per-token arrays.

Pure functions: the operators' parameters are arguments (the commands supply configs/base.py's, via
analysis.operator_defaults); where each operator acts, which runs the training code path in JAX, is mismatch.acted.
"""

from __future__ import annotations

import math

import numpy as np

from cisjax.mismatch.arrays import (
    checked_logprobs,
    flat,
    fraction,
    group,
    log1mexp,
    median_mad,
    p_bins,
    p_labels,
    qkey,
    quantile_values,
)

# Conventions (notation, float64, quantiles, MAD, empty selections): cisjax.mismatch.arrays.

# p bins of tab:appA_confidence (Appendix A.6): p < 0.5, [0.5, 0.9), [0.9, 0.99), [0.99, 0.999), p >= 0.999.
CONFIDENCE_EDGES = (0.5, 0.9, 0.99, 0.999)
# 18 log-spaced bins of 1 - p, edges 10^(-6 + i/3): "six orders of magnitude" (Section 3.3) whose geometric bin
# centres 1.47e-6 ... 0.681 are the "1 - p ~ 1.5e-6 to 0.68" the paper's 18 bins span (Appendix A.6).
UNCERTAINTY_EDGES = np.logspace(-6.0, 0.0, 19)
UNCERTAINTY_EDGES.flags.writeable = False
# Appendix A.6 retains tokens with 1 - p >= 1e-7 for the confidence analysis (and its Spearman correlation).
MIN_UNCERTAINTY = 1e-7
# alpha grid of fig:mgf / Appendix A.7 (E[e^{alpha eps}] and E[((1 - p) e^eps)^alpha]).
ALPHAS = np.linspace(0.0, 2.0, 21)
ALPHAS.flags.writeable = False


# ----------------------------------------------------------------------------- 1. the displacement eps


def _eps(lp, lq):
    """(eps with NaN where not finite, log(1 - p)) of validated float64 logprobs."""
    l1p, l1q = log1mexp(lp), log1mexp(lq)
    with np.errstate(invalid="ignore"):
        # Grouped as (logp - logq) - (log(1-p) - log(1-q)): each difference is of like-sized terms, and logp - logq
        # is the ratio the engines actually disagree on (a naive log(p/(1-p)) loses 1 - p near p = 1).
        eps = (lp - lq) - (l1p - l1q)
    eps[~np.isfinite(eps)] = np.nan
    return eps, l1p


def eps_from_logprobs(logp, logq):
    """Log-odds displacement eps = logit p - logit q (lem:ratio_displacement, eq:k_geometry; Appendix A.1), float64 [N].

    logit p = log p - log(1 - p) with log(1 - p) = log1mexp(log p): accurate for p -> 1 (log p = -1e-12 gives
    1 - p = 1e-12 to full precision) and for p -> 0 (log p = -800 gives logit p = -800 although p underflows).
    NaN exactly where eps is not finite: p or q rounds to 1 (log p = 0, log(1 - p) = -inf; the paper computes eps
    "whenever neither p nor q rounds to one", Appendix A.5) or to 0 (log p = -inf). np.isfinite(eps) is the mask.
    """
    lp, lq = checked_logprobs(logp, logq)
    return _eps(lp, lq)[0]


def identity_max_error(logp, logq, eps):
    """max over tokens with finite eps of |log k - log(p + (1 - p) e^eps)| (eq:k_geometry: k = p + (1 - p) e^eps).

    In log space, i.e. the largest relative error of the identity, because k spans e^-20 ... e^20. The right-hand
    side is logaddexp(log p, log(1 - p) + eps). NaN when no token has a finite eps."""
    lp, lq = checked_logprobs(logp, logq)
    eps = flat("eps", eps)
    if eps.shape != lp.shape:
        raise ValueError(f"eps has {eps.size} tokens but logp has {lp.size}")
    ok = np.isfinite(eps)
    if not ok.any():
        return math.nan
    lp, lq, eps = lp[ok], lq[ok], eps[ok]
    rhs = np.logaddexp(lp, log1mexp(lp) + eps)
    return float(np.max(np.abs((lp - lq) - rhs)))


# ----------------------------------------------------------------------------- 3-6. eps: tails, confidence bins


def eps_stats(logp, logq, quantiles=(0.95, 0.99, 0.999), thresholds=(1.0, 2.0)):
    """tab:appA_epsilon_stats (Appendix A.5): a dict of
    tokens, finite (tokens with finite eps: neither p nor q rounds to 1 or 0), finite_frac, and over finite eps:
    mean, sd, q95_abs / q99_abs / q99.9_abs = quantiles of |eps|, frac_abs_gt_{t} = P(|eps| > t) (strict), max_abs.
    """
    lp, lq = checked_logprobs(logp, logq)
    eps = _eps(lp, lq)[0]
    e = eps[np.isfinite(eps)]
    n = e.size
    out = dict(
        tokens=lp.size,
        finite=n,
        finite_frac=fraction(n, lp.size),
        mean=float(e.mean()) if n else math.nan,
        sd=float(e.std()) if n else math.nan,
    )
    a = np.abs(e)
    for q, v in zip(quantiles, quantile_values(a, quantiles)):
        out[f"{qkey(q)}_abs"] = float(v)
    for t in thresholds:
        out[f"frac_abs_gt_{t:g}"] = fraction(int(np.count_nonzero(a > t)), n)
    out["max_abs"] = float(a.max()) if n else math.nan
    return out


def eps_by_confidence(logp, logq, p_edges=CONFIDENCE_EDGES):
    """tab:appA_confidence (Appendix A.6): eps and log k per confidence bin of p, over tokens with finite eps.

    Bins left-closed on p (default p<0.5 | 0.5<=p<0.9 | 0.9<=p<0.99 | 0.99<=p<0.999 | p>=0.999; see _p_bins).
    Returns labels and arrays [n_bins]: tokens, median_eps, mad_eps = median |eps - median eps|, q05_eps, q95_eps,
    mad_logk = median |log k - median log k|. (The paper's bin counts add up to its finite-eps total, so log k is
    taken over the same finite-eps tokens.)"""
    lp, lq = checked_logprobs(logp, logq)
    eps = _eps(lp, lq)[0]
    ok = np.isfinite(eps)
    bin_N, edges = p_bins(lp, p_edges)
    bin_N = np.where(ok, bin_N, -1)
    n_bins = edges.size + 1
    counts, (eps_g, logk_g) = group(bin_N, n_bins, eps, lp - lq)
    cols = {key: np.full(n_bins, np.nan) for key in ("median_eps", "mad_eps", "q05_eps", "q95_eps", "mad_logk")}
    for b in range(n_bins):
        cols["median_eps"][b], cols["mad_eps"][b] = median_mad(eps_g[b])
        cols["q05_eps"][b], cols["q95_eps"][b] = quantile_values(eps_g[b], (0.05, 0.95))
        cols["mad_logk"][b] = median_mad(logk_g[b])[1]
    return dict(labels=p_labels(edges), tokens=counts, **cols)


def floor_uncertainty_edges(kappa, n_bins=18):
    """n_bins log-spaced bins of 1 - p from the floor kappa to 1 (Appendix A.6, the region where CIS acts)."""
    if not 0 < kappa < 1:
        raise ValueError(f"kappa={kappa} must lie in (0, 1)")
    return np.geomspace(kappa, 1.0, n_bins + 1)


def uncertainty_bins(logp, logq, edges=UNCERTAINTY_EDGES, min_tokens=1):
    """Appendix A.6 / fig:appA_confidence: median and MAD of eps and MAD of log k across bins of u = 1 - p.

    Tokens with finite eps and edges[0] <= u <= edges[-1]; bin i is edges[i] <= u < edges[i+1], the last bin also
    closed above. u = -expm1(log p), exact near p = 1. Returns
      edges, centers (geometric), arrays [n_bins]: tokens, median_eps, mad_eps, mad_logk;
      and over the bins with >= min_tokens tokens: mad_eps_ratio = max / min of mad_eps (the paper's 1.8, 1.3),
      mad_logk_ratio (3.2e5, 115), max_abs_median_eps (0.006). inf when a counted MAD is 0, NaN with no bin.
    """
    lp, lq = checked_logprobs(logp, logq)
    e = np.asarray(edges, np.float64)
    if e.ndim != 1 or e.size < 2 or np.any(np.diff(e) <= 0) or e[0] <= 0 or e[-1] > 1:
        raise ValueError(f"edges must be increasing bin edges of 1 - p in (0, 1], got {edges!r}")
    eps = _eps(lp, lq)[0]
    u = -np.expm1(lp)
    n_bins = e.size - 1
    bin_N = np.searchsorted(e, u, side="right") - 1
    bin_N[u == e[-1]] = n_bins - 1  # the last bin is closed above
    bin_N[(bin_N >= n_bins) | ~np.isfinite(eps)] = -1
    counts, (eps_g, logk_g) = group(bin_N, n_bins, eps, lp - lq)
    med, mad_e, mad_k = (np.full(n_bins, np.nan) for _ in range(3))
    for b in range(n_bins):
        med[b], mad_e[b] = median_mad(eps_g[b])
        mad_k[b] = median_mad(logk_g[b])[1]
    used = counts >= max(min_tokens, 1)

    def ratio(x):
        if not used.any():
            return math.nan
        lo, hi = x[used].min(), x[used].max()
        return float(hi / lo) if lo > 0 else math.inf

    return dict(
        edges=e,
        centers=np.sqrt(e[:-1] * e[1:]),
        tokens=counts,
        median_eps=med,
        mad_eps=mad_e,
        mad_logk=mad_k,
        mad_eps_ratio=ratio(mad_e),
        mad_logk_ratio=ratio(mad_k),
        max_abs_median_eps=float(np.abs(med[used]).max()) if used.any() else math.nan,
    )


def average_ranks(x):
    """1-based ranks of x; tied values share the mean of the ranks they span (scipy.stats.rankdata 'average')."""
    x = np.asarray(x)
    n = x.size
    order = np.argsort(x, kind="stable")
    xs = x[order]
    new_run = np.empty(n, bool)
    new_run[:1] = True
    np.not_equal(xs[1:], xs[:-1], out=new_run[1:])
    starts = np.flatnonzero(new_run)  # 0-based start of each run of equal values
    ends = np.append(starts[1:], n)  # exclusive end
    ranks = np.empty(n, np.float64)
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)  # mean of the 1-based ranks start+1 .. end
    return ranks


def _pearson(x, y):
    x, y = x - x.mean(), y - y.mean()
    den = math.sqrt(float(np.dot(x, x)) * float(np.dot(y, y)))
    return float(np.dot(x, y)) / den if den > 0 else math.nan


def spearman(x, y):
    """Spearman rank correlation: the Pearson correlation of the average ranks of x and y (ties share their mean
    rank). NaN when either input is constant or has fewer than 2 values; x and y must be finite."""
    x, y = flat("x", x), flat("y", y)
    if x.shape != y.shape:
        raise ValueError(f"x has {x.size} values but y has {y.size}")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        raise ValueError("spearman needs finite values")
    if x.size < 2:
        return math.nan
    return _pearson(average_ranks(x), average_ranks(y))


def confidence_invariance(logp, logq, kappa, min_tokens=1, max_tokens=None, seed=0):
    """Appendix A.6 in one call: uncertainty_bins and Spearman correlations with log(1 - p), in two regions.

      "all":   tokens with finite eps and 1 - p >= 1e-7, bins UNCERTAINTY_EDGES (1e-6 ... 1, 18 bins);
      "floor": tokens with finite eps and 1 - p >= kappa, bins floor_uncertainty_edges(kappa) (kappa ... 1, 18 bins).
    Each region holds the uncertainty_bins dict plus tokens_in_region, spearman_eps = rho(eps, log(1 - p)) (the
    paper's -0.028 on "all") and spearman_abs_eps = rho(|eps|, log(1 - p)) (its -0.12 on "floor"). max_tokens: the
    correlations use a uniform random subsample of that many tokens of the region (the paper: 300,000), seeded.
    kappa: CIS's floor (the region "floor").
    """
    lp, lq = checked_logprobs(logp, logq)
    eps, l1p = _eps(lp, lq)
    ok = np.isfinite(eps)
    out = {}
    for name, lower, edges in (
        ("all", MIN_UNCERTAINTY, UNCERTAINTY_EDGES),
        ("floor", kappa, floor_uncertainty_edges(kappa)),
    ):
        sel = ok & (l1p >= math.log(lower))
        region = uncertainty_bins(lp[sel], lq[sel], edges, min_tokens=min_tokens)
        idx = np.flatnonzero(sel)
        if max_tokens is not None and idx.size > max_tokens:
            idx = np.sort(np.random.default_rng(seed).choice(idx, size=max_tokens, replace=False))
        region["tokens_in_region"] = int(sel.sum())
        if idx.size >= 2:
            r_u, e = average_ranks(l1p[idx]), eps[idx]  # the ranks of log(1 - p) serve both correlations
            region["spearman_eps"] = _pearson(average_ranks(e), r_u)
            region["spearman_abs_eps"] = _pearson(average_ranks(np.abs(e)), r_u)
        else:
            region["spearman_eps"] = region["spearman_abs_eps"] = math.nan
        out[name] = region
    return out


# ----------------------------------------------------------------------------- 7-9. moments, variance, bias


def displacement_moments(logp, logq, alphas=ALPHAS):
    """fig:mgf / Appendix A.7 over tokens with finite eps: arrays [len(alphas)]
      raw = E[e^{alpha eps}],  weighted = E[((1 - p) e^eps)^alpha] = E[exp(alpha (log(1 - p) + eps))],
    the latter the term of thm:exact_risk's bound (eq:exact_risk); plus tokens (the finite-eps count). Computed in
    log space so that (1 - p) never rounds to 0 before it meets e^eps."""
    lp, lq = checked_logprobs(logp, logq)
    eps, l1p = _eps(lp, lq)
    ok = np.isfinite(eps)
    e, w = eps[ok], l1p[ok] + eps[ok]
    a = flat("alphas", alphas)
    raw, weighted = np.full(a.size, np.nan), np.full(a.size, np.nan)
    if e.size:
        with np.errstate(over="ignore"):  # a heavy tail may overflow at large alpha: the mean is then inf
            for i, alpha in enumerate(a):
                raw[i] = np.mean(np.exp(alpha * e))
                weighted[i] = np.mean(np.exp(alpha * w))
    return dict(alphas=a, raw=raw, weighted=weighted, tokens=int(e.size))


def variance_share_by_side(logp, logq, center=1.0):
    """Share of Var(k) on each side of log k = 0 (Section 4.3, fig:rq2_bv a: "tokens with k > 1 account for 99.96%").

    Over tokens with finite log k: S = sum_t (k_t - c)^2; share_upper = sum_{k>1} (k - c)^2 / S, share_lower =
    sum_{k<1} (k - c)^2 / S, share_at_one = the k == 1 remainder; var = S / tokens. c = center, default 1: the
    calibration identity E[k | h] = 1 (Appendix C.4) makes E[(k - 1)^2] = Var(k), and the two sides then partition S
    exactly, as the paper's 99.96% + 0.04% do. center=None uses the sample mean of k (the sample variance)."""
    lp, lq = checked_logprobs(logp, logq)
    logk = lp - lq
    k = np.exp(logk[np.isfinite(logk)])
    n = k.size
    if center is not None:
        c = float(center)
    else:
        c = float(k.mean()) if n else math.nan
    sq = (k - c) ** 2
    total = float(sq.sum())
    up, lo = float(sq[k > 1].sum()), float(sq[k < 1].sum())
    share = (lambda x: x / total) if total > 0 else (lambda x: math.nan)
    return dict(
        tokens=n,
        center=c,
        var=total / n if n else math.nan,
        share_upper=share(up),
        share_lower=share(lo),
        share_at_one=share(total - up - lo),
    )


def truncation_bias(logp, logq, *, lam, kappa, cap, p_edges=CONFIDENCE_EDGES):
    """fig:rq2_bv b (Section 4.3) and Appendix D.5: the truncation bias E[k - f(k)] per confidence bin, CIS vs TIS.

      CIS (Algorithm 1): f = min(k, 1 + lam * max(1 - p, kappa)), so k - f = (k - 1 - lam * max(1 - p, kappa))_+;
      TIS:               f = min(k, C),                              so k - f = (k - C)_+.
    Over tokens with finite log k, in float64 (the operators' fp32 weights would leave rounding noise in k - f on
    every token). Bins of p as eps_by_confidence. Returns labels and arrays [n_bins]: tokens; per operator
    (prefix cis_ / tis_): acted (tokens with k > cap), excess_sum = sum (k - f), bias = excess_sum / tokens; and
    the totals cis_bias / tis_bias over all tokens. Shares such as "half of CIS's removed weight from p < 0.9" are
    ratios of excess_sum (pass the edges wanted). lam, kappa: CIS's; cap: TIS's C."""
    lp, lq = checked_logprobs(logp, logq)
    logk = lp - lq
    ok = np.isfinite(logk)
    lp = lp[ok]
    k = np.exp(logk[ok])
    phi = np.maximum(-np.expm1(lp), kappa)
    excess = {"cis": np.maximum(k - (1.0 + lam * phi), 0.0), "tis": np.maximum(k - cap, 0.0)}
    bin_N, edges = p_bins(lp, p_edges)
    n_bins = edges.size + 1
    tokens = np.bincount(bin_N, minlength=n_bins)
    out = dict(labels=p_labels(edges), tokens=tokens)
    with np.errstate(invalid="ignore"):
        for name, x in excess.items():
            out[f"{name}_acted"] = np.bincount(bin_N, weights=x > 0, minlength=n_bins).astype(np.int64)
            out[f"{name}_excess_sum"] = np.bincount(bin_N, weights=x, minlength=n_bins)
            out[f"{name}_bias"] = out[f"{name}_excess_sum"] / tokens
            out[f"{name}_bias_total"] = float(x.mean()) if x.size else math.nan
    return out
