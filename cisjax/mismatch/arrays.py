"""The mismatch statistics' conventions: validated flat float64 arrays, bins, quantiles, MAD, fractions."""

from __future__ import annotations

import math

import numpy as np

# Notation (paper Section 2.1 and Appendix A): per sampled token, logp = log p (training engine), logq = log q
# (inference engine, recorded at the sampling step), log k = logp - logq, eps = logit p - logit q
# (lem:ratio_displacement).
# Paper references name the LaTeX labels (tab:..., fig:..., eq:...): the printed numbers depend on the build.
# Every function takes flat 1-D arrays, computes in float64, and loops in Python only over bins, never over tokens.
# Quantiles are numpy's default (linear interpolation between order statistics); sd is the population sd (ddof=0);
# MAD is the raw median absolute deviation median(|x - median(x)|), with no 1.4826 normal-consistency factor;
# "P(|x| > t)" is strict. Empty selections give NaN statistics and zero counts.


def flat(name, x):
    """x as a 1-D float64 array; ValueError on other shapes or non-numeric dtypes."""
    a = np.asarray(x)
    if a.ndim != 1:
        raise ValueError(f"{name} must be a flat 1-D array, got shape {a.shape}")
    if a.dtype.kind not in "fiu":
        raise ValueError(f"{name} must be a real numeric array, got dtype {a.dtype}")
    return a.astype(np.float64, copy=False)


def check_logprobs(name, a):
    """Log-probabilities: no NaN, none > 0 (-inf, a probability of 0, is allowed)."""
    n_nan = int(np.count_nonzero(np.isnan(a)))
    if n_nan:
        raise ValueError(f"{name} has {n_nan} NaN log-probabilities")
    n_pos = int(np.count_nonzero(a > 0))
    if n_pos:
        raise ValueError(f"{name} has {n_pos} positive log-probabilities (max {a.max()!r}); log-probabilities are <= 0")


def checked_logprobs(logp, logq):
    """(logp, logq) validated: same length, flat, no NaN, <= 0; float64."""
    lp, lq = flat("logp", logp), flat("logq", logq)
    if lp.shape != lq.shape:
        raise ValueError(f"logp has {lp.size} tokens but logq has {lq.size}")
    check_logprobs("logp", lp)
    check_logprobs("logq", lq)
    return lp, lq


def quantile_values(x, qs):
    """np.quantile (linear) of x at qs; NaN for an empty x."""
    if x.size == 0:
        return np.full(len(qs), np.nan)
    return np.quantile(x, qs)


def median_mad(x):
    """(median, MAD = median |x - median|) of x; NaN for an empty x."""
    if x.size == 0:
        return math.nan, math.nan
    med = float(np.median(x))
    return med, float(np.median(np.abs(x - med)))


def fraction(count, total):
    """count / total; NaN for a total of 0."""
    return count / total if total else math.nan


def qkey(q):
    """0.99 -> 'q99', 0.999 -> 'q99.9' (the paper's q_99, q_99.9)."""
    return f"q{round(q * 100, 6):g}"


def group(bin_N, n_bins, *values_N):
    """Tokens grouped by bin (bin_N in [0, n_bins), -1 = dropped): counts [n_bins], [[values of bin b] per array]."""
    keep = bin_N >= 0
    bin_N = bin_N[keep]
    counts = np.bincount(bin_N, minlength=n_bins)
    order = np.argsort(bin_N, kind="stable")  # small ints: radix sort, O(N)
    bounds = np.concatenate([[0], np.cumsum(counts)])
    groups = []
    for v in values_N:
        v = v[keep][order]
        groups.append([v[bounds[b] : bounds[b + 1]] for b in range(n_bins)])
    return counts, groups


def p_bins(lp, p_edges):
    """Confidence bin of each token, left-closed: 0 = p < e_0, i = e_{i-1} <= p < e_i, last = p >= e_last.

    Compared in log space (log p >= log e), so that logp = np.log(e) in float64 lands exactly on the edge."""
    edges = np.asarray(p_edges, np.float64)
    if edges.ndim != 1 or edges.size == 0 or np.any(np.diff(edges) <= 0) or edges[0] <= 0 or edges[-1] > 1:
        raise ValueError(f"p_edges must be increasing inner edges in (0, 1], got {p_edges!r}")
    return np.searchsorted(np.log(edges), lp, side="right"), edges


def p_labels(edges):
    labels = [f"p<{edges[0]:g}"]
    labels += [f"{a:g}<=p<{b:g}" for a, b in zip(edges[:-1], edges[1:])]
    return labels + [f"p>={edges[-1]:g}"]


def log1mexp(logp):
    """log(1 - p) from log p, accurate at both ends (Maechler 2012): log(-expm1(x)) for x > -log 2, where 1 - p is
    small and expm1 keeps its digits; log1p(-exp(x)) below, where exp(x) is small. -inf at x = 0 (p == 1)."""
    x = np.asarray(logp, np.float64)
    out = np.empty_like(x)
    near_one = x > -math.log(2.0)
    with np.errstate(divide="ignore"):
        out[near_one] = np.log(-np.expm1(x[near_one]))
        out[~near_one] = np.log1p(-np.exp(x[~near_one]))
    return out
