"""Per-logit perturbation delta over the engines' shared top-K and routing flips (paper Appendix A.1, A.3): numpy."""

from __future__ import annotations

import math

import numpy as np

from cisjax.mismatch.arrays import check_logprobs, flat, fraction, qkey, quantile_values

# Conventions: cisjax.mismatch.arrays.
# N_flip bins of tab:appA_routing (Appendix A.3): 0, 1, 2-3, 4-6, >= 7 (lower edges, each bin [e_i, e_{i+1})).
NFLIP_EDGES = (0, 1, 2, 4, 7)


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
        check_logprobs(f"logp_{side}", lp)
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
    d = flat("delta", delta)
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
    for q, v in zip(quantiles, quantile_values(a, quantiles)):
        out[f"{qkey(q)}_abs"] = float(v)
    for t in thresholds:
        out[f"frac_abs_gt_{t:g}"] = fraction(int(np.count_nonzero(a > t)), n)
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
    d = flat("delta", delta)
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
