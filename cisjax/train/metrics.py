"""Per-step metrics of a run: metrics.jsonl (always), TensorBoard event files, a rich progress line, token dumps."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import numpy as np

from cisjax import errors

SHOWN = (
    "reward_mean",
    "accuracy",
    "response_len",
    "grad_norm",
    "corr/acted_frac",
    "staleness_mean",
    "time/step_s",
    "eval/average",
)


def _clean(v):
    v = float(v)
    return v if math.isfinite(v) else None  # JSON has no NaN/inf; null says "not finite"


class MetricsLog:
    """Appends one JSON line per step to `run_dir/metrics.jsonl` (flushed and fsynced, so a killed
    run loses nothing logged), mirrors every number to TensorBoard under `run_dir/tb`, and shows a
    progress line on a terminal. On resume the file is truncated to the steps before `start_step`."""

    def __init__(
        self,
        run_dir,
        *,
        total_steps: int,
        start_step: int = 0,
        tensorboard: bool = True,
        progress: bool | None = None,
        print_every: int = 1,
    ):
        if print_every < 1:
            raise errors.UserError(f"run.print_every must be >= 1, got {print_every}")
        self.print_every, self.start = print_every, start_step
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._truncate(start_step)
        self._file = open(self.path, "a")
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(Path(run_dir) / "tb"), purge_step=start_step)
        self.total = total_steps
        self._progress = None
        if progress is None:
            progress = sys.stderr.isatty()
        if progress:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.description}"),
                transient=False,
            )
            self._task = self._progress.add_task("", total=total_steps, completed=start_step)
            self._progress.start()

    def _truncate(self, start_step: int) -> None:
        if not self.path.exists():
            return
        kept = [
            line
            for line in self.path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) < start_step
        ]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)

    def log(self, step: int, metrics: dict) -> None:
        record = {"step": int(step), **{k: _clean(v) for k, v in sorted(metrics.items())}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        if self._tb is not None:
            for k, v in metrics.items():
                if v is not None and math.isfinite(float(v)):
                    self._tb.add_scalar(k, float(v), step)
        if self._progress is not None:
            shown = " ".join(f"{k.split('/')[-1]}={metrics[k]:.3g}" for k in SHOWN if k in metrics)
            self._progress.update(self._task, completed=step + 1, description=shown)
        elif (step + 1) % self.print_every == 0 or step in (self.start, self.total - 1):
            shown = " ".join(f"{k}={metrics[k]:.4g}" for k in SHOWN if k in metrics)
            print(f"step {step + 1}/{self.total} {shown}", flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._tb is not None:
            self._tb.close()
        self._file.close()


def write_dump(
    run_dir,
    step: int,
    *,
    infer_logprobs,
    prox_logprobs,
    mask,
    weights,
    acted,
    token_versions,
    current_version: int,
    sample_tokens: int,
    seed: int,
    routing_flips=None,
    routing_flips_per_layer=None,
) -> Path:
    """A sample of the step's valid tokens (operators.md's token dump) as `run_dir/dumps/step_XXXXXXX.npz`:
    logp_infer, logp_prox, rollout version, current version, loss mask, weight, acted-on flag (and
    row, position). Written to a temp name then renamed. Under routing replay also `routing_flips` (per sampled
    token: MoE layers whose own routing differs from the replayed one) and `routing_flips_per_layer` (per MoE layer:
    positions of the whole step, prompt and response, where it differs)."""
    mask = np.asarray(mask).astype(bool)
    rows, cols = np.nonzero(mask)
    if sample_tokens and len(rows) > sample_tokens:
        pick = np.sort(np.random.default_rng(seed + step).choice(len(rows), sample_tokens, replace=False))
        rows, cols = rows[pick], cols[pick]
    out = Path(run_dir) / "dumps"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"step_{step:07d}.npz"
    tmp = out / f".step_{step:07d}.tmp.npz"
    np.savez_compressed(
        tmp,
        logp_infer=np.asarray(infer_logprobs)[rows, cols].astype(np.float32),
        logp_prox=np.asarray(prox_logprobs)[rows, cols].astype(np.float32),
        rollout_version=np.asarray(token_versions)[rows, cols].astype(np.int64),
        current_version=np.full(len(rows), current_version, np.int64),
        loss_mask=mask[rows, cols],
        weight=np.asarray(weights)[rows, cols].astype(np.float32),
        acted=np.asarray(acted)[rows, cols].astype(bool),
        row=rows.astype(np.int32),
        position=cols.astype(np.int32),
        **(
            {}
            if routing_flips is None
            else dict(
                routing_flips=np.asarray(routing_flips)[rows, cols].astype(np.int16),
                routing_flips_per_layer=np.asarray(routing_flips_per_layer).astype(np.int64),
            )
        ),
    )
    os.replace(tmp, path)
    return path
