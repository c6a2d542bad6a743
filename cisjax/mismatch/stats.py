"""Statistics of the training-inference mismatch (paper Appendix A, Sections 3-4): numpy over flat per-token arrays.

One piece, though over 500 lines: every statistic shares the conventions stated below (flat float64 arrays, the
same validation, bins, quantile, MAD and sd definitions) and the private helpers that implement them (_logprobs,
_group, _p_bins, _median_mad); split, each part would import the others' private helpers and restate the conventions.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import numpy as np

from cisjax import config as config_lib
from cisjax.rl import corrections

# Notation (paper Section 2.1 and Appendix A): per sampled token, logp = log p (training engine), logq = log q
# (inference engine, recorded at the sampling step), log k = logp - logq, eps = logit p - logit q
# (lem:ratio_displacement).
# Paper references name the LaTeX labels (tab:..., fig:..., eq:...): the printed numbers depend on the build.
# Every function takes flat 1-D arrays, computes in float64, and loops in Python only over bins, never over tokens.
# Quantiles are numpy's default (linear interpolation between order statistics); sd is the population sd (ddof=0);
# MAD is the raw median absolute deviation median(|x - median(x)|), with no 1.4826 normal-consistency factor;
# "P(|x| > t)" is strict. Empty selections give NaN statistics and zero counts.

# p bins of tab:appA_confidence (Appendix A.6): p < 0.5, [0.5, 0.9), [0.9, 0.99), [0.99, 0.999), p >= 0.999.
CONFIDENCE_EDGES = (0.5, 0.9, 0.99, 0.999)
# 18 log-spaced bins of 1 - p, edges 10^(-6 + i/3): "six orders of magnitude" (Section 3.3) whose geometric bin
# centres 1.47e-6 ... 0.681 are the "1 - p ~ 1.5e-6 to 0.68" the paper's 18 bins span (Appendix A.6).
UNCERTAINTY_EDGES = np.logspace(-6.0, 0.0, 19)
UNCERTAINTY_EDGES.flags.writeable = False
# Appendix A.6 retains tokens with 1 - p >= 1e-7 for the confidence analysis (and its Spearman correlation).
MIN_UNCERTAINTY = 1e-7
# N_flip bins of tab:appA_routing (Appendix A.3): 0, 1, 2-3, 4-6, >= 7 (lower edges, each bin [e_i, e_{i+1})).
NFLIP_EDGES = (0, 1, 2, 4, 7)
# alpha grid of fig:mgf / Appendix A.7 (E[e^{alpha eps}] and E[((1 - p) e^eps)^alpha]).
ALPHAS = np.linspace(0.0, 2.0, 21)
ALPHAS.flags.writeable = False
SEQ_METHODS = ("seq_tis", "seq_mis")


class OperatorDefaults(NamedTuple):
    """The operators' defaults (paper tab:baselines): CIS lambda and kappa, TIS cap C, KPop's threshold phi."""

    lam: float
    kappa: float
    cap: float
    threshold: float


@functools.cache
def operator_defaults() -> OperatorDefaults:
    """The operators' defaults as base.py's correction.* sets them (that file is their one source: the checkout's
    configs/base.py, or the copy the wheel ships; config.configs_dir), read on first use, not at import."""
    c = config_lib.load(None).correction
    return OperatorDefaults(float(c.lam), float(c.kappa), float(c.cap), float(c.threshold))


def _or_defaults(**given) -> list[float]:
    """The values of `given` (lam, kappa, cap, threshold), each None replaced by operator_defaults()'s."""
    defaults = operator_defaults()._asdict()
    return [defaults[name] if value is None else value for name, value in given.items()]


# ----------------------------------------------------------------------------- validation and helpers


def _flat(name, x):
    """x as a 1-D float64 array; ValueError on other shapes or non-numeric dtypes."""
    a = np.asarray(x)
    if a.ndim != 1:
        raise ValueError(f"{name} must be a flat 1-D array, got shape {a.shape}")
    if a.dtype.kind not in "fiu":
        raise ValueError(f"{name} must be a real numeric array, got dtype {a.dtype}")
    return a.astype(np.float64, copy=False)


def _check_logprobs(name, a):
    """Log-probabilities: no NaN, none > 0 (-inf, a probability of 0, is allowed)."""
    n_nan = int(np.count_nonzero(np.isnan(a)))
    if n_nan:
        raise ValueError(f"{name} has {n_nan} NaN log-probabilities")
    n_pos = int(np.count_nonzero(a > 0))
    if n_pos:
        raise ValueError(f"{name} has {n_pos} positive log-probabilities (max {a.max()!r}); log-probabilities are <= 0")


def _logprobs(logp, logq):
    """(logp, logq) validated: same length, flat, no NaN, <= 0; float64."""
    lp, lq = _flat("logp", logp), _flat("logq", logq)
    if lp.shape != lq.shape:
        raise ValueError(f"logp has {lp.size} tokens but logq has {lq.size}")
    _check_logprobs("logp", lp)
    _check_logprobs("logq", lq)
    return lp, lq


def _quantiles(x, qs):
    """np.quantile (linear) of x at qs; NaN for an empty x."""
    if x.size == 0:
        return np.full(len(qs), np.nan)
    return np.quantile(x, qs)


def _median_mad(x):
    """(median, MAD = median |x - median|) of x; NaN for an empty x."""
    if x.size == 0:
        return math.nan, math.nan
    med = float(np.median(x))
    return med, float(np.median(np.abs(x - med)))


def _frac(count, total):
    return count / total if total else math.nan


def _qkey(q):
    """0.99 -> 'q99', 0.999 -> 'q99.9' (the paper's q_99, q_99.9)."""
    return f"q{round(q * 100, 6):g}"


def _group(bin_N, n_bins, *values_N):
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


def _p_bins(lp, p_edges):
    """Confidence bin of each token, left-closed: 0 = p < e_0, i = e_{i-1} <= p < e_i, last = p >= e_last.

    Compared in log space (log p >= log e), so that logp = np.log(e) in float64 lands exactly on the edge."""
    edges = np.asarray(p_edges, np.float64)
    if edges.ndim != 1 or edges.size == 0 or np.any(np.diff(edges) <= 0) or edges[0] <= 0 or edges[-1] > 1:
        raise ValueError(f"p_edges must be increasing inner edges in (0, 1], got {p_edges!r}")
    return np.searchsorted(np.log(edges), lp, side="right"), edges


def _p_labels(edges):
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
    lp, lq = _logprobs(logp, logq)
    return _eps(lp, lq)[0]


def identity_max_error(logp, logq, eps):
    """max over tokens with finite eps of |log k - log(p + (1 - p) e^eps)| (eq:k_geometry: k = p + (1 - p) e^eps).

    In log space, i.e. the largest relative error of the identity, because k spans e^-20 ... e^20. The right-hand
    side is logaddexp(log p, log(1 - p) + eps). NaN when no token has a finite eps."""
    lp, lq = _logprobs(logp, logq)
    eps = _flat("eps", eps)
    if eps.shape != lp.shape:
        raise ValueError(f"eps has {eps.size} tokens but logp has {lp.size}")
    ok = np.isfinite(eps)
    if not ok.any():
        return math.nan
    lp, lq, eps = lp[ok], lq[ok], eps[ok]
    rhs = np.logaddexp(lp, log1mexp(lp) + eps)
    return float(np.max(np.abs((lp - lq) - rhs)))


# ----------------------------------------------------------------------------- 2. per-logit perturbation delta


def paired_topk(ids_train_TxK, logp_train_TxK, ids_infer_TxK, logp_infer_TxK):
    """Paired top-K entries: (delta_N, pos_N), delta_j = log pi_infer(j | h_t) - log pi_train(j | h_t).

    Appendix A.1: at each position t both engines record their top-K token ids with normalised log-probabilities;
    the pairs are the ids in both sets at the same t. The gauge is the paper's eq:app_delta_gauge: the normalised
    log-probability difference, NOT centred per position (it differs from the raw logit difference by a
    per-position constant, which eps does not depend on). ids < 0 are padding and ignored; ids must be unique within
    a row; logprobs of real entries must be finite and <= 0. K may differ between the engines. Output sorted by
    (position, id); pos_N indexes the T positions (for delta_by_nflip).
    """
    keys, vals = [], []
    t_rows = None
    for side, ids, lps in (("train", ids_train_TxK, logp_train_TxK), ("infer", ids_infer_TxK, logp_infer_TxK)):
        ids, lps = np.asarray(ids), np.asarray(lps)
        if ids.ndim != 2 or ids.shape != lps.shape:
            raise ValueError(f"ids_{side} {ids.shape} and logp_{side} {lps.shape} must be the same [T, K] shape")
        if ids.dtype.kind not in "iu":
            raise ValueError(f"ids_{side} must be integer token ids, got dtype {ids.dtype}")
        if t_rows is None:
            t_rows = ids.shape[0]
        elif ids.shape[0] != t_rows:
            raise ValueError(f"train has {t_rows} positions but infer has {ids.shape[0]}")
        real = ids >= 0
        lp = lps[real].astype(np.float64)
        if not np.all(np.isfinite(lp)):
            raise ValueError(f"logp_{side} has non-finite log-probabilities on real (id >= 0) entries")
        _check_logprobs(f"logp_{side}", lp)
        t_idx = np.broadcast_to(np.arange(ids.shape[0], dtype=np.int64)[:, None], ids.shape)[real]
        keys.append((t_idx, ids[real].astype(np.int64)))
        vals.append(lp)
    vocab = 1 + max([int(i.max()) for _, i in keys if i.size] + [0])
    if t_rows and vocab > np.iinfo(np.int64).max // t_rows:
        raise ValueError("positions * vocabulary overflow int64 keys")
    flat = [t * vocab + i for t, i in keys]  # one int64 key per (position, id)
    for side, k in zip(("train", "infer"), flat):
        if np.unique(k).size != k.size:
            raise ValueError(f"ids_{side} repeats a token id within a position")
    common, i_train, i_infer = np.intersect1d(flat[0], flat[1], assume_unique=True, return_indices=True)
    return vals[1][i_infer] - vals[0][i_train], common // vocab


def delta_stats(delta, thresholds=(0.5, 1.0), quantiles=(0.99, 0.999)):
    """tab:appA_delta_stats (Appendix A.2) of paired delta_j: a dict of
      entries, median, mean, sd, abs_mean_over_sd = |mean| / sd, q99_abs / q99.9_abs = quantiles of |delta|,
      frac_abs_gt_{t} = P(|delta| > t) (strict) for t in thresholds, max_abs, min, max (the range [min, max]).
    delta must be finite."""
    d = _flat("delta", delta)
    if not np.all(np.isfinite(d)):
        raise ValueError("delta has non-finite entries")
    n = d.size
    out = dict(entries=n)
    if n == 0:
        out.update(
            median=math.nan,
            mean=math.nan,
            sd=math.nan,
            abs_mean_over_sd=math.nan,
            max_abs=math.nan,
            min=math.nan,
            max=math.nan,
        )
    else:
        mean, sd = float(d.mean()), float(d.std())
        out.update(median=float(np.median(d)), mean=mean, sd=sd, abs_mean_over_sd=abs(mean) / sd if sd else math.nan)
    a = np.abs(d)
    for q, v in zip(quantiles, _quantiles(a, quantiles)):
        out[f"{_qkey(q)}_abs"] = float(v)
    for t in thresholds:
        out[f"frac_abs_gt_{t:g}"] = _frac(int(np.count_nonzero(a > t)), n)
    if n:
        out.update(max_abs=float(a.max()), min=float(d.min()), max=float(d.max()))
    return out


def n_flip(ids_a_LxTxK, ids_b_LxTxK, count_LxT=None):
    """N_flip per position [T] (Appendix A.3): the number of MoE layers whose top-k expert SETS differ between the
    two engines (order within the top-k ignored). count_LxT (bool, optional) restricts which (layer, position) pairs
    may count, e.g. the paper's "hard flips" whose gate margin exceeds 1e-3 (the caller defines the margin)."""
    a, b = np.asarray(ids_a_LxTxK), np.asarray(ids_b_LxTxK)
    if a.ndim != 3 or a.shape != b.shape:
        raise ValueError(f"expert ids must be the same [L, T, K] shape, got {a.shape} and {b.shape}")
    if a.dtype.kind not in "iu" or b.dtype.kind not in "iu":
        raise ValueError("expert ids must be integers")
    a, b = np.sort(a, axis=-1), np.sort(b, axis=-1)
    for name, s in (("ids_a", a), ("ids_b", b)):
        if np.any(s[..., 1:] == s[..., :-1]):
            raise ValueError(f"{name} repeats an expert within one (layer, position): not a top-k set")
    differ_LxT = np.any(a != b, axis=-1)
    if count_LxT is not None:
        count_LxT = np.asarray(count_LxT, bool)
        if count_LxT.shape != differ_LxT.shape:
            raise ValueError(f"count_LxT {count_LxT.shape} must be [L, T] = {differ_LxT.shape}")
        differ_LxT &= count_LxT
    return np.sum(differ_LxT, axis=0)


def delta_by_nflip(delta, pos, nflip_T, edges=NFLIP_EDGES, thresholds=(0.5, 1.0)):
    """tab:appA_routing (Appendix A.3): delta_j stratified by the N_flip of its position.

    Bins are [e_i, e_{i+1}) over the lower edges (default 0 | 1 | 2-3 | 4-6 | >=7); edges[0] must be 0. Returns
      labels, positions (count of the T positions per bin, whether or not they have pairs), position_frac,
      entries, sd (per-bin population sd of delta), frac_abs_gt_{t} = P(|delta| > t) per bin: arrays [n_bins];
      nflip_mean = mean N_flip over the T positions (the paper's 3.69).
    """
    d = _flat("delta", delta)
    pos = np.asarray(pos)
    nf = np.asarray(nflip_T)
    if pos.shape != d.shape or pos.dtype.kind not in "iu":
        raise ValueError(f"pos must be integer positions, one per delta ({d.size}), got {pos.shape} {pos.dtype}")
    if nf.ndim != 1 or nf.dtype.kind not in "iu" or (nf.size and nf.min() < 0):
        raise ValueError("nflip_T must be a flat array of non-negative integer counts")
    if pos.size and (pos.min() < 0 or pos.max() >= nf.size):
        raise ValueError(f"pos indexes {nf.size} positions but ranges over [{pos.min()}, {pos.max()}]")
    e = np.asarray(edges)
    if e.ndim != 1 or e.size == 0 or e[0] != 0 or np.any(np.diff(e) <= 0):
        raise ValueError(f"edges must be increasing integers starting at 0, got {edges!r}")
    n_bins = e.size
    bin_T = np.searchsorted(e, nf, side="right") - 1
    bin_N = bin_T[pos]
    positions = np.bincount(bin_T, minlength=n_bins)
    entries = np.bincount(bin_N, minlength=n_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.bincount(bin_N, weights=d, minlength=n_bins) / entries
        # two-pass variance: the per-bin mean first, then the mean squared deviation (no E[x^2] - E[x]^2 cancellation)
        sd = np.sqrt(np.bincount(bin_N, weights=(d - mean[bin_N]) ** 2, minlength=n_bins) / entries)
        labels = [(f"{a}" if b - a == 1 else f"{a}-{b - 1}") for a, b in zip(e[:-1], e[1:])] + [f">={e[-1]}"]
        out = dict(labels=labels, positions=positions, position_frac=positions / nf.size, entries=entries, sd=sd)
        for t in thresholds:
            out[f"frac_abs_gt_{t:g}"] = np.bincount(bin_N, weights=(np.abs(d) > t), minlength=n_bins) / entries
    out["nflip_mean"] = float(nf.mean()) if nf.size else math.nan
    return out


# ----------------------------------------------------------------------------- 3-6. eps: tails, confidence bins


def eps_stats(logp, logq, quantiles=(0.95, 0.99, 0.999), thresholds=(1.0, 2.0)):
    """tab:appA_epsilon_stats (Appendix A.5): a dict of
    tokens, finite (tokens with finite eps: neither p nor q rounds to 1 or 0), finite_frac, and over finite eps:
    mean, sd, q95_abs / q99_abs / q99.9_abs = quantiles of |eps|, frac_abs_gt_{t} = P(|eps| > t) (strict), max_abs.
    """
    lp, lq = _logprobs(logp, logq)
    eps = _eps(lp, lq)[0]
    e = eps[np.isfinite(eps)]
    n = e.size
    out = dict(
        tokens=lp.size,
        finite=n,
        finite_frac=_frac(n, lp.size),
        mean=float(e.mean()) if n else math.nan,
        sd=float(e.std()) if n else math.nan,
    )
    a = np.abs(e)
    for q, v in zip(quantiles, _quantiles(a, quantiles)):
        out[f"{_qkey(q)}_abs"] = float(v)
    for t in thresholds:
        out[f"frac_abs_gt_{t:g}"] = _frac(int(np.count_nonzero(a > t)), n)
    out["max_abs"] = float(a.max()) if n else math.nan
    return out


def eps_by_confidence(logp, logq, p_edges=CONFIDENCE_EDGES):
    """tab:appA_confidence (Appendix A.6): eps and log k per confidence bin of p, over tokens with finite eps.

    Bins left-closed on p (default p<0.5 | 0.5<=p<0.9 | 0.9<=p<0.99 | 0.99<=p<0.999 | p>=0.999; see _p_bins).
    Returns labels and arrays [n_bins]: tokens, median_eps, mad_eps = median |eps - median eps|, q05_eps, q95_eps,
    mad_logk = median |log k - median log k|. (The paper's bin counts add up to its finite-eps total, so log k is
    taken over the same finite-eps tokens.)"""
    lp, lq = _logprobs(logp, logq)
    eps = _eps(lp, lq)[0]
    ok = np.isfinite(eps)
    bin_N, edges = _p_bins(lp, p_edges)
    bin_N = np.where(ok, bin_N, -1)
    n_bins = edges.size + 1
    counts, (eps_g, logk_g) = _group(bin_N, n_bins, eps, lp - lq)
    cols = {key: np.full(n_bins, np.nan) for key in ("median_eps", "mad_eps", "q05_eps", "q95_eps", "mad_logk")}
    for b in range(n_bins):
        cols["median_eps"][b], cols["mad_eps"][b] = _median_mad(eps_g[b])
        cols["q05_eps"][b], cols["q95_eps"][b] = _quantiles(eps_g[b], (0.05, 0.95))
        cols["mad_logk"][b] = _median_mad(logk_g[b])[1]
    return dict(labels=_p_labels(edges), tokens=counts, **cols)


def floor_uncertainty_edges(kappa=None, n_bins=18):
    """n_bins log-spaced bins of 1 - p from the floor kappa (None: operator_defaults()) to 1 (Appendix A.6, the region
    where CIS acts)."""
    (kappa,) = _or_defaults(kappa=kappa)
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
    lp, lq = _logprobs(logp, logq)
    e = np.asarray(edges, np.float64)
    if e.ndim != 1 or e.size < 2 or np.any(np.diff(e) <= 0) or e[0] <= 0 or e[-1] > 1:
        raise ValueError(f"edges must be increasing bin edges of 1 - p in (0, 1], got {edges!r}")
    eps = _eps(lp, lq)[0]
    u = -np.expm1(lp)
    n_bins = e.size - 1
    bin_N = np.searchsorted(e, u, side="right") - 1
    bin_N[u == e[-1]] = n_bins - 1  # the last bin is closed above
    bin_N[(bin_N >= n_bins) | ~np.isfinite(eps)] = -1
    counts, (eps_g, logk_g) = _group(bin_N, n_bins, eps, lp - lq)
    med, mad_e, mad_k = (np.full(n_bins, np.nan) for _ in range(3))
    for b in range(n_bins):
        med[b], mad_e[b] = _median_mad(eps_g[b])
        mad_k[b] = _median_mad(logk_g[b])[1]
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
    x, y = _flat("x", x), _flat("y", y)
    if x.shape != y.shape:
        raise ValueError(f"x has {x.size} values but y has {y.size}")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        raise ValueError("spearman needs finite values")
    if x.size < 2:
        return math.nan
    return _pearson(average_ranks(x), average_ranks(y))


def confidence_invariance(logp, logq, kappa=None, min_tokens=1, max_tokens=None, seed=0):
    """Appendix A.6 in one call: uncertainty_bins and Spearman correlations with log(1 - p), in two regions.

      "all":   tokens with finite eps and 1 - p >= 1e-7, bins UNCERTAINTY_EDGES (1e-6 ... 1, 18 bins);
      "floor": tokens with finite eps and 1 - p >= kappa, bins floor_uncertainty_edges(kappa) (kappa ... 1, 18 bins).
    Each region holds the uncertainty_bins dict plus tokens_in_region, spearman_eps = rho(eps, log(1 - p)) (the
    paper's -0.028 on "all") and spearman_abs_eps = rho(|eps|, log(1 - p)) (its -0.12 on "floor"). max_tokens: the
    correlations use a uniform random subsample of that many tokens of the region (the paper: 300,000), seeded.
    kappa: None is operator_defaults()'s.
    """
    (kappa,) = _or_defaults(kappa=kappa)
    lp, lq = _logprobs(logp, logq)
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
    lp, lq = _logprobs(logp, logq)
    eps, l1p = _eps(lp, lq)
    ok = np.isfinite(eps)
    e, w = eps[ok], l1p[ok] + eps[ok]
    a = _flat("alphas", alphas)
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
    lp, lq = _logprobs(logp, logq)
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


def truncation_bias(logp, logq, p_edges=CONFIDENCE_EDGES, lam=None, kappa=None, cap=None):
    """fig:rq2_bv b (Section 4.3) and Appendix D.5: the truncation bias E[k - f(k)] per confidence bin, CIS vs TIS.

      CIS (Algorithm 1): f = min(k, 1 + lam * max(1 - p, kappa)), so k - f = (k - 1 - lam * max(1 - p, kappa))_+;
      TIS:               f = min(k, C),                              so k - f = (k - C)_+.
    Over tokens with finite log k, in float64 (the operators' fp32 weights would leave rounding noise in k - f on
    every token). Bins of p as eps_by_confidence. Returns labels and arrays [n_bins]: tokens; per operator
    (prefix cis_ / tis_): acted (tokens with k > cap), excess_sum = sum (k - f), bias = excess_sum / tokens; and
    the totals cis_bias / tis_bias over all tokens. Shares such as "half of CIS's removed weight from p < 0.9" are
    ratios of excess_sum (pass the edges wanted). lam, kappa, cap: None is operator_defaults()'s."""
    lam, kappa, cap = _or_defaults(lam=lam, kappa=kappa, cap=cap)
    lp, lq = _logprobs(logp, logq)
    logk = lp - lq
    ok = np.isfinite(logk)
    lp = lp[ok]
    k = np.exp(logk[ok])
    phi = np.maximum(-np.expm1(lp), kappa)
    excess = {"cis": np.maximum(k - (1.0 + lam * phi), 0.0), "tis": np.maximum(k - cap, 0.0)}
    bin_N, edges = _p_bins(lp, p_edges)
    n_bins = edges.size + 1
    tokens = np.bincount(bin_N, minlength=n_bins)
    out = dict(labels=_p_labels(edges), tokens=tokens)
    with np.errstate(invalid="ignore"):
        for name, x in excess.items():
            out[f"{name}_acted"] = np.bincount(bin_N, weights=x > 0, minlength=n_bins).astype(np.int64)
            out[f"{name}_excess_sum"] = np.bincount(bin_N, weights=x, minlength=n_bins)
            out[f"{name}_bias"] = out[f"{name}_excess_sum"] / tokens
            out[f"{name}_bias_total"] = float(x.mean()) if x.size else math.nan
    return out


# ----------------------------------------------------------------------------- 10. where each operator acts


@functools.cache
def _acted_fn(method, lam, kappa, cap, low, high, threshold):
    """Jitted acted-on flags [1, C] of cisjax.rl.corrections.correction (the training code path itself)."""

    def acted(lp_1xC, lq_1xC, mask_1xC):
        return corrections.correction(
            method, lp_1xC, lq_1xC, mask_1xC, lam=lam, kappa=kappa, cap=cap, low=low, high=high, threshold=threshold
        ).acted_BxT

    return jax.jit(acted)


def acted_fractions(
    logp,
    logq,
    methods=None,
    *,
    response_lengths=None,
    lam=None,
    kappa=None,
    cap=None,
    low=None,
    high=None,
    threshold=None,
    chunk_tokens=1 << 20,
):
    """Fraction of tokens each operator acts on (tab:train_stats "Acted on", Appendix D.5), from the training code path:
    cisjax.rl.corrections.correction's acted flag (masks: masked; caps: weight != k; seq operators: every token of a
    capped / rejected response; none, gspo, fp16: never), with its fp32 arithmetic and sanitising.

    methods: default every token-level operator in corrections.METHODS, plus seq_tis / seq_mis when response_lengths
    (tokens per response, in order, summing to N) is given; the sequence operators need it. Returns
      acted_frac: {method: acted tokens / N}, and with response_lengths also
      acted_seq_frac: {method: responses (with >= 1 token) holding an acted-on token / such responses}.
    Token operators run on fixed [1, chunk_tokens] chunks (one compile per operator, bounded memory). For the
    sequence operators the per-response sum of the fp32 log k (non-finite -> 0) is formed here in float64 and handed
    to correction() as a one-token row, whose K = exp(clip(sum, -20, 20)) is then the operator's own.
    lam, kappa, cap, threshold (None: operator_defaults()'s), low, high (None: the method's default): as correction()."""
    lam, kappa, cap, threshold = _or_defaults(lam=lam, kappa=kappa, cap=cap, threshold=threshold)
    lp, lq = _logprobs(logp, logq)
    n = lp.size
    lengths = None
    if response_lengths is not None:
        lengths = np.asarray(response_lengths)
        if lengths.ndim != 1 or lengths.dtype.kind not in "iu" or (lengths.size and lengths.min() < 0):
            raise ValueError("response_lengths must be a flat array of non-negative integers")
        if int(lengths.sum()) != n:
            raise ValueError(f"response_lengths sum to {int(lengths.sum())} but there are {n} tokens")
    if methods is None:
        methods = tuple(m for m in corrections.METHODS if lengths is not None or m not in SEQ_METHODS)
    kw = dict(
        lam=float(lam),
        kappa=float(kappa),
        cap=float(cap),
        low=None if low is None else float(low),
        high=None if high is None else float(high),
        threshold=float(threshold),
    )
    seq_id = None if lengths is None else np.repeat(np.arange(lengths.size), lengths)
    has_tokens = None if lengths is None else lengths > 0
    frac, seq_frac = {}, {}
    lp32, lq32 = lp.astype(np.float32), lq.astype(np.float32)
    for m in methods:
        if m in SEQ_METHODS:
            if lengths is None:
                raise ValueError(f"{m} is a sequence operator: pass response_lengths")
            with np.errstate(invalid="ignore"):
                logk32 = lp32 - lq32
            logk32[~np.isfinite(logk32)] = 0.0  # correction()'s sanitising
            sum_B = np.bincount(seq_id, weights=logk32, minlength=lengths.size).astype(np.float32)
            acted_B = np.asarray(
                _acted_fn(m, **kw)(sum_B[:, None], np.zeros_like(sum_B)[:, None], has_tokens[:, None])
            )[:, 0]
            frac[m] = _frac(int(lengths[acted_B].sum()), n)
            seq_frac[m] = _frac(int(acted_B.sum()), int(has_tokens.sum()))
            continue
        fn = _acted_fn(m, **kw)
        size = max(1, min(int(chunk_tokens), n))
        acted_N = np.zeros(n, bool)
        for start in range(0, n, size):
            stop = min(start + size, n)
            # the last chunk is padded (mask False, never acted on) to keep the one compiled shape
            lp_1xC, lq_1xC, mask_1xC = (
                np.zeros((1, size), np.float32),
                np.zeros((1, size), np.float32),
                np.zeros((1, size), bool),
            )
            lp_1xC[0, : stop - start], lq_1xC[0, : stop - start] = lp32[start:stop], lq32[start:stop]
            mask_1xC[0, : stop - start] = True
            acted_N[start:stop] = np.asarray(fn(lp_1xC, lq_1xC, mask_1xC))[0, : stop - start]
        frac[m] = _frac(int(acted_N.sum()), n)
        if lengths is not None:
            acted_B = np.bincount(seq_id, weights=acted_N, minlength=lengths.size) > 0
            seq_frac[m] = _frac(int(acted_B.sum()), int(has_tokens.sum()))
    out = dict(acted_frac=frac)
    if lengths is not None:
        out["acted_seq_frac"] = seq_frac
    return out
