"""Per-step metrics of a run: the step's flat dict, metrics.jsonl, TensorBoard event files, a progress line, token dumps."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from cisjax.answers import last_boxed
from cisjax.rl import corrections

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


def step_metrics(train: dict, rollout: dict, timings: dict, *, publish=None, flips=None, lead=None) -> dict:
    """The flat metrics of one step, as metrics.jsonl and TensorBoard hold them.

    train: the step's own metrics (logged as train/<key>); rollout: rollout_metrics of its batch; timings: seconds of
    its stages (time/<key>_s); publish: the PublishReport of the weights it published (None: nothing published);
    flips: flip_metrics under routing replay; lead: what only process 0 knows (the rollout side's timings, the reward
    pool's counts, an evaluation, a fleet's replicas)."""
    out = {f"train/{k}": v for k, v in train.items()}
    out.update(rollout)
    if publish is not None:
        out.update(publish.metrics())
    out.update(flips or {})
    out.update(
        {
            "reward_mean": rollout["reward/mean"],
            "accuracy": rollout["reward/accuracy"],
            "response_len": rollout["rollout/response_len"],
            "grad_norm": train["grad_norm"],
            "entropy": train["entropy"],
            "corr/acted_frac": train.get("acted_frac", 0.0),
            "staleness_mean": rollout["rollout/staleness_mean"],
            "skipped_steps": float(train["skipped"]),
            **{f"time/{k}_s": v for k, v in timings.items()},
            "tokens_per_s": train["tokens"] / max(timings["step"], 1e-9),
        }
    )
    out.update(lead or {})
    return out


def device_memory(devices) -> dict:
    """device/peak_gib and device/in_use_gib: the largest peak and current use of device memory over `devices` (this
    process's), in GiB; {} where the devices keep no statistics (the CPU)."""
    stats = [d.memory_stats() or {} for d in devices]
    if not any("peak_bytes_in_use" in s for s in stats):
        return {}
    return {
        "device/peak_gib": max(s.get("peak_bytes_in_use", 0) for s in stats) / 2**30,
        "device/in_use_gib": max(s.get("bytes_in_use", 0) for s in stats) / 2**30,
    }


def rollout_metrics(ro, step: int) -> dict:
    """Rewards, lengths, staleness and format of one step's rollouts (a train.rollouts.StepRollouts)."""
    rs = [r for g in ro.groups for r in g]
    rewards = np.asarray([r.reward for r in rs], np.float64)
    lengths = np.asarray([len(r.response_ids) for r in rs], np.float64)
    versions = np.concatenate([np.asarray(r.versions, np.int64) for r in rs if r.versions] or [np.zeros(0, np.int64)])
    stale = step - versions  # the params of step s are version s
    solved = np.asarray([max(r.reward for r in g) for g in ro.groups])
    boxed = [last_boxed(t) is not None for ts in ro.texts for t in ts]  # format compliance, whatever the answer
    return {
        "reward/mean": rewards.mean(),
        "reward/accuracy": float((rewards >= 1.0).mean()),
        "reward/solved_groups": float((solved >= 1.0).mean()),
        "reward/all_same_groups": float(np.mean([len({r.reward for r in g}) == 1 for g in ro.groups])),
        "rollout/response_len": lengths.mean(),
        "rollout/response_len_max": lengths.max(),
        "rollout/truncated": float(np.mean([r.finish_reason == "length" for r in rs])),
        "rollout/staleness_mean": float(stale.mean()) if stale.size else 0.0,
        "rollout/staleness_max": float(stale.max()) if stale.size else 0.0,
        "rollout/samples": float(len(rs)),
        "rollout/tokens": float(lengths.sum()),
        "rollout/boxed_frac": float(np.mean(boxed)) if boxed else 0.0,
        "data/position": float(prompts_handed_out(ro.data_state)),
    }


def prompts_handed_out(data_state: dict) -> int:
    """Prompts a stream in `data_state` (PromptStream.state()) has handed out over all its epochs."""
    return int(data_state["epoch"]) * int(data_state["size"]) + int(data_state["position"])


def flip_metrics(flips, segments) -> dict:
    """Routing replay: the fraction of valid positions (prompt and response) with any MoE layer whose own routing
    differs from the replayed one, and of (position, layer) pairs. flips: forward.Flips on the host."""
    valid = float(np.sum(np.asarray(segments) > 0))
    layers = np.asarray(flips.layers_BxT)
    per_layer = np.asarray(flips.per_layer_X)
    return {
        "replay/flip_token_frac": float(np.sum(layers > 0)) / max(valid, 1.0),
        "replay/flip_pair_frac": float(per_layer.sum()) / max(valid * len(per_layer), 1.0),
        "replay/flip_layer_frac_max": float(per_layer.max()) / max(valid, 1.0),
    }


def dump_step(
    run_dir, step: int, correction, host, prox_MxBxT, versions, flips=None, *, sample_tokens: int, seed: int
) -> Path:
    """write_dump of one step: the batch on the host, its proximal logprobs, each token's rollout version [M*B, T],
    the weights of `correction` (the run's CorrectionSpec) on them; `flips` under routing replay (on the host)."""
    m, b, t = host.tokens_MxBxT.shape
    prox = np.asarray(prox_MxBxT).reshape(m * b, t)
    infer = np.asarray(host.infer_logprobs_MxBxT).reshape(m * b, t)
    mask = np.asarray(host.loss_mask_MxBxT).reshape(m * b, t)
    c = corrections.correction(correction.method, prox, infer, mask, **correction.hparams())
    return write_dump(
        run_dir,
        step,
        infer_logprobs=infer,
        prox_logprobs=prox,
        mask=mask,
        weights=np.asarray(c.weights_BxT),
        acted=np.asarray(c.acted_BxT),
        token_versions=versions,
        current_version=step,
        sample_tokens=sample_tokens,
        seed=seed,
        routing_flips=None if flips is None else np.asarray(flips.layers_BxT).reshape(m * b, t),
        routing_flips_per_layer=None if flips is None else np.asarray(flips.per_layer_X),
    )


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
            raise ValueError(f"print_every must be >= 1, got {print_every}")
        self.print_every, self.start = print_every, start_step
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._truncate(start_step)
        self._file = open(self.path, "a")
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter  # lazy: it imports torch (3-5 s), only for runs that write events

            self._tb = SummaryWriter(str(Path(run_dir) / "tb"), purge_step=start_step)
        self.total = total_steps
        self._progress = None
        if progress is None:
            progress = sys.stderr.isatty()
        if progress:
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
    """A sample of the step's valid tokens (the token dump the mismatch observatory reads) as `run_dir/dumps/step_XXXXXXX.npz`:
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
