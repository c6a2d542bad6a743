"""report.md: one function per section of the Appendix A report, over the summaries of analysis.analyse."""

from __future__ import annotations

import math

import numpy as np

from cisjax.mismatch.analysis import PHASES, ReportSpec, slug


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


def _exact_frac(x) -> str:
    """The share of tokens with p = q bit for bit: "1" only when every token is (never rounded up to it)."""
    if x is None or math.isnan(x):
        return "—"
    return "1" if x == 1 else f"{math.floor(x * 1e6) / 1e6:.6f}"


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


def _binned(d, spec):
    """A per-bin table of the arrays or lists in `d`: spec = [(header, key, pct)], one row per entry of the first."""
    columns = [(d[key], pct) for _, key, pct in spec]
    rows = [
        [_num(col[i], pct) if not isinstance(col[i], str) else col[i] for col, pct in columns]
        for i in range(len(columns[0][0]))
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


REGION_SPEC = [
    ("Tokens in region", "tokens_in_region", False),
    ("MAD(ε) max/min", "mad_eps_ratio", False),
    ("MAD(log k) max/min", "mad_logk_ratio", False),
    ("max |median ε|", "max_abs_median_eps", False),
    ("Spearman(ε, log(1−p))", "spearman_eps", False),
    ("Spearman(|ε|, log(1−p))", "spearman_abs_eps", False),
]

NFLIP_COLUMNS = [
    ("N_flip", "labels", False),
    ("Positions", "positions", False),
    ("Positions (%)", "position_frac", True),
    ("Entries", "entries", False),
    ("sd(δ)", "sd", False),
    ("P(|δ|>0.5)", "frac_abs_gt_0.5", True),
    ("P(|δ|>1)", "frac_abs_gt_1", True),
]

CONFIDENCE_COLUMNS = [
    ("p range", "labels", False),
    ("Tokens", "tokens", False),
    ("Med. ε", "median_eps", False),
    ("MAD(ε)", "mad_eps", False),
    ("q05(ε)", "q05_eps", False),
    ("q95(ε)", "q95_eps", False),
    ("MAD(log k)", "mad_logk", False),
]

REGION_COLUMNS = [
    ("1 − p (centre)", "centers", False),
    ("Tokens", "tokens", False),
    ("Med. ε", "median_eps", False),
    ("MAD(ε)", "mad_eps", False),
    ("MAD(log k)", "mad_logk", False),
]

BIAS_COLUMNS = [
    ("p range", "labels", False),
    ("Tokens", "tokens", False),
    ("CIS acted", "cis_acted", False),
    ("CIS bias", "cis_bias", False),
    ("TIS acted", "tis_acted", False),
    ("TIS bias", "tis_bias", False),
]


def _header(labels, summaries, warnings, spec: ReportSpec, elapsed) -> list[str]:
    """The title, the measurements, the operators' parameters and the warnings."""
    md = ["# Training-inference mismatch report (paper Appendix A)\n"]
    md.append(
        _table(
            ["", "pair", "side p (train)", "side q (infer)", "model", "tokens", "exact frac (p = q)", "max |log k|"],
            [
                [
                    lab,
                    s["meta"].get("pair"),
                    s["meta"].get("side_p"),
                    s["meta"].get("side_q"),
                    s["meta"].get("model", "—"),
                    _num(s["eps_stats"]["tokens"]),
                    _exact_frac(s["exact_frac"]),
                    _num(s["max_abs_logk"]),
                ]
                for lab, s in zip(labels, summaries)
            ],
        )
    )
    md.append(
        f"Operators: CIS λ = {spec.lam:g}, κ = {spec.kappa:g}; TIS C = {spec.cap:g}. Analysis time {elapsed:.1f} s.\n"
    )
    return md + [f"**Warning:** {w}\n" for w in warnings]


def _checks(labels, summaries) -> list[str]:
    """The identity k = p + (1−p)e^ε and the controls."""
    md = ["## Checks\n"]
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
    return md


def _delta(labels, summaries, figures) -> list[str]:
    """tab:appA_delta_stats, where the measurements have top-K."""
    md = ["## Per-logit perturbation δ (tab:appA_delta_stats)\n"]
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
    return md


def _nflip(labels, summaries) -> list[str]:
    """tab:appA_routing, where the measurements have top-K and routing."""
    md = ["## δ by N_flip (tab:appA_routing)\n"]
    for lab, s in zip(labels, summaries):
        if "delta_by_nflip" not in s:
            why = "no topk.npz" if "delta_stats" not in s else "no routing.npz (MoE expert ids of both engines)"
            md.append(f"Omitted for {lab}: {why} in the measurement.\n")
            continue
        r = s["delta_by_nflip"]
        md.append(f"### {lab}\n")
        md.append(f"Mean N_flip {_num(r['nflip_mean'])}; {r['paired_with_routing']:,} paired entries with routing.\n")
        md.append(_binned(r, NFLIP_COLUMNS))
    return md


def _eps(labels, summaries, figures) -> list[str]:
    """tab:appA_epsilon_stats, and by training phase where the measurements have phases."""
    md = ["## Log-odds displacement ε (tab:appA_epsilon_stats)\n"]
    md.append(_side_by_side(labels, [s["eps_stats"] for s in summaries], EPS_SPEC))
    if "ccdf_eps" in figures:
        md.append("![CCDF of |ε|](ccdf_eps.png)\n")
    phased = [(lab, s) for lab, s in zip(labels, summaries) if "eps_by_phase" in s]
    if not phased:
        md.append(
            "ε by training phase omitted: no measurement has a `phase` field (only training-run token dumps do).\n"
        )
        return md
    md.append("### ε by training phase\n")
    for lab, s in phased:
        md.append(f"#### {lab}\n")
        md.append(_side_by_side(PHASES, [s["eps_by_phase"][ph] for ph in PHASES], EPS_SPEC))
    return md


def _confidence(labels, summaries) -> list[str]:
    """tab:appA_confidence: ε per bin of p."""
    md = ["## ε by confidence (tab:appA_confidence)\n"]
    for lab, s in zip(labels, summaries):
        c = s["eps_by_confidence"]
        md.append(f"### {lab}\n")
        md.append(_binned(c, CONFIDENCE_COLUMNS))
    md.append("![ε against 1 − p](eps_vs_uncertainty.png)\n")
    return md


def _mad(labels, summaries, spec: ReportSpec) -> list[str]:
    """Appendix A.6: MAD of ε and log k over the log bins of 1 − p, in all of it and above the floor κ."""
    md = ["## MAD of ε and log k over 18 log bins of 1 − p (Appendix A.6)\n"]
    for region, title in (("all", "1 − p ≥ 1e-7, bins 1e-6 … 1"), ("floor", f"1 − p ≥ κ = {spec.kappa:g}, bins κ … 1")):
        md.append(f"### {title}\n")
        md.append(_side_by_side(labels, [s["confidence_invariance"][region] for s in summaries], REGION_SPEC))
        for lab, s in zip(labels, summaries):
            r = s["confidence_invariance"][region]
            md.append(f"{lab}:\n")
            md.append(_binned(r, REGION_COLUMNS))
    md.append(f"Spearman correlations on a uniform subsample of at most {spec.spearman_tokens:,} tokens per region.\n")
    md.append("![MAD against 1 − p](mad_vs_uncertainty.png)\n")
    return md


def _moments(labels, summaries) -> list[str]:
    """Appendix A.7: E[e^{αε}] and E[((1−p)e^ε)^α] over the α grid."""
    md = ["## Moments E[e^{αε}] and E[((1−p)e^ε)^α] (Appendix A.7)\n"]
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
    return md


def _variance(labels, summaries) -> list[str]:
    """Section 4.3: the share of Var(k) from each side of k = 1."""
    md = ["## Share of Var(k) by side of k = 1 (Section 4.3)\n"]
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
    return md


def _bias(labels, summaries) -> list[str]:
    """Section 4.3: the truncation bias of CIS and TIS per confidence bin."""
    md = ["## Truncation bias E[k − f(k)] per confidence bin, CIS vs TIS (Section 4.3)\n"]
    for lab, s in zip(labels, summaries):
        t = s["truncation_bias"]
        md.append(f"### {lab}\n")
        md.append(_binned(t, BIAS_COLUMNS))
        md.append(f"Total bias: CIS {_num(t['cis_bias_total'])}, TIS {_num(t['tis_bias_total'])}.\n")
    return md


def _acted(labels, summaries) -> list[str]:
    """The fraction of tokens (and of responses) each operator acts on."""
    md = ["## Fraction of tokens each operator acts on\n"]
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
    return md


def _plane(labels, figures, spec: ReportSpec) -> list[str]:
    """The p_train – p_infer plane figures."""
    md = ["## The p_train – p_infer plane\n"]
    md.append(
        f"Per operator: tokens it keeps (blue) and truncates / masks (red), on a uniform subsample of at most "
        f"{spec.plot_points:,} tokens per measurement.\n"
    )
    for lab in labels:
        name = f"plane_{slug(lab)}"
        if name in figures:
            md.append(f"![{lab}: p_train against p_infer]({figures[name]})\n")
    return md


def _raw(labels, spec: ReportSpec) -> list[str]:
    """Where the per-token data went (nothing without it)."""
    if not spec.raw:
        return []
    return [
        "## Raw data\n",
        "Per-token logp, logq, eps, log k (float32), seq_id, position, token_id (and phase) in "
        + ", ".join(f"`raw/{slug(lab)}.npz`" for lab in labels)
        + ".\n",
    ]


def markdown(labels, summaries, figures, warnings, spec: ReportSpec, elapsed) -> str:
    """report.md: the sections in order."""
    md = _header(labels, summaries, warnings, spec, elapsed)
    md += _checks(labels, summaries) + _delta(labels, summaries, figures) + _nflip(labels, summaries)
    md += _eps(labels, summaries, figures) + _confidence(labels, summaries) + _mad(labels, summaries, spec)
    md += _moments(labels, summaries) + _variance(labels, summaries) + _bias(labels, summaries)
    md += _acted(labels, summaries) + _plane(labels, figures, spec) + _raw(labels, spec)
    return "\n".join(md)
