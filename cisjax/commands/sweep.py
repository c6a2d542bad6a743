"""`cisjax sweep`: correction arms x seeds as train runs, then sweep.md + plots."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cisjax import config as config_lib
from cisjax import errors
from cisjax.sweep import runs as runs_lib
from cisjax.sweep import summary


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        required=True,
        help="an experiment file taking an arm (get_config(arm)): configs/FILE.py, or its name FILE",
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


def run(args: argparse.Namespace, overrides: list[str] | None = None) -> int:
    """Check every arm's config, record the sweep in sweep.json, then list the runs (--print-commands), or run those
    not finished and summarise them all."""
    overrides = list(overrides or [])
    bad = [o for o in overrides if o.split("=", 1)[0] in runs_lib.OWN_OVERRIDES]
    if bad:
        raise errors.UserError(f"{bad[0]}: the sweep sets seeds and run directories itself")
    if config_lib.secret_overrides(overrides):  # it would be saved in sweep.json and on each run's command line
        raise errors.UserError(
            "--config.rollout.token: a sweep writes its overrides into sweep.json and its runs' command lines; "
            "set $CISJAX_ROLLOUT_TOKEN instead (the runs inherit it)"
        )
    arms = [a for a in args.arms.split(",") if a]
    if not arms or len(set(arms)) != len(arms):
        raise errors.UserError(f"--arms {args.arms!r}: a comma-separated list of distinct arms")
    if args.seeds < 1:
        raise errors.UserError(f"--seeds {args.seeds}: at least 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    steps = runs_lib.check_arms(args.config, arms, overrides)
    runs = runs_lib.plan_runs(args.config, arms, args.seeds, out, overrides)
    (out / "sweep.json").write_text(
        json.dumps(
            {"config": args.config, "arms": arms, "seeds": args.seeds, "steps": steps, "overrides": overrides}, indent=1
        )
    )
    if args.print_commands:
        runs_lib.write_commands(runs, out / "commands.sh")
        print(f"{len(runs)} runs: {out / 'commands.sh'}")
        return 0
    if not args.summary_only:
        runs_lib.run_all(runs, steps)
    written = summary.write(out, runs, steps, window=args.window)
    print(f"[sweep] {written}")
    return 0
