"""`cisjax train` runs in tests: a config's validated spec, the demo's data and model, a run's metrics, a run started
until its first step; `python -m tests.support.runs train ARGS` runs `cisjax` with a reward that always scores."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.support.processes import REPO, Tree, start, wait_for

DEMO_CONFIG = REPO / "configs" / "demo_cpu.py"


def spec_of(cfg):
    """The typed sections (cisjax.train.spec.TrainSpec) of a train config, validated without its inputs."""
    from cisjax.train import validate

    return validate.check(cfg, inputs=False)


def prepare(out) -> Path:
    """The demo's task and tiny MoE, not warmed up (fast): 64 held-out problems in `out/data`, the model in `out/model`."""
    from cisjax import demo

    out = Path(out)
    assert demo.prepare(out, seed=0, warmup_steps=0, heldout=64, eval_size=0, log=lambda *_: None) == 0
    return out


def metrics(run_dir) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def reference_reward(text: str, reference: str) -> float:
    """A reward fn for the pool that math-verify judges 1.0 whatever the (untrained) model wrote: the reference
    against itself. A run scored with it has reward_mean 1 on every step unless the pool lost a score."""
    from cisjax.answers import verify

    return verify(f"\\boxed{{{reference}}}", reference)


def parity_reward(text: str, reference: str) -> float:
    """A reward fn that varies within a group whatever the (untrained) model wrote: 1.0 for a text of even length.
    A run scored with it updates its params at every step (GRPO's advantages are not all zero)."""
    return float(len(text) % 2 == 0)


def colocated_cfg(prepared, run_dir, *extra):
    """The demo config for a short colocated run on `prepared` (prepare's folder): 3 steps of 4 prompts x 4 samples,
    12 new tokens, the JAX sampler in the trainer's process, every sample from the step's own weights; `extra`
    overrides after these."""
    from cisjax import config as config_lib

    return config_lib.load(
        str(DEMO_CONFIG),
        [
            f"--config.model.path={Path(prepared) / 'model'}",
            f"--config.data.source={Path(prepared) / 'data' / 'heldout.jsonl'}",
            f"--config.run.dir={run_dir}",
            "--config.run.progress=off",
            "--config.run.steps=3",
            "--config.data.prompts_per_step=4",
            "--config.rollout.group_size=4",
            "--config.rollout.max_new_tokens=12",
            "--config.rollout.backend=jax",
            "--config.rollout.colocated=True",
            "--config.rollout.max_staleness=0",  # every sample from the step's own weights
            "--config.rollout.seed=3",
            "--config.checkpoint.every=0",
            "--config.reward.workers=1",
            *extra,
        ],
    )


def score_by_parity(monkeypatch) -> None:
    """The train loop's reward pool scores with parity_reward (rewards that vary: the params change at every step)."""
    from cisjax.rl import rewards
    from cisjax.train import services

    class Pool(rewards.RewardPool):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, fn="tests.support.runs:parity_reward", **kwargs)

    monkeypatch.setattr(services, "RewardPool", Pool)


def start_until_first_step(
    argv: list[str], run_dir, log_path, env: dict, timeout_s: float = 300
) -> tuple[subprocess.Popen, Tree]:
    """start(argv) and wait until the run's metrics.jsonl has a step: (the process, its Tree); the process group is
    killed when the wait fails."""
    proc = start(argv, log_path, env)
    tree = Tree(proc.pid)
    try:
        wait_for(
            proc, lambda: metrics(run_dir), timeout_s=timeout_s, tree=tree, what="the first step", log_path=log_path
        )
    except BaseException:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc, tree


def main(argv: list[str]) -> int:
    """`python -m tests.support.runs train ARGS`: `cisjax ARGS` with the reward pool scoring with
    reference_reward (the rest of the loop unchanged)."""
    from cisjax import cli
    from cisjax.rl import rewards

    class Pool(rewards.RewardPool):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("fn", f"{__spec__.name}:reference_reward")
            super().__init__(*args, **kwargs)

    rewards.RewardPool = Pool
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
