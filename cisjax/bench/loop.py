"""`cisjax bench loop`: step time of the RL loop with rollouts ahead of training (async) vs synchronous, same config, one run."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from cisjax import config as config_lib
from cisjax import errors
from cisjax.bench import harness
from cisjax.train import loop

TARGET = 1.2  # async step time / max(rollout time, train time) once warmed up


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        default="demo_cpu",
        help="train config file or name; --config.x=y overrides apply to both modes (default: %(default)s)",
    )
    parser.add_argument("--steps", type=int, default=12, help="steps per mode (default: %(default)s)")
    parser.add_argument(
        "--skip",
        type=int,
        default=3,
        help="first steps of each mode left out of the statistics (compilation, first rollouts) (default: %(default)s)",
    )
    parser.add_argument(
        "--staleness", type=int, default=1, help="rollout.max_staleness of the async mode (default: %(default)s)"
    )
    parser.add_argument("--dir", default=None, help="run directories go here (default: a temporary directory, removed)")
    harness.add_json(parser)


def phase_times(rows: list[dict]) -> dict:
    """Medians over metrics.jsonl rows: the step, its rollout side (generate + reward of its batch) and its train side
    (rescore + update + publish; no rescore under train.proximal=step), and how long the trainer waited for rollouts."""
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    return {
        "step_s": med([r["time/step_s"] for r in rows]),
        "rollout_s": med([r["time/generate_s"] + r["time/reward_s"] for r in rows]),
        "train_s": med([r.get("time/rescore_s", 0.0) + r["time/train_s"] + r["time/publish_s"] for r in rows]),
        "wait_s": med([r["time/rollout_wait_s"] for r in rows]),
        "staleness_mean": med([r["staleness_mean"] for r in rows]),
        "steps": len(rows),
    }


def summarize(sync: dict, async_: dict) -> dict:
    """The async step against max(rollout, train) of the async run itself: the target's ratio (1 = the step costs no
    more than its slower phase; their sum is what no overlap costs). Also against the sync run's phases, which do not
    compete for the machine: above the target's ratio where the two phases share the same cores (CPU-only), since
    overlapping them then slows each down."""
    bound_sync = max(sync["rollout_s"], sync["train_s"])
    bound_async = max(async_["rollout_s"], async_["train_s"])
    ratio = async_["step_s"] / bound_async
    return {
        "sync": sync,
        "async": async_,
        "bound_sync_s": bound_sync,
        "bound_async_s": bound_async,
        "async_over_bound": ratio,
        "async_over_sync_bound": async_["step_s"] / bound_sync,
        "async_over_sync": async_["step_s"] / sync["step_s"],
        "target": TARGET,
        "meets_target": ratio <= TARGET,
    }


def run(args, overrides=()) -> int:
    if args.steps <= args.skip:
        raise errors.UserError(f"--steps ({args.steps}) must exceed --skip ({args.skip})")
    if args.staleness < 1:
        raise errors.UserError(f"--staleness={args.staleness}: the async mode needs >= 1")
    tmp = None if args.dir else tempfile.TemporaryDirectory(prefix="cisjax-bench-loop-")
    root = Path(args.dir or tmp.name)
    modes = {}
    try:
        for name, staleness in (("sync", 0), ("async", args.staleness)):
            run_dir = root / name
            cfg = config_lib.load(
                args.config,
                [
                    *overrides,
                    f"--config.rollout.max_staleness={staleness}",
                    f"--config.run.steps={args.steps}",
                    f"--config.run.dir={run_dir}",
                    "--config.run.progress=off",
                    "--config.checkpoint.every=0",
                ],
            )
            t0 = time.monotonic()
            loop.train(cfg)
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            modes[name] = dict(phase_times(rows[args.skip :]), wall_s=time.monotonic() - t0)
    finally:
        if tmp is not None:
            tmp.cleanup()
    res = summarize(modes["sync"], modes["async"])
    res.update(
        config=args.config, overrides=list(overrides), steps=args.steps, skip=args.skip, staleness=args.staleness
    )
    s, a = res["sync"], res["async"]
    print(
        f"\n{'mode':<6} {'step s':>7} {'rollout s':>9} {'train s':>8} {'wait s':>7}   (medians over steps {args.skip}..{args.steps - 1})"
    )
    for name, m in (("sync", s), ("async", a)):
        print(f"{name:<6} {m['step_s']:>7.2f} {m['rollout_s']:>9.2f} {m['train_s']:>8.2f} {m['wait_s']:>7.2f}")
    print(
        f"async step / max(rollout, train) of the async run = {a['step_s']:.2f} / {res['bound_async_s']:.2f} = "
        f"{res['async_over_bound']:.2f} (target <= {TARGET}: {'met' if res['meets_target'] else 'NOT met'}); "
        f"against the sync run's uncontended phases {a['step_s']:.2f} / {res['bound_sync_s']:.2f} = "
        f"{res['async_over_sync_bound']:.2f}; async / sync = {res['async_over_sync']:.2f}"
    )
    harness.write_json(args.json, res)
    return 0
