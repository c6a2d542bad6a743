"""`cisjax sweep`: run (or list the commands of) every arm x seed as its own `cisjax train` run, then summarise."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from cisjax import errors

__all__ = ["add_args", "run", "plan_runs", "Run"]


class Run:
    """One arm x seed: its run directory and the `cisjax train` argv that makes it."""

    def __init__(self, arm: str, seed: int, run_dir: Path, argv: list[str]):
        self.arm, self.seed, self.run_dir, self.argv = arm, seed, run_dir, argv

    def done(self, steps: int) -> bool:
        """Whether metrics.jsonl holds the run's last step (a finished run is not re-run)."""
        from cisjax.sweep.summary import read_rows

        rows = read_rows(self.run_dir / "metrics.jsonl")
        return bool(rows) and rows[-1].get("step") == steps - 1

    def started(self) -> bool:
        """Whether it has a checkpoint to resume from (an interrupted run continues; nothing is redone)."""
        ckpt = self.run_dir / "checkpoints"
        return ckpt.is_dir() and any(p.name.isdigit() for p in ckpt.iterdir())


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", required=True, help="an experiment file taking an arm: configs/FILE.py (get_config(arm))"
    )
    p.add_argument(
        "--arms", default="cis,tis,icepop,kpop,none", help="comma-separated arms (base.apply_arm: METHOD[+replay])"
    )
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per arm (config.seed and rollout.seed)")
    p.add_argument("--out", required=True, help="sweep directory: <arm>/seed<k>/ run directories, sweep.md, plots")
    p.add_argument(
        "--print-commands",
        action="store_true",
        help="write <out>/commands.sh (one `cisjax train` line per run, for a cluster) and stop; run the sweep again "
        "afterwards (or `--summary-only`) to summarise what the runs wrote",
    )
    p.add_argument("--summary-only", action="store_true", help="only summarise the run directories already there")
    p.add_argument(
        "--window", type=int, default=0, help="last N steps averaged as a run's final reward (0 = a quarter)"
    )


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
                *overrides,
                f"--config.seed={seed}",
                f"--config.rollout.seed={seed}",
                f"--config.run.dir={run_dir}",
                "--config.run.progress=off",
            ]
            runs.append(Run(arm, seed, run_dir, argv))
    return runs


def _check(config: str, arms: list[str], overrides: list[str]) -> int:
    """Load and validate every arm's config before anything runs (a typo fails now, not after hours); its steps."""
    from cisjax import config as config_lib
    from cisjax.train import validate

    steps = None
    for arm in arms:
        cfg = config_lib.load(f"{config}:{arm}", overrides)
        validate.check(cfg)
        if cfg.run.steps <= 0:
            raise errors.UserError(f"{config}:{arm}: a sweep needs run.steps > 0 (every arm the same number of steps)")
        if steps is not None and cfg.run.steps != steps:
            raise errors.UserError(f"arm {arm}: run.steps={cfg.run.steps}, other arms {steps}: not comparable")
        steps = int(cfg.run.steps)
    return steps


def run(args: argparse.Namespace, overrides: list[str] | None = None) -> int:
    from cisjax.sweep import summary

    overrides = list(overrides or [])
    bad = [o for o in overrides if o.split("=", 1)[0] in ("--config.seed", "--config.rollout.seed", "--config.run.dir")]
    if bad:
        raise errors.UserError(f"{bad[0]}: the sweep sets seeds and run directories itself")
    arms = [a for a in args.arms.split(",") if a]
    if not arms or len(set(arms)) != len(arms):
        raise errors.UserError(f"--arms {args.arms!r}: a comma-separated list of distinct arms")
    if args.seeds < 1:
        raise errors.UserError(f"--seeds {args.seeds}: at least 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    steps = _check(args.config, arms, overrides)
    runs = plan_runs(args.config, arms, args.seeds, out, overrides)
    (out / "sweep.json").write_text(
        json.dumps(
            {"config": args.config, "arms": arms, "seeds": args.seeds, "steps": steps, "overrides": overrides}, indent=1
        )
    )
    if args.print_commands:
        lines = ["#!/bin/sh", "# cisjax sweep: one `cisjax train` run per arm x seed (independent: run them anywhere)"]
        lines += [shlex.join(["cisjax", *r.argv]) for r in runs]
        (out / "commands.sh").write_text("\n".join(lines) + "\n")
        print(f"{len(runs)} runs: {out / 'commands.sh'}")
        return 0
    if not args.summary_only:
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
    written = summary.write(out, runs, steps, window=args.window)
    print(f"[sweep] {written}")
    return 0
