"""The report's figures, one function each: CCDFs of |δ| and |ε|, ε and MAD against 1 − p, the p_train–p_infer plane."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cisjax.mismatch import stats as S
from cisjax.mismatch.analysis import ReportSpec, slug
from cisjax.rl import corrections

# The operators of the p_train-p_infer plane, and what their acted flag means there.
PLANE_OPERATORS = (("cis", "truncates"), ("tis", "truncates"), ("icepop", "masks"))


def _pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display)."""
    import matplotlib  # lazy: matplotlib (choosing the backend is a process-wide switch, made when a figure is drawn)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib

    return plt


def _save(plt, fig, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name


def _ccdf(plt, out: Path, key: str, sym: str, labels, plots) -> str | None:
    """ccdf_<key>.png: P(|x| > t) of each measurement that has the curve, log-log."""
    curves = [(lab, pl[f"{key}_ccdf"]) for lab, pl in zip(labels, plots) if f"{key}_ccdf" in pl]
    curves = [(lab, c) for lab, c in curves if c[0].size]
    if not curves:
        return None
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for lab, (t, c) in curves:
        ok = c > 0
        ax.loglog(t[ok], c[ok], label=lab)
    ax.set_xlabel(f"|{sym}|")
    ax.set_ylabel(f"P(|{sym}| > x)")
    ax.set_title(f"CCDF of |{sym}|")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, out, f"ccdf_{key}.png")


def _eps_band(plt, out: Path, labels, plots) -> str:
    """eps_vs_uncertainty.png: ε against 1 - p, median and q05-q95 band per log bin of 1 - p (all tokens; bins with
    >= 20 tokens)."""
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
    return _save(plt, fig, out, "eps_vs_uncertainty.png")


def _mad(plt, out: Path, labels, plots, kappa: float) -> str:
    """mad_vs_uncertainty.png: MAD(ε) and MAD(log k) per log bin of 1 - p, κ marked."""
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
        ax.axvline(kappa, color="grey", ls="--", lw=0.8, label="κ")
        ax.set_title(f"{name} against 1 - p")
        ax.set_xlabel("1 - p")
        ax.set_ylabel(name)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    return _save(plt, fig, out, "mad_vs_uncertainty.png")


def _plane(plt, out: Path, label: str, plot, spec: ReportSpec) -> str | None:
    """plane_<label>.png: the subsampled tokens in the p_infer-p_train plane, per operator those it acts on in red."""
    lp, lq = plot["sample"]["logp"].astype(np.float32), plot["sample"]["logq"].astype(np.float32)
    if lp.size == 0:
        return None
    fig, axes = plt.subplots(1, len(PLANE_OPERATORS), figsize=(4.2 * len(PLANE_OPERATORS), 4.2), sharey=True)
    for ax, (op, verb) in zip(axes, PLANE_OPERATORS):
        mask = np.ones((1, lp.size), bool)
        hparams = dict(lam=spec.lam, kappa=spec.kappa, cap=spec.cap, threshold=spec.threshold)
        acted = np.asarray(corrections.correction(op, lp[None], lq[None], mask, **hparams).acted_BxT)[0]
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
    fig.suptitle(f"{label}: {lp.size:,} tokens subsampled")
    return _save(plt, fig, out, f"plane_{slug(label)}.png")


def figures(out: Path, labels, plots, spec: ReportSpec) -> dict:
    """The PNGs; {name: file name} of those written."""
    plt = _pyplot()
    written = [_ccdf(plt, out, key, sym, labels, plots) for key, sym in (("delta", "δ"), ("eps", "ε"))]
    written += [_eps_band(plt, out, labels, plots), _mad(plt, out, labels, plots, spec.kappa)]
    written += [_plane(plt, out, lab, pl, spec) for lab, pl in zip(labels, plots)]
    return {name.removesuffix(".png"): name for name in written if name is not None}
