"""The trainer's token dumps (RUN_DIR/dumps/step_*.npz) read as one mismatch measurement."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from cisjax import errors
from cisjax.mismatch import records


def read_dumps(run_dir) -> records.Measurement:
    """RUN_DIR/dumps/step_*.npz (metrics.write_dump) as one measurement: p = the proximal (XLA) logprob, q = the sampling
    one; phase 0/1/2 = the step's tercile among the dumps; seq_id numbers the (step, batch row) pairs; position is the
    token's column in the trainer's batch row (the dump has no response-relative index); token_id is -1 (not dumped)."""
    run_dir = Path(run_dir)
    files = [f for f in (run_dir / "dumps").glob("step_*.npz") if re.fullmatch(r"step_\d+", f.stem)]  # not .tmp ones
    files.sort(key=lambda f: int(f.stem.split("_")[1]))
    if not files:
        raise errors.MissingInput(
            f"--dump {run_dir}: no dumps/step_*.npz there (the trainer writes them every run.dump_every steps)"
        )
    steps = [int(f.stem.split("_")[1]) for f in files]
    phase_of = {s: min(2, 3 * i // len(steps)) for i, s in enumerate(steps)}
    cols = {k: [] for k in ("logp", "logq", "seq_id", "position", "phase", "staleness")}
    next_seq = 0
    for f, step in zip(files, steps):
        with np.load(f) as z:
            for key in ("logp_infer", "logp_prox"):
                if key not in z.files:
                    raise errors.UserError(f"{f}: not a token dump (no {key!r})")
            n = z["logp_infer"].shape[0]
            rows = z["row"] if "row" in z.files else np.arange(n)
            uniq, inv = np.unique(rows, return_inverse=True)
            cols["seq_id"].append(next_seq + inv)
            next_seq += len(uniq)
            cols["logp"].append(z["logp_prox"].astype(np.float64))
            cols["logq"].append(z["logp_infer"].astype(np.float64))
            cols["position"].append(z["position"] if "position" in z.files else np.full(n, -1))
            cols["phase"].append(np.full(n, phase_of[step]))
            if "rollout_version" in z.files and "current_version" in z.files:
                cols["staleness"].append(z["current_version"] - z["rollout_version"])
    cat = {k: np.concatenate(v) if v else np.zeros(0) for k, v in cols.items()}
    n = cat["logp"].shape[0]
    logp, logq = np.minimum(cat["logp"], 0.0), np.minimum(cat["logq"], 0.0)
    meta = {
        "pair": "train-dump",
        "side_p": "xla (proximal)",
        "side_q": "vllm (sampling)",
        "run_dir": str(run_dir.resolve()),
        "steps": steps,
        "phase_steps": {
            name: [s for s in steps if phase_of[s] == i] for i, name in enumerate(("early", "middle", "late"))
        },
        "tokens": int(n),
        "mean_k": float(np.mean(np.exp(logp - logq))) if n else None,
        "staleness_mean": float(np.mean(cat["staleness"])) if cat["staleness"].size else None,
        "token_id": "not in the dumps: -1",
        "position": "column in the trainer's batch row",
    }
    tokens = {
        "logp": logp,
        "logq": logq,
        "seq_id": cat["seq_id"],
        "position": cat["position"],
        "token_id": np.full(n, -1),
        "phase": cat["phase"],
    }
    return records.Measurement(meta=meta, tokens=tokens)
