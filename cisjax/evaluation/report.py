"""The outputs of an evaluation: OUT/results.json, OUT/samples.jsonl (one line per problem and sample), OUT/report.md (the table)."""

from __future__ import annotations

import json
from pathlib import Path

from cisjax import files
from cisjax.evaluation import scores

__all__ = ["SAMPLE_KEYS", "results", "write", "markdown"]

SAMPLE_KEYS = (
    "set",
    "id",
    "sample",
    "prompt",
    "response",
    "answer",
    "rule",
    "gold",
    "correct",
    "graded_by",
    "finish_reason",
    "response_tokens",
    "version",
)


def results(
    per_set: dict,
    *,
    model: str,
    export_version,
    engine: dict,
    settings,
    prompt: dict,
    elapsed_s: float,
    grading: dict,
    limit: int,
) -> dict:
    """The results.json document: per set, the unweighted average, and what was evaluated how."""
    count = sum(s["count"] for s in per_set.values())
    eval_s = sum(s["elapsed_s"] for s in per_set.values())  # generation and grading, without the engine's start
    return {
        "sets": per_set,
        "average": {"accuracy": scores.average(per_set), "sets": list(per_set)},
        "model": model,
        "export_version": export_version,
        "engine": engine,
        "sampling": settings.to_json(),
        "prompt": prompt,
        "limit": limit,
        "problems": count,
        "elapsed_s": elapsed_s,
        "eval_s": eval_s,
        "problems_per_s": count / max(eval_s, 1e-9),
        "grading": grading,
        "notes": [s["size_note"] for s in per_set.values() if s.get("size_note")],
    }


def _atomic_text(path: Path, text: str) -> None:
    with files.atomic_open(path) as f:
        f.write(text)


def write(out_dir, doc: dict, samples: list[dict]) -> Path:
    """results.json, samples.jsonl and report.md in `out_dir` (created), each written atomically."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _atomic_text(
        out / "samples.jsonl",
        "".join(json.dumps({k: s[k] for k in SAMPLE_KEYS}, ensure_ascii=False) + "\n" for s in samples),
    )
    _atomic_text(out / "results.json", json.dumps(doc, indent=1) + "\n")
    _atomic_text(out / "report.md", markdown(doc))
    return out


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def markdown(doc: dict) -> str:
    """The report: what was evaluated, then one row per set and the unweighted average."""
    s = doc["sampling"]
    how = "greedy" if s["greedy"] else f"n={s['n']}, temperature {s['temperature']}, top-p {s['top_p']}"
    engine = doc.get("engine") or {}
    lines = [
        "# Evaluation",
        "",
        f"- model: `{doc['model']}`"
        + (f" (export version {doc['export_version']})" if doc.get("export_version") is not None else ""),
        f"- engine: {engine.get('engine', '?')} ({engine.get('dtype', '?')}), serving version {engine.get('version', '?')}",
        f"- decoding: {how}, at most {s['max_new_tokens']} new tokens; prompt `{doc['prompt']['style']}`",
        f"- {doc['problems']} problems: {doc['eval_s']:.0f} s of generation and grading ({doc['problems_per_s']:.2f} problems/s), "
        f"{doc['elapsed_s']:.0f} s in all (engine start included)"
        + (f"; first {doc['limit']} of each set" if doc.get("limit") else ""),
        "",
    ]
    extra = (
        [k for k in next(iter(doc["sets"].values())) if k.startswith(("pass@", "avg@")) and k != "pass@1"]
        if doc["sets"]
        else []
    )
    head = (
        ["set", "problems", "accuracy %"]
        + [f"{k} %" for k in extra]
        + ["answered %", "boxed %", "mean tokens", "truncated %"]
    )
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in doc["sets"].items():
        boxed = r["rules"]["boxed"] / r["samples"] if r["samples"] else 0.0
        row = [name, str(r["count"]), _pct(r["accuracy"])] + [_pct(r[k]) for k in extra]
        row += [_pct(r["answered"]), _pct(boxed), f"{r['mean_response_tokens']:.0f}", _pct(r["truncated"])]
        lines.append("| " + " | ".join(row) + " |")
    lines.append(
        f"| **average** ({len(doc['sets'])} sets, unweighted) | | **{_pct(doc['average']['accuracy'])}** |"
        + " |" * (len(head) - 3)
    )
    notes = list(doc.get("notes") or [])
    g = doc.get("grading") or {}
    if g.get("timed_out") or g.get("errors") or g.get("crashed"):
        notes.append(
            f"grading: {g.get('timed_out', 0)} math-verify items timed out, {g.get('errors', 0)} raised, "
            f"{g.get('crashed', 0)} crashed (all graded wrong)"
        )
    for name, r in doc["sets"].items():
        if r.get("prompt_too_long"):
            notes.append(f"{name}: {r['prompt_too_long']} prompts longer than the context length (graded wrong)")
        if r.get("budget_capped"):
            notes.append(f"{name}: {r['budget_capped']} prompts got fewer new tokens than asked (context length)")
        if len(r.get("versions") or []) > 1:
            notes.append(
                f"{name}: samples from several weight versions {r['versions']} (the server was updated during the run)"
            )
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"
