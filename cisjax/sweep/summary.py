"""The sweep's comparison: per arm, mean and spread over seeds of reward, held-out accuracy, correction and cost metrics; sweep.md + sweep.png."""

from __future__ import annotations

import json
import statistics
import warnings
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

__all__ = ["arm_table", "read_rows", "recovery", "write"]

ON_POLICY_ARM = "exact"  # cisjax.sweep.runs.ON_POLICY_ARM: the on-policy reference of the recovery columns

# (column, metrics.jsonl key, how a run's rows reduce to one number)
PER_RUN = [
    ("acted frac", "train/acted_frac", "mean"),
    ("mean \\|log k\\|", "train/abs_logk_mean", "mean"),
    ("grad norm", "train/grad_norm", "mean"),
    ("step s", "time/step_s", "median"),
    ("train s", "time/train_s", "median"),
    ("staleness", "rollout/staleness_mean", "mean"),
    ("q == p frac", "train/exact_frac", "mean"),
    ("engine perturbation (rel rms)", "publish/perturb_rel_rms", "mean"),
]


def read_rows(path: Path) -> list[dict]:
    """metrics.jsonl's rows; a last line cut by a crash ends them (the rows before it stand)."""
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def _rows(run_dir: Path) -> list[dict]:
    return read_rows(Path(run_dir) / "metrics.jsonl")


def _series(rows: list[dict], key: str, steps: int) -> np.ndarray:
    out = np.full(steps, np.nan)
    for r in rows:
        if key in r and 0 <= r["step"] < steps:
            out[r["step"]] = r[key]
    return out


def _reduce(values: np.ndarray, how: str, skip_first: bool) -> float:
    v = values[1:] if skip_first and values.size > 1 else values  # step 0 holds the compile
    v = v[np.isfinite(v)]
    if v.size == 0:
        return float("nan")
    return float(np.median(v) if how == "median" else np.mean(v))


def _held_out(rows: list[dict]) -> dict:
    """The last evaluation logged (eval/<set>/accuracy, the final one when eval.final), per set."""
    out = {}
    for r in rows:
        for k, v in r.items():
            if k.startswith("eval/") and k.endswith("/accuracy"):
                out[k.split("/")[1]] = float(v)
    return out


def _held_out_reward(run_dir: Path) -> dict:
    """Per set, the share of the last evaluation's responses whose answer is a correct \\boxed{} (the training
    reward's rule, where the eval's accuracy also takes "the answer is N" and a last number): from
    RUN/eval/vNNNNNN/samples.jsonl of the latest version."""
    evals = sorted(Path(run_dir).glob("eval/v*/samples.jsonl"))
    if not evals:
        return {}
    hits: dict[str, list[bool]] = {}
    for row in read_rows(evals[-1]):
        hits.setdefault(row["set"], []).append(bool(row.get("correct")) and row.get("rule") == "boxed")
    return {name: float(np.mean(v)) for name, v in hits.items()}


def _spread(values: list[float]) -> dict:
    v = [x for x in values if np.isfinite(x)]
    if not v:
        return {"mean": float("nan"), "sd": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {
        "mean": float(np.mean(v)),
        "sd": float(statistics.stdev(v)) if len(v) > 1 else 0.0,
        "min": float(min(v)),
        "max": float(max(v)),
        "n": len(v),
    }


def arm_table(runs, steps: int, window: int = 0) -> dict:
    """{arm: {"seeds": [...], "final_reward": spread, "held_out": {set: spread}, <column>: spread, "curve": {mean, min,
    max} per step, "complete": finished seeds}} over the runs' metrics.jsonl. A run's final reward is its mean
    reward over the last `window` steps (0 = a quarter of the steps)."""
    window = window or max(1, steps // 4)
    arms: dict[str, dict] = {}
    for r in runs:
        rows = _rows(r.run_dir)
        a = arms.setdefault(
            r.arm, {"seeds": [], "curves": [], "finals": [], "held": {}, "held_reward": {}, "cols": {}, "complete": 0}
        )
        if not rows:
            continue
        reward = _series(rows, "reward/mean", steps)
        a["seeds"].append(r.seed)
        a["curves"].append(reward)
        a["complete"] += int(rows[-1].get("step") == steps - 1)
        tail = reward[-window:]
        a["finals"].append(float(np.nanmean(tail)) if np.isfinite(tail).any() else float("nan"))
        for name, v in _held_out(rows).items():
            a["held"].setdefault(name, []).append((r.seed, v))
        for name, v in _held_out_reward(r.run_dir).items():
            a["held_reward"].setdefault(name, []).append(v)
        for col, key, how in PER_RUN:
            a["cols"].setdefault(col, []).append(_reduce(_series(rows, key, steps), how, key.startswith("time/")))
    out = {}
    for arm, a in arms.items():
        curves = np.asarray(a["curves"]) if a["curves"] else np.full((0, steps), np.nan)
        with warnings.catch_warnings():  # steps no seed reached yet are NaN: not a problem
            warnings.simplefilter("ignore", RuntimeWarning)
            curve = {
                "mean": np.nanmean(curves, 0).tolist() if len(curves) else [],
                "min": np.nanmin(curves, 0).tolist() if len(curves) else [],
                "max": np.nanmax(curves, 0).tolist() if len(curves) else [],
            }
        out[arm] = {
            "seeds": a["seeds"],
            "complete": a["complete"],
            "final_reward": _spread(a["finals"]),
            "final_reward_per_seed": a["finals"],
            "held_out": {k: _spread([x for _, x in v]) for k, v in a["held"].items()},
            "held_out_per_seed": {k: dict(v) for k, v in a["held"].items()},
            "held_out_reward": {k: _spread(v) for k, v in a["held_reward"].items()},
            **{col: _spread(v) for col, v in a["cols"].items()},
            "curve": curve,
            "window": window,
        }
    return out


def recovery(table: dict, name: str) -> dict:
    """Per arm, how much of the on-policy arm's held-out accuracy on set `name` it recovers, from the seed means:
    {"of exact": a / e, "gap closed": (a - n) / (e - n)} (a the arm's, e the exact arm's, n the `none` arm's; NaN
    where an arm is missing or not evaluated, and the gap where e == n). Empty without an evaluated exact arm."""

    def mean(arm):
        s = table.get(arm, {}).get("held_out", {}).get(name, {})
        return s["mean"] if s.get("n") else float("nan")

    e, n = mean(ON_POLICY_ARM), mean("none")
    if not np.isfinite(e):
        return {}
    out = {}
    for arm in table:
        a = mean(arm)
        of = a / e if e else float("nan")
        gap = (a - n) / (e - n) if np.isfinite(n) and e != n else float("nan")
        out[arm] = {"of exact": float(of), "gap closed": float(gap)}
    return out


def _ratio(x: float) -> str:
    return f"{x:.3f}" if np.isfinite(x) else "—"


def _fmt(s: dict, digits: int = 3) -> str:
    if not s or not s["n"] or not np.isfinite(s["mean"]):
        return "—"
    if s["n"] == 1:
        return f"{s['mean']:.{digits}g}"
    return f"{s['mean']:.{digits}g} ± {s['sd']:.2g} ({s['min']:.{digits}g}–{s['max']:.{digits}g})"


def _trailing(x: np.ndarray, width: int) -> np.ndarray:
    """Mean of the last `width` finite values at each step (fewer at the start)."""
    out = np.full(x.shape, np.nan)
    for i in range(x.size):
        window = x[max(0, i - width + 1) : i + 1]
        if np.isfinite(window).any():
            out[i] = np.nanmean(window)
    return out


def _plot(table: dict, path: Path) -> None:
    """sweep.png: the training reward per arm over the steps, and each held-out set's accuracy per arm and seed."""
    sets = sorted({s for t in table.values() for s in t["held_out"]})
    fig = Figure(figsize=(7 + 3.5 * len(sets), 4))  # no pyplot: no global figure state, no GUI backend
    axes = fig.subplots(1, 1 + len(sets), squeeze=False)
    ax = axes[0, 0]
    width, colors = 1, {}
    for arm, t in table.items():
        mean = np.asarray(t["curve"]["mean"], float)
        if not mean.size:
            continue
        width = max(1, mean.size // 12)  # one batch's reward is noisy: a trailing mean over ~1/12 of the run
        x = np.arange(mean.size)
        line = ax.plot(x, _trailing(mean, width), label=f"{arm} ({len(t['seeds'])} seeds)", lw=1.2)[0]
        colors[arm] = line.get_color()
        lo, hi = (_trailing(np.asarray(t["curve"][k], float), width) for k in ("min", "max"))
        ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.15, lw=0)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training reward, trailing mean of {width}\n(mean over seeds; band: min-max)")
    ax.legend(fontsize=8)
    for ax, name in zip(axes[0, 1:], sets):  # held-out accuracy of the final weights: each seed, and the mean
        arms = list(table)
        for i, arm in enumerate(arms):
            per = list(table[arm].get("held_out_per_seed", {}).get(name, {}).values())
            ax.scatter([i] * len(per), per, s=14, alpha=0.7, color=colors.get(arm))
            if per:
                ax.hlines(np.mean(per), i - 0.3, i + 0.3, color="k", lw=1.5)
        ax.set_xticks(range(len(arms)), arms)
        ax.set_ylabel(f"held-out accuracy, {name}\n(dots: seeds; bar: mean)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write(out: Path, runs, steps: int, window: int = 0) -> Path:
    """sweep.md, sweep_summary.json and sweep.png in `out`; returns the markdown's path."""
    out = Path(out)
    table = arm_table(runs, steps, window)
    sets = sorted({s for t in table.values() for s in t["held_out"]})
    rec = {name: recovery(table, name) for name in sets}
    for arm, t in table.items():
        t["recovery"] = {name: r[arm] for name, r in rec.items() if arm in r}
    (out / "sweep_summary.json").write_text(json.dumps(table, indent=1))
    _plot(table, out / "sweep.png")
    meta = json.loads((out / "sweep.json").read_text()) if (out / "sweep.json").is_file() else {}
    md = ["# cisjax sweep\n"]
    if meta:
        md.append(f"`{meta.get('config')}`, arms {', '.join(meta.get('arms', []))}, {meta.get('seeds')} seeds, ")
        md.append(f"{steps} steps; overrides: `{' '.join(meta.get('overrides', [])) or 'none'}`.\n")
    md.append(
        f"\nValues are mean ± sd over seeds (min–max). Final reward: a run's mean training reward over its last "
        f"{next(iter(table.values()))['window'] if table else '-'} steps. Step and train seconds: medians over a run's "
        "steps after the first (compilation). Cost: the arm's train seconds / the `none` arm's."
        + (
            ' Held-out: the run\'s last evaluation (greedy); accuracy grades the last \\boxed{}, else "the answer is N", '
            "else the last number; reward counts only a correct \\boxed{} answer, the training reward's rule."
            if sets
            else ""
        )
        + (
            f" Recovery of the on-policy `{ON_POLICY_ARM}` arm's held-out accuracy, from the seed means: of exact = "
            "arm / exact; gap closed = (arm - none) / (exact - none), the share of the mismatch's loss the arm wins back "
            "(1: as on-policy, 0: as no correction)."
            if any(rec.values())
            else ""
        )
        + "\n\n"
    )
    head = ["arm", "runs (finished)", "final reward"]
    head += [h for s in sets for h in (f"held-out {s} accuracy", f"held-out {s} reward")]
    head += [f"{s} {k}" for s in sets if rec[s] for k in ("of exact", "gap closed")]
    head += [c for c, _, _ in PER_RUN]
    head.append("cost vs none")
    md.append("| " + " | ".join(head) + " |\n|" + "---|" * len(head) + "\n")
    base = table.get("none", {}).get("train s", {}).get("mean")
    for arm, t in table.items():
        cells = [arm, f"{len(t['seeds'])} ({t['complete']})", _fmt(t["final_reward"])]
        cells += [_fmt(t[k].get(s, {})) for s in sets for k in ("held_out", "held_out_reward")]
        cells += [_ratio(rec[s][arm][k]) for s in sets if rec[s] for k in ("of exact", "gap closed")]
        cells += [_fmt(t.get(c, {})) for c, _, _ in PER_RUN]
        own = t.get("train s", {})
        cost = own["mean"] / base if base and np.isfinite(base) and own.get("n") else float("nan")
        cells.append(f"{cost:.3f}" if np.isfinite(cost) else "—")
        md.append("| " + " | ".join(cells) + " |\n")
    md.append("\nFinal reward per seed:\n\n")
    for arm, t in table.items():
        per = ", ".join(f"seed {s}: {v:.3f}" for s, v in zip(t["seeds"], t["final_reward_per_seed"]))
        md.append(f"- {arm}: {per or 'no runs yet'}\n")
    for name in sets:
        md.append(f"\nHeld-out accuracy ({name}, the last evaluation of each run) per seed:\n\n")
        for arm, t in table.items():
            per = ", ".join(f"seed {k}: {v:.3f}" for k, v in t["held_out_per_seed"].get(name, {}).items())
            md.append(f"- {arm}: {per or 'not evaluated'}\n")
    md.append("\n![training reward and held-out accuracy per arm](sweep.png)\n")
    path = out / "sweep.md"
    path.write_text("".join(md))
    return path
