"""A sweep's runs: every arm x seed as its own `cisjax train` run, checked before any starts, run one after another."""

from __future__ import annotations

import dataclasses
import shlex
import subprocess
import sys
import time
from pathlib import Path

from cisjax import config as config_lib
from cisjax import errors
from cisjax.sweep.summary import read_rows
from cisjax.train import validate

__all__ = ["ON_POLICY", "ON_POLICY_ARM", "Run", "arm_overrides", "plan_runs", "check_arms", "write_commands", "run_all"]

# set per run by the sweep: a user's override of them would make every run the same
OWN_OVERRIDES = ("--config.seed", "--config.rollout.seed", "--config.run.dir")
# the on-policy arm (configs/base.py's ON_POLICY_ARM and ON_POLICY, the same fields): its runs take these after the
# sweep's overrides, so a mismatch set for the other arms (--config.rollout.perturb=noise, lag, vllm) leaves it on-policy
ON_POLICY_ARM = "exact"
ON_POLICY = (
    "--config.rollout.backend=jax",
    "--config.rollout.colocated=true",
    "--config.rollout.exact=true",
    "--config.rollout.max_staleness=0",
    "--config.rollout.perturb=none",
    "--config.rollout.perturb_scale=0.0",
    "--config.rollout.lag=0",
    "--config.routing.replay=none",
    "--config.correction.method=none",
)


def arm_overrides(arm: str, overrides: list[str]) -> list[str]:
    """An arm's overrides: the sweep's, then (the on-policy arm) ON_POLICY's pins."""
    return [*overrides, *ON_POLICY] if arm == ON_POLICY_ARM else list(overrides)


@dataclasses.dataclass(frozen=True)
class Run:
    """One arm x seed: its run directory and the `cisjax train` argv that makes it."""

    arm: str
    seed: int
    run_dir: Path
    argv: list[str]

    def done(self, steps: int) -> bool:
        """Whether metrics.jsonl holds the run's last step (a finished run is not re-run)."""
        rows = read_rows(self.run_dir / "metrics.jsonl")
        return bool(rows) and rows[-1].get("step") == steps - 1

    def started(self) -> bool:
        """Whether it has a checkpoint to resume from (an interrupted run continues; nothing is redone)."""
        ckpt = self.run_dir / "checkpoints"
        return ckpt.is_dir() and any(p.name.isdigit() for p in ckpt.iterdir())


def plan_runs(config: str, arms: list[str], seeds: int, out: Path, overrides: list[str]) -> list[Run]:
    """Every arm x seed, seeds in the outer loop (a sweep cut short has every arm at the first seeds)."""
    runs = []
    for seed in range(seeds):
        for arm in arms:
            run_dir = out / arm.replace("+", "_") / f"seed{seed}"
            argv = [
                "train",
                "--config",
                f"{config}:{arm}",
                *arm_overrides(arm, overrides),
                f"--config.seed={seed}",
                f"--config.rollout.seed={seed}",
                f"--config.run.dir={run_dir}",
                "--config.run.progress=off",
            ]
            runs.append(Run(arm, seed, run_dir, argv))
    return runs


def check_arms(config: str, arms: list[str], overrides: list[str]) -> int:
    """Load and validate every arm's config before anything runs (a typo fails now, not after hours); its steps."""
    steps = None
    for arm in arms:
        cfg = config_lib.load(f"{config}:{arm}", arm_overrides(arm, overrides))
        validate.check(cfg)
        if cfg.run.steps <= 0:
            raise errors.UserError(f"{config}:{arm}: a sweep needs run.steps > 0 (every arm the same number of steps)")
        if steps is not None and cfg.run.steps != steps:
            raise errors.UserError(f"arm {arm}: run.steps={cfg.run.steps}, other arms {steps}: not comparable")
        steps = int(cfg.run.steps)
    return steps


def write_commands(runs: list[Run], path: Path) -> None:
    """A shell script of one `cisjax train` line per run, for a cluster."""
    lines = ["#!/bin/sh", "# cisjax sweep: one `cisjax train` run per arm x seed (independent: run them anywhere)"]
    lines += [shlex.join(["cisjax", *r.argv]) for r in runs]
    path.write_text("\n".join(lines) + "\n")


def run_all(runs: list[Run], steps: int) -> None:
    """Each run not finished before as a `cisjax train` child of this Python (output in its train.log), resumed
    where it has a checkpoint; UserError on the first that fails (the same sweep again continues)."""
    for i, r in enumerate(runs):
        if r.done(steps):
            print(f"[sweep] {i + 1}/{len(runs)} {r.arm} seed {r.seed}: done before, kept", flush=True)
            continue
        argv = [*r.argv, "--resume"] if r.started() else r.argv
        print(f"[sweep] {i + 1}/{len(runs)} {r.arm} seed {r.seed} -> {r.run_dir}", flush=True)
        r.run_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with open(r.run_dir / "train.log", "a") as log:
            code = subprocess.call([sys.executable, "-m", "cisjax", *argv], stdout=log, stderr=subprocess.STDOUT)
        print(f"[sweep]   exit {code} after {time.monotonic() - t0:.0f} s", flush=True)
        if code != 0:
            raise errors.UserError(
                f"{r.arm} seed {r.seed} failed (exit {code}): see {r.run_dir / 'train.log'}; run the same sweep "
                "command again to continue (finished runs are kept, interrupted ones resume)"
            )
