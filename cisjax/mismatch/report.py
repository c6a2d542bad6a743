"""`cisjax mismatch report`: the Appendix A tables, plots, report.md and summary.json from one or more measurements."""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

import numpy as np

from cisjax import errors
from cisjax.mismatch import records
from cisjax.mismatch import stats as S

PHASES = ("early", "middle", "late")  # records: phase 0, 1, 2
# Bins of 1 - p for the eps-vs-(1 - p) band plot: UNCERTAINTY_EDGES as inner edges of p (tokens with 1 - p < 1e-6
# fall in an extra top bin, left out of the plot).
_BAND_P_EDGES = tuple(1.0 - S.UNCERTAINTY_EDGES[-2::-1])
# The operators of the p_train-p_infer plane, and what their acted flag means there.
PLANE_OPERATORS = (("cis", "truncates"), ("tis", "truncates"), ("icepop", "masks"))


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "measurements",
        nargs="+",
        metavar="MEAS",
        help="measurement directories (or directories holding one per engine pair), see mismatch/records.py",
    )
    p.add_argument("--out", required=True, help="output directory: report.md, summary.json, *.png, raw/*.npz")
    p.add_argument("--lam", type=float, default=S.CIS_LAM, help="CIS lambda (default %(default)s)")
    p.add_argument("--kappa", type=float, default=S.CIS_KAPPA, help="CIS floor kappa (default %(default)s)")
    p.add_argument("--cap", type=float, default=S.TIS_CAP, help="TIS cap C (default %(default)s)")
    p.add_argument(
        "--plot-points", type=int, default=200_000, help="tokens subsampled per measurement for scatter plots"
    )
    p.add_argument(
        "--spearman-tokens",
        type=int,
        default=300_000,
        help="tokens subsampled for the Spearman correlations (the paper: 300,000)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the subsamples")
    p.add_argument("--no-raw", action="store_true", help="do not write raw/<pair>.npz (per-token eps, log k)")


# ----------------------------------------------------------------------------- analysis of one measurement


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
    delta, pos = S.paired_topk(t["ids_p"], t["logp_p"], t["ids_q"], t["logp_q"])
    out = {"delta_stats": S.delta_stats(delta)}
    if m.routing is not None:
        r = m.routing
        nflip = S.n_flip(r["experts_p"], r["experts_q"])
        # a delta's top-k position -> the routing row of the same token (routing may probe other tokens)
        r_tok = np.asarray(r["token_index"], np.int64)
        order = np.argsort(r_tok, kind="stable")
        tok = np.asarray(t["token_index"], np.int64)[pos]
        j = np.minimum(np.searchsorted(r_tok[order], tok), max(r_tok.size - 1, 0))
        hit = (r_tok[order][j] == tok) if r_tok.size else np.zeros(tok.size, bool)
        out["delta_by_nflip"] = S.delta_by_nflip(delta[hit], order[j[hit]], nflip)
        out["delta_by_nflip"]["paired_with_routing"] = int(hit.sum())
    return out, np.abs(delta)


def analyse(m: records.Measurement, label: str, args) -> tuple[dict, dict]:
    """(summary: every table number of one measurement, plot data: CCDFs, bins and a token subsample)."""
    tok = m.tokens
    lp = tok["logp"].astype(np.float64)
    lq = tok["logq"].astype(np.float64)
    n = lp.size
    eps = S.eps_from_logprobs(lp, lq)
    finite = np.isfinite(eps)
    logk = lp - lq
    with np.errstate(over="ignore"):
        k = np.exp(logk[np.isfinite(logk)])
    summary = {
        "meta": m.meta,
        "identity": {"max_error": S.identity_max_error(lp, lq, eps), "finite_tokens": int(finite.sum())},
        "controls": {
            **{key: v for key, v in m.meta.items() if key.startswith("control_")},
            "mean_k": float(k.mean()) if k.size else math.nan,
        },
        "eps_stats": S.eps_stats(lp, lq),
        "eps_by_confidence": S.eps_by_confidence(lp, lq),
        "confidence_invariance": S.confidence_invariance(
            lp, lq, kappa=args.kappa, max_tokens=args.spearman_tokens, seed=args.seed
        ),
        "displacement_moments": S.displacement_moments(lp, lq),
        "variance_share": S.variance_share_by_side(lp, lq),
        "truncation_bias": S.truncation_bias(lp, lq, lam=args.lam, kappa=args.kappa, cap=args.cap),
    }
    del k
    lengths = _response_lengths(tok["seq_id"])
    summary["acted"] = S.acted_fractions(lp, lq, response_lengths=lengths, lam=args.lam, kappa=args.kappa, cap=args.cap)
    if lengths is None:
        summary["acted"]["note"] = "seq_id is not contiguous per response: sequence operators left out"
    if "phase" in tok:
        ph = tok["phase"]
        summary["eps_by_phase"] = {name: S.eps_stats(lp[ph == i], lq[ph == i]) for i, name in enumerate(PHASES)}
    plot = {"eps_ccdf": _ccdf(np.abs(eps[finite])), "band": S.eps_by_confidence(lp, lq, p_edges=_BAND_P_EDGES)}
    if m.topk is not None:
        tables, abs_delta = _delta_tables(m)
        summary.update(tables)
        plot["delta_ccdf"] = _ccdf(abs_delta)
    rng = np.random.default_rng(args.seed)
    idx = np.sort(rng.choice(n, size=args.plot_points, replace=False)) if n > args.plot_points else np.arange(n)
    plot["sample"] = {"logp": lp[idx], "logq": lq[idx]}
    if not args.no_raw:
        raw = Path(args.out) / "raw"
        raw.mkdir(parents=True, exist_ok=True)
        extra = {"phase": tok["phase"]} if "phase" in tok else {}
        np.savez(
            raw / f"{_slug(label)}.npz",
            logp=tok["logp"],
            logq=tok["logq"],
            eps=eps.astype(np.float32),
            logk=logk.astype(np.float32),
            seq_id=tok["seq_id"],
            position=tok["position"],
            token_id=tok["token_id"],
            **extra,
        )
    return summary, plot


# ----------------------------------------------------------------------------- plots


def _plots(out: Path, labels, plots, args) -> dict:
    """The PNGs; {name: file name} of those written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = {}

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        files[name.removesuffix(".png")] = name

    for key, sym in (("delta", "δ"), ("eps", "ε")):
        curves = [(lab, pl[f"{key}_ccdf"]) for lab, pl in zip(labels, plots) if f"{key}_ccdf" in pl]
        curves = [(lab, c) for lab, c in curves if c[0].size]
        if not curves:
            continue
        fig, ax = plt.subplots(figsize=(5.5, 4))
        for lab, (t, c) in curves:
            ok = c > 0
            ax.loglog(t[ok], c[ok], label=lab)
        ax.set_xlabel(f"|{sym}|")
        ax.set_ylabel(f"P(|{sym}| > x)")
        ax.set_title(f"CCDF of |{sym}|")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        save(fig, f"ccdf_{key}.png")

    # eps against 1 - p: median and q05-q95 band per log bin of 1 - p (all tokens; bins with >= 20 tokens)
    e = S.UNCERTAINTY_EDGES
    centers = np.sqrt(e[:-1] * e[1:])[::-1]  # band bin i (ascending p) <-> 1 - p bin 17 - i
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for lab, pl in zip(labels, plots):
        b = pl["band"]
        ok = b["tokens"][:-1] >= 20
        (line,) = ax.plot(centers[ok], b["median_eps"][:-1][ok], marker=".", label=f"{lab} median")
        ax.fill_between(
            centers[ok],
            b["q05_eps"][:-1][ok],
            b["q95_eps"][:-1][ok],
            color=line.get_color(),
            alpha=0.2,
            label=f"{lab} q05-q95",
        )
    ax.set_xscale("log")
    ax.set_xlabel("1 - p")
    ax.set_ylabel("ε")
    ax.set_title("ε against 1 - p (quantile bands)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    save(fig, "eps_vs_uncertainty.png")

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, name in ((axes[0], "mad_eps", "MAD(ε)"), (axes[1], "mad_logk", "MAD(log k)")):
        positive = False
        for lab, pl in zip(labels, plots):
            r = pl["confidence_invariance"]["all"]
            ok = (r["tokens"] > 0) & (r[key] > 0)  # a MAD of 0 (no mismatch in the bin) has no place on a log axis
            ax.plot(r["centers"][ok], r[key][ok], marker=".", label=lab)
            positive |= bool(ok.any())
        ax.set_xscale("log")
        if positive:
            ax.set_yscale("log")
        ax.axvline(args.kappa, color="grey", ls="--", lw=0.8, label="κ")
        ax.set_title(f"{name} against 1 - p")
        ax.set_xlabel("1 - p")
        ax.set_ylabel(name)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    save(fig, "mad_vs_uncertainty.png")

    from cisjax.rl import corrections

    for lab, pl in zip(labels, plots):
        lp, lq = pl["sample"]["logp"].astype(np.float32), pl["sample"]["logq"].astype(np.float32)
        if lp.size == 0:
            continue
        fig, axes = plt.subplots(1, len(PLANE_OPERATORS), figsize=(4.2 * len(PLANE_OPERATORS), 4.2), sharey=True)
        for ax, (op, verb) in zip(axes, PLANE_OPERATORS):
            acted = np.asarray(
                corrections.correction(
                    op, lp[None], lq[None], np.ones((1, lp.size), bool), lam=args.lam, kappa=args.kappa, cap=args.cap
                ).acted_BxT
            )[0]
            # acted-on tokens last and larger: they are rare and would vanish under the kept ones
            for sel, colour, what, size in ((~acted, "tab:blue", "keeps", 1.5), (acted, "tab:red", verb, 6)):
                ax.scatter(
                    np.exp(lq[sel]),
                    np.exp(lp[sel]),
                    s=size,
                    c=colour,
                    alpha=0.5,
                    lw=0,
                    label=f"{what} ({sel.mean():.3%})",
                    rasterized=True,
                )
            ax.plot([0, 1], [0, 1], color="k", lw=0.5)
            ax.set_title(op)
            ax.set_xlabel("p_infer (q)")
            ax.legend(fontsize=7, markerscale=6, loc="upper left")
        axes[0].set_ylabel("p_train (p)")
        fig.suptitle(f"{lab}: {lp.size:,} tokens subsampled")
        save(fig, f"plane_{_slug(lab)}.png")
    return files


# ----------------------------------------------------------------------------- markdown


def _slug(label):
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("_") or "pair"


def _num(x, pct=False):
    """A table cell: ints with separators, floats to 4 significant digits, fractions as % when pct."""
    if x is None:
        return "—"
    if isinstance(x, (bool, np.bool_)):
        return str(bool(x))
    if isinstance(x, (int, np.integer)):
        return f"{int(x):,}"
    if isinstance(x, (float, np.floating)):
        x = float(x)
        if math.isnan(x):
            return "—"
        if pct:
            return f"{100 * x:.4g}%"
        if x == 0 or math.isinf(x) or 1e-3 <= abs(x) < 1e5:
            return f"{x:.4g}"
        return f"{x:.3e}"
    return str(x)


def _cell(c):
    return str(c).replace("|", "\\|")  # |δ| inside a cell would end it


def _table(header, rows):
    lines = ["| " + " | ".join(map(_cell, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(_cell, r)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _side_by_side(labels, dicts, spec):
    """A table with one column per measurement: spec = [(row name, key, pct)]; rows absent everywhere dropped."""
    rows = []
    for name, key, pct in spec:
        cells = [_num(d.get(key), pct) if d is not None and key in d else "—" for d in dicts]
        if any(c != "—" for c in cells) or all(d is not None and key in d for d in dicts):
            rows.append([name] + cells)
    return _table([""] + list(labels), rows)


def _binned(columns, spec, n_rows):
    """A per-bin table: spec = [(header, array or list, pct)]."""
    rows = [
        [_num(col[i], pct) if not isinstance(col[i], str) else col[i] for _, col, pct in spec] for i in range(n_rows)
    ]
    return _table([h for h, _, _ in spec], rows)


DELTA_SPEC = [
    ("Paired entries", "entries", False),
    ("Median", "median", False),
    ("Mean", "mean", False),
    ("|mean|/sd", "abs_mean_over_sd", True),
    ("sd(δ)", "sd", False),
    ("q99(|δ|)", "q99_abs", False),
    ("q99.9(|δ|)", "q99.9_abs", False),
    ("P(|δ|>0.5)", "frac_abs_gt_0.5", True),
    ("P(|δ|>1)", "frac_abs_gt_1", True),
    ("max |δ|", "max_abs", False),
    ("min δ", "min", False),
    ("max δ", "max", False),
]
EPS_SPEC = [
    ("Sampled tokens", "tokens", False),
    ("Finite ε", "finite", False),
    ("Finite fraction", "finite_frac", True),
    ("mean(ε)", "mean", False),
    ("sd(ε)", "sd", False),
    ("q95(|ε|)", "q95_abs", False),
    ("q99(|ε|)", "q99_abs", False),
    ("q99.9(|ε|)", "q99.9_abs", False),
    ("P(|ε|>1)", "frac_abs_gt_1", True),
    ("P(|ε|>2)", "frac_abs_gt_2", True),
    ("max |ε|", "max_abs", False),
]


def _markdown(labels, summaries, figures, warnings, args, elapsed) -> str:
    md = ["# Training-inference mismatch report (paper Appendix A)\n"]
    md.append(
        _table(
            ["", "pair", "side p (train)", "side q (infer)", "model", "tokens"],
            [
                [
                    lab,
                    s["meta"].get("pair"),
                    s["meta"].get("side_p"),
                    s["meta"].get("side_q"),
                    s["meta"].get("model", "—"),
                    _num(s["eps_stats"]["tokens"]),
                ]
                for lab, s in zip(labels, summaries)
            ],
        )
    )
    md.append(
        f"Operators: CIS λ = {args.lam:g}, κ = {args.kappa:g}; TIS C = {args.cap:g}. Analysis time {elapsed:.1f} s.\n"
    )
    for w in warnings:
        md.append(f"**Warning:** {w}\n")

    md.append("## Checks\n")
    for lab, s in zip(labels, summaries):
        md.append(
            f"- {lab}: identity k = p + (1−p)e^ε: max error {_num(s['identity']['max_error'])} on "
            f"{s['identity']['finite_tokens']:,} finite tokens (|log k − log(p + (1−p)e^ε)|)"
        )
    md.append("")
    md.append("### Controls\n")
    ctrl_keys = sorted({k for s in summaries for k in s["controls"]} - {"mean_k"})
    md.append(
        _side_by_side(
            labels,
            [s["controls"] for s in summaries],
            [("mean k (E[k] = 1 when calibrated)", "mean_k", False)] + [(k, k, False) for k in ctrl_keys],
        )
    )

    md.append("## Per-logit perturbation δ (tab:appA_delta_stats)\n")
    with_topk = [(lab, s) for lab, s in zip(labels, summaries) if "delta_stats" in s]
    missing = [lab for lab, s in zip(labels, summaries) if "delta_stats" not in s]
    if with_topk:
        md.append(_side_by_side([lab for lab, _ in with_topk], [s["delta_stats"] for _, s in with_topk], DELTA_SPEC))
    if missing:
        md.append(
            f"Omitted for {', '.join(missing)}: no topk.npz (top-K logprobs of both engines) in the measurement.\n"
        )
    if "ccdf_delta" in figures:
        md.append("![CCDF of |δ|](ccdf_delta.png)\n")

    md.append("## δ by N_flip (tab:appA_routing)\n")
    for lab, s in zip(labels, summaries):
        if "delta_by_nflip" in s:
            r = s["delta_by_nflip"]
            md.append(f"### {lab}\n")
            md.append(
                f"Mean N_flip {_num(r['nflip_mean'])}; {r['paired_with_routing']:,} paired entries with routing.\n"
            )
            md.append(
                _binned(
                    r,
                    [
                        ("N_flip", r["labels"], False),
                        ("Positions", r["positions"], False),
                        ("Positions (%)", r["position_frac"], True),
                        ("Entries", r["entries"], False),
                        ("sd(δ)", r["sd"], False),
                        ("P(|δ|>0.5)", r["frac_abs_gt_0.5"], True),
                        ("P(|δ|>1)", r["frac_abs_gt_1"], True),
                    ],
                    len(r["labels"]),
                )
            )
        else:
            why = "no topk.npz" if "delta_stats" not in s else "no routing.npz (MoE expert ids of both engines)"
            md.append(f"Omitted for {lab}: {why} in the measurement.\n")

    md.append("## Log-odds displacement ε (tab:appA_epsilon_stats)\n")
    md.append(_side_by_side(labels, [s["eps_stats"] for s in summaries], EPS_SPEC))
    if "ccdf_eps" in figures:
        md.append("![CCDF of |ε|](ccdf_eps.png)\n")
    phased = [(lab, s) for lab, s in zip(labels, summaries) if "eps_by_phase" in s]
    if phased:
        md.append("### ε by training phase\n")
        for lab, s in phased:
            md.append(f"#### {lab}\n")
            md.append(_side_by_side(PHASES, [s["eps_by_phase"][ph] for ph in PHASES], EPS_SPEC))
    else:
        md.append(
            "ε by training phase omitted: no measurement has a `phase` field (only training-run token dumps do).\n"
        )

    md.append("## ε by confidence (tab:appA_confidence)\n")
    for lab, s in zip(labels, summaries):
        c = s["eps_by_confidence"]
        md.append(f"### {lab}\n")
        md.append(
            _binned(
                c,
                [
                    ("p range", c["labels"], False),
                    ("Tokens", c["tokens"], False),
                    ("Med. ε", c["median_eps"], False),
                    ("MAD(ε)", c["mad_eps"], False),
                    ("q05(ε)", c["q05_eps"], False),
                    ("q95(ε)", c["q95_eps"], False),
                    ("MAD(log k)", c["mad_logk"], False),
                ],
                len(c["labels"]),
            )
        )
    md.append("![ε against 1 − p](eps_vs_uncertainty.png)\n")

    md.append("## MAD of ε and log k over 18 log bins of 1 − p (Appendix A.6)\n")
    region_spec = [
        ("Tokens in region", "tokens_in_region", False),
        ("MAD(ε) max/min", "mad_eps_ratio", False),
        ("MAD(log k) max/min", "mad_logk_ratio", False),
        ("max |median ε|", "max_abs_median_eps", False),
        ("Spearman(ε, log(1−p))", "spearman_eps", False),
        ("Spearman(|ε|, log(1−p))", "spearman_abs_eps", False),
    ]
    for region, title in (("all", "1 − p ≥ 1e-7, bins 1e-6 … 1"), ("floor", f"1 − p ≥ κ = {args.kappa:g}, bins κ … 1")):
        md.append(f"### {title}\n")
        md.append(_side_by_side(labels, [s["confidence_invariance"][region] for s in summaries], region_spec))
        for lab, s in zip(labels, summaries):
            r = s["confidence_invariance"][region]
            md.append(f"{lab}:\n")
            md.append(
                _binned(
                    r,
                    [
                        ("1 − p (centre)", r["centers"], False),
                        ("Tokens", r["tokens"], False),
                        ("Med. ε", r["median_eps"], False),
                        ("MAD(ε)", r["mad_eps"], False),
                        ("MAD(log k)", r["mad_logk"], False),
                    ],
                    len(r["centers"]),
                )
            )
    md.append(f"Spearman correlations on a uniform subsample of at most {args.spearman_tokens:,} tokens per region.\n")
    md.append("![MAD against 1 − p](mad_vs_uncertainty.png)\n")

    md.append("## Moments E[e^{αε}] and E[((1−p)e^ε)^α] (Appendix A.7)\n")
    alphas = summaries[0]["displacement_moments"]["alphas"]
    rows = [
        [_num(float(a))]
        + [
            c
            for s in summaries
            for c in (_num(s["displacement_moments"]["raw"][i]), _num(s["displacement_moments"]["weighted"][i]))
        ]
        for i, a in enumerate(alphas)
    ]
    md.append(_table(["α"] + [c for lab in labels for c in (f"{lab} E[e^(αε)]", f"{lab} E[((1−p)e^ε)^α]")], rows))

    md.append("## Share of Var(k) by side of k = 1 (Section 4.3)\n")
    md.append(
        _side_by_side(
            labels,
            [s["variance_share"] for s in summaries],
            [
                ("Tokens (finite log k)", "tokens", False),
                ("E[(k − 1)²]", "var", False),
                ("share from k > 1", "share_upper", True),
                ("share from k < 1", "share_lower", True),
                ("share at k = 1", "share_at_one", True),
            ],
        )
    )

    md.append("## Truncation bias E[k − f(k)] per confidence bin, CIS vs TIS (Section 4.3)\n")
    for lab, s in zip(labels, summaries):
        t = s["truncation_bias"]
        md.append(f"### {lab}\n")
        md.append(
            _binned(
                t,
                [
                    ("p range", t["labels"], False),
                    ("Tokens", t["tokens"], False),
                    ("CIS acted", t["cis_acted"], False),
                    ("CIS bias", t["cis_bias"], False),
                    ("TIS acted", t["tis_acted"], False),
                    ("TIS bias", t["tis_bias"], False),
                ],
                len(t["labels"]),
            )
        )
        md.append(f"Total bias: CIS {_num(t['cis_bias_total'])}, TIS {_num(t['tis_bias_total'])}.\n")

    md.append("## Fraction of tokens each operator acts on\n")
    methods = list(dict.fromkeys(m for s in summaries for m in s["acted"]["acted_frac"]))
    rows = [[m] + [_num(s["acted"]["acted_frac"].get(m), True) for s in summaries] for m in methods]
    md.append(_table(["operator"] + list(labels), rows))
    if any("acted_seq_frac" in s["acted"] for s in summaries):
        rows = [[m] + [_num(s["acted"].get("acted_seq_frac", {}).get(m), True) for s in summaries] for m in methods]
        md.append("Fraction of responses with an acted-on token:\n")
        md.append(_table(["operator"] + list(labels), rows))
    for lab, s in zip(labels, summaries):
        if "note" in s["acted"]:
            md.append(f"{lab}: {s['acted']['note']}.\n")

    md.append("## The p_train – p_infer plane\n")
    md.append(
        f"Per operator: tokens it keeps (blue) and truncates / masks (red), on a uniform subsample of at most "
        f"{args.plot_points:,} tokens per measurement.\n"
    )
    for lab in labels:
        name = f"plane_{_slug(lab)}"
        if name in figures:
            md.append(f"![{lab}: p_train against p_infer]({figures[name]})\n")
    if not args.no_raw:
        md.append("## Raw data\n")
        md.append(
            "Per-token logp, logq, eps, log k (float32), seq_id, position, token_id (and phase) in "
            + ", ".join(f"`raw/{_slug(lab)}.npz`" for lab in labels)
            + ".\n"
        )
    return "\n".join(md)


# ----------------------------------------------------------------------------- entry point


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        x = float(x)
        return x if math.isfinite(x) else None  # strict JSON: NaN / inf -> null
    if isinstance(x, np.bool_):
        return bool(x)
    return x


def _labels(paths, metas):
    """Column names: the pair, disambiguated by the directory name when two measurements share it (the parent's name
    where the directory is named after the pair: a `measure --out M` directory holds M/<pair>)."""
    pairs = [m["pair"] for m in metas]

    def where(path, pair):
        path = Path(path)
        return path.parent.name if path.name == pair and path.parent.name else path.name

    labels = [pr if pairs.count(pr) == 1 else f"{pr} ({where(p, pr)})" for pr, p in zip(pairs, paths)]
    return [lab if labels.count(lab) == 1 else f"{lab} #{i + 1}" for i, lab in enumerate(labels)]


def run(args, overrides=()) -> int:
    if overrides:
        raise errors.UserError(f"mismatch report takes no --config overrides, got {list(overrides)}")
    if args.plot_points < 1 or args.spearman_tokens < 2:
        raise errors.UserError("--plot-points must be >= 1 and --spearman-tokens >= 2")
    t0 = time.perf_counter()
    paths = records.find(args.measurements)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    metas = [json.loads((p / "meta.json").read_text()) for p in paths]
    for p, meta in zip(paths, metas):
        if not meta.get("pair"):
            raise errors.UserError(f"mismatch measurement in {p}: meta.json lacks 'pair'")
    labels = _labels(paths, metas)
    # Different vocabularies are a warning, not an error: the paper compares different models side by side (dense vs
    # MoE); the numbers of each column stay valid, only token-level comparisons across them are not.
    warnings = []
    vocabs = {lab: m.get("vocab_size") for lab, m in zip(labels, metas) if m.get("vocab_size") is not None}
    if len(set(vocabs.values())) > 1:
        warnings.append(
            "the measurements come from different vocabularies (vocab_size "
            + ", ".join(f"{lab}: {v}" for lab, v in vocabs.items())
            + "): each column is valid on its own, but token ids and top-K sets do not compare across them."
        )
    summaries, plots = [], []
    for path, label in zip(paths, labels):
        m = records.load(path)  # one measurement in memory at a time
        summary, plot = analyse(m, label, args)
        plot["confidence_invariance"] = summary["confidence_invariance"]
        summaries.append(summary)
        plots.append(plot)
        del m
    figures = _plots(out, labels, plots, args)
    elapsed = time.perf_counter() - t0
    (out / "report.md").write_text(_markdown(labels, summaries, figures, warnings, args, elapsed))
    doc = {
        "measurements": {lab: {"path": str(p), **s} for lab, p, s in zip(labels, paths, summaries)},
        "warnings": warnings,
        "figures": figures,
        "params": {
            "lam": args.lam,
            "kappa": args.kappa,
            "cap": args.cap,
            "plot_points": args.plot_points,
            "spearman_tokens": args.spearman_tokens,
            "seed": args.seed,
        },
    }
    (out / "summary.json").write_text(json.dumps(_jsonable(doc), indent=1) + "\n")
    for w in warnings:
        print(f"cisjax mismatch report: warning: {w}", file=sys.stderr)
    print(f"cisjax mismatch report: {len(paths)} measurement(s), {elapsed:.1f} s -> {out / 'report.md'}")
    return 0
