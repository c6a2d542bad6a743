"""What the report computes from one measurement: every table number, and the data its figures draw."""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

from cisjax import config as config_lib
from cisjax.mismatch import acted, deltas, records
from cisjax.mismatch import stats as S

PHASES = ("early", "middle", "late")  # records: phase 0, 1, 2


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


# Bins of 1 - p for the eps-vs-(1 - p) band plot: UNCERTAINTY_EDGES as inner edges of p (tokens with 1 - p < 1e-6
# fall in an extra top bin, left out of the plot).
_BAND_P_EDGES = tuple(1.0 - S.UNCERTAINTY_EDGES[-2::-1])


@dataclass(frozen=True)
class ReportSpec:
    """The report's settings: the operators' parameters, the subsample sizes and their seed, where it is written."""

    out: Path  # report.md, summary.json, *.png, raw/*.npz
    # the operators' parameters default to base.py's (operator_defaults, read when a spec is made)
    lam: float = field(default_factory=lambda: operator_defaults().lam)  # CIS lambda
    kappa: float = field(default_factory=lambda: operator_defaults().kappa)  # CIS floor kappa
    cap: float = field(default_factory=lambda: operator_defaults().cap)  # TIS cap C
    threshold: float = field(default_factory=lambda: operator_defaults().threshold)  # KPop's phi
    plot_points: int = 200_000  # tokens subsampled per measurement for scatter plots
    spearman_tokens: int = 300_000  # tokens subsampled for the Spearman correlations (the paper: 300,000)
    seed: int = 0  # seed of the subsamples
    raw: bool = True  # write raw/<pair>.npz (per-token eps, log k)


def slug(label: str) -> str:
    """A label as a file name part (raw/<slug>.npz, plane_<slug>.png)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("_") or "pair"


def _response_lengths(seq_id):
    """Tokens per response when each seq_id is one contiguous run (the sequence operators need it), else None."""
    n = seq_id.size
    if n == 0:
        return None
    starts = np.concatenate([[0], np.flatnonzero(seq_id[1:] != seq_id[:-1]) + 1])
    if np.unique(seq_id[starts]).size != starts.size:
        return None
    return np.diff(np.append(starts, n))


def _ccdf(x, points=200):
    """(t, P(x > t)) on log-spaced t up to max(x) (x >= 0): the CCDF curve, exact at each t, over all of x."""
    x = np.sort(x[x > 0])
    if x.size == 0:
        return np.array([]), np.array([])
    t = np.geomspace(max(x[0], x[-1] * 1e-6), x[-1], points)
    return t, 1.0 - np.searchsorted(x, t, side="right") / x.size


def _delta_tables(m):
    """delta_stats and (with routing) delta_by_nflip; plus |delta| for the CCDF."""
    t = m.topk
    delta, pos = deltas.paired_topk(t["ids_p"], t["logp_p"], t["ids_q"], t["logp_q"])
    out = {"delta_stats": deltas.delta_stats(delta)}
    if m.routing is not None:
        r = m.routing
        nflip = deltas.n_flip(r["experts_p"], r["experts_q"])
        # a delta's top-k position -> the routing row of the same token (routing may probe other tokens)
        r_tok = np.asarray(r["token_index"], np.int64)
        order = np.argsort(r_tok, kind="stable")
        tok = np.asarray(t["token_index"], np.int64)[pos]
        j = np.minimum(np.searchsorted(r_tok[order], tok), max(r_tok.size - 1, 0))
        hit = (r_tok[order][j] == tok) if r_tok.size else np.zeros(tok.size, bool)
        out["delta_by_nflip"] = deltas.delta_by_nflip(delta[hit], order[j[hit]], nflip)
        out["delta_by_nflip"]["paired_with_routing"] = int(hit.sum())
    return out, np.abs(delta)


def _summary(m: records.Measurement, lp, lq, eps, finite, logk, spec: ReportSpec) -> dict:
    """Every table number of one measurement but the top-K ones."""
    tok = m.tokens
    with np.errstate(over="ignore"):
        k = np.exp(logk[np.isfinite(logk)])
    finite_logk = np.abs(logk[np.isfinite(logk)])
    summary = {
        "meta": m.meta,
        # bitwise agreement: the tokens whose p equals q exactly (1 under rollout.exact), the largest |log k|
        "exact_frac": float(np.mean(lp == lq)) if lp.size else math.nan,
        "max_abs_logk": float(finite_logk.max()) if finite_logk.size else math.nan,
        "identity": {"max_error": S.identity_max_error(lp, lq, eps), "finite_tokens": int(finite.sum())},
        "controls": {
            **{key: v for key, v in m.meta.items() if key.startswith("control_")},
            "mean_k": float(k.mean()) if k.size else math.nan,
        },
        "eps_stats": S.eps_stats(lp, lq),
        "eps_by_confidence": S.eps_by_confidence(lp, lq),
        "confidence_invariance": S.confidence_invariance(
            lp, lq, kappa=spec.kappa, max_tokens=spec.spearman_tokens, seed=spec.seed
        ),
        "displacement_moments": S.displacement_moments(lp, lq),
        "variance_share": S.variance_share_by_side(lp, lq),
        "truncation_bias": S.truncation_bias(lp, lq, lam=spec.lam, kappa=spec.kappa, cap=spec.cap),
    }
    del k
    lengths = _response_lengths(tok["seq_id"])
    params = dict(lam=spec.lam, kappa=spec.kappa, cap=spec.cap, threshold=spec.threshold)
    summary["acted"] = acted.acted_fractions(lp, lq, response_lengths=lengths, **params)
    if lengths is None:
        summary["acted"]["note"] = "seq_id is not contiguous per response: sequence operators left out"
    if "phase" in tok:
        ph = tok["phase"]
        summary["eps_by_phase"] = {name: S.eps_stats(lp[ph == i], lq[ph == i]) for i, name in enumerate(PHASES)}
    return summary


def _write_raw(m: records.Measurement, label: str, eps, logk, out: Path) -> None:
    """raw/<label>.npz: the per-token fields, eps and log k (float32)."""
    tok = m.tokens
    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    extra = {"phase": tok["phase"]} if "phase" in tok else {}
    np.savez(
        raw / f"{slug(label)}.npz",
        logp=tok["logp"],
        logq=tok["logq"],
        eps=eps.astype(np.float32),
        logk=logk.astype(np.float32),
        seq_id=tok["seq_id"],
        position=tok["position"],
        token_id=tok["token_id"],
        **extra,
    )


def analyse(m: records.Measurement, label: str, spec: ReportSpec) -> tuple[dict, dict]:
    """(summary: every table number of one measurement, plot data: CCDFs, bins and a token subsample)."""
    lp = m.tokens["logp"].astype(np.float64)
    lq = m.tokens["logq"].astype(np.float64)
    n = lp.size
    eps = S.eps_from_logprobs(lp, lq)
    finite = np.isfinite(eps)
    logk = lp - lq
    summary = _summary(m, lp, lq, eps, finite, logk, spec)
    plot = {"eps_ccdf": _ccdf(np.abs(eps[finite])), "band": S.eps_by_confidence(lp, lq, p_edges=_BAND_P_EDGES)}
    if m.topk is not None:
        tables, abs_delta = _delta_tables(m)
        summary.update(tables)
        plot["delta_ccdf"] = _ccdf(abs_delta)
    rng = np.random.default_rng(spec.seed)
    idx = np.sort(rng.choice(n, size=spec.plot_points, replace=False)) if n > spec.plot_points else np.arange(n)
    plot["sample"] = {"logp": lp[idx], "logq": lq[idx]}
    if spec.raw:
        _write_raw(m, label, eps, logk, Path(spec.out))
    return summary, plot
