"""`cisjax mismatch report`'s library: the Appendix A tables, plots, report.md and summary.json from measurements."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cisjax import errors
from cisjax.mismatch import analysis, markdown, plots, records
from cisjax.mismatch.analysis import ReportSpec


@dataclass(frozen=True)
class Report:
    """What report() wrote: from how many measurements, in how long, with which warnings."""

    paths: tuple[Path, ...]  # the measurement directories, in column order
    markdown: Path  # report.md
    warnings: tuple[str, ...]
    elapsed_s: float


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


def _vocab_warnings(labels, metas) -> list[str]:
    """Different vocabularies are a warning, not an error: the paper compares different models side by side (dense vs
    MoE); the numbers of each column stay valid, only token-level comparisons across them are not."""
    vocabs = {lab: m.get("vocab_size") for lab, m in zip(labels, metas) if m.get("vocab_size") is not None}
    if len(set(vocabs.values())) <= 1:
        return []
    return [
        "the measurements come from different vocabularies (vocab_size "
        + ", ".join(f"{lab}: {v}" for lab, v in vocabs.items())
        + "): each column is valid on its own, but token ids and top-K sets do not compare across them."
    ]


def _summary_doc(labels, paths, summaries, warnings, figures, spec: ReportSpec) -> dict:
    """summary.json: every table number per measurement, the warnings, the figures and the settings."""
    return {
        "measurements": {lab: {"path": str(p), **s} for lab, p, s in zip(labels, paths, summaries)},
        "warnings": warnings,
        "figures": figures,
        "params": {
            "lam": spec.lam,
            "kappa": spec.kappa,
            "cap": spec.cap,
            "plot_points": spec.plot_points,
            "spearman_tokens": spec.spearman_tokens,
            "seed": spec.seed,
        },
    }


def report(measurements, spec: ReportSpec) -> Report:
    """Analyse the measurement directories `measurements` (each one, or one holding one per engine pair) one at a time
    and write report.md, summary.json, the figures and (spec.raw) raw/*.npz into spec.out."""
    t0 = time.perf_counter()
    paths = records.find(measurements)
    out = Path(spec.out)
    out.mkdir(parents=True, exist_ok=True)
    metas = [json.loads((p / "meta.json").read_text()) for p in paths]
    for p, meta in zip(paths, metas):
        if not meta.get("pair"):
            raise errors.UserError(f"mismatch measurement in {p}: meta.json lacks 'pair'")
    labels = _labels(paths, metas)
    warnings = _vocab_warnings(labels, metas)
    summaries, plot_data = [], []
    for path, label in zip(paths, labels):
        m = records.load(path)  # one measurement in memory at a time
        summary, plot = analysis.analyse(m, label, spec)
        plot["confidence_invariance"] = summary["confidence_invariance"]
        summaries.append(summary)
        plot_data.append(plot)
        del m
    figures = plots.figures(out, labels, plot_data, spec)
    elapsed = time.perf_counter() - t0
    (out / "report.md").write_text(markdown.markdown(labels, summaries, figures, warnings, spec, elapsed))
    doc = _summary_doc(labels, paths, summaries, warnings, figures, spec)
    (out / "summary.json").write_text(json.dumps(_jsonable(doc), indent=1) + "\n")
    return Report(tuple(paths), out / "report.md", tuple(warnings), elapsed)
