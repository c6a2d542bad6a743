"""`cisjax train` with rollout.colocated: the JAX sampler in the trainer's process on its mesh (8 fake CPU devices),
each step's params swapped in memory (the last step's alone exported), the canary and the in-loop evaluation through the loopback server."""

import logging
import os

import pytest

from cisjax import config as config_lib
from cisjax import errors
from cisjax.rl import rewards
from cisjax.train import loop, services, validate
from tests.support import processes, runs

REPO = str(processes.REPO)


def _cfg(prepared, run_dir, *extra):
    return config_lib.load(
        os.path.join(REPO, "configs", "demo_cpu.py"),
        [
            f"--config.model.path={prepared / 'model'}",
            f"--config.data.source={prepared / 'data' / 'heldout.jsonl'}",
            f"--config.run.dir={run_dir}",
            "--config.run.progress=off",
            "--config.run.steps=3",
            "--config.data.prompts_per_step=4",
            "--config.rollout.group_size=4",
            "--config.rollout.max_new_tokens=12",
            "--config.rollout.backend=jax",
            "--config.rollout.colocated=True",
            "--config.rollout.dtype=float32",
            "--config.rollout.max_staleness=0",  # every sample from the step's own weights
            "--config.rollout.seed=3",
            "--config.publish.canary.num_sequences=2",
            "--config.publish.canary.response_len=8",
            "--config.publish.canary.mean_abs=1e-5",
            "--config.publish.canary.max_abs=1e-4",
            "--config.checkpoint.every=0",
            "--config.reward.workers=1",
            "--config.eval.sets=gsm8k",
            f"--config.eval.data=gsm8k={prepared / 'data' / 'heldout.jsonl'}",
            "--config.eval.every=2",
            "--config.eval.limit=4",
            "--config.eval.max_new_tokens=12",
            *extra,
        ],
    )


@pytest.mark.slow
def test_colocated_run_publishes_in_memory(prepared, tmp_path, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="cisjax.engines.jax.engine")

    class Pool(rewards.RewardPool):  # rewards that vary: the params change at every step
        def __init__(self, *args, **kwargs):
            super().__init__(*args, fn="tests.support.runs:parity_reward", **kwargs)

    monkeypatch.setattr(services, "RewardPool", Pool)
    run_dir = tmp_path / "run"
    loop.train(_cfg(prepared, run_dir))
    rows = runs.metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    # swapped in memory; the last step alone exported (the trained model)
    assert sorted(p.name for p in (run_dir / "exports").iterdir()) == ["LATEST", "v000003"]
    assert rows[-1]["publish/export_s"] > 0.01 > rows[0]["publish/export_s"]
    for r in rows:
        assert r["publish/version"] == r["step"] + 1 and r["publish/bytes"] == 0 and r["train/grad_norm"] > 0
        # the engine serves the trainer's params: fp32 on both sides, the same kernels (the bound fails a stale engine)
        assert r["publish/canary_max_abs"] <= 1e-4
        # synchronous: q sampled by the engine from the weights p is computed with
        assert r["rollout/staleness_mean"] == 0 and r["train/abs_logk_max"] < 1e-3
    assert rows[1]["eval/version"] == 2 and rows[1]["eval/gsm8k/count"] == 4  # the in-loop eval, on version 2
    compiled = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiling sampler program")]
    print(compiled)


def test_colocated_config_is_checked():
    cfg = config_lib.load(
        os.path.join(REPO, "configs", "demo_cpu.py"),
        [
            "--config.rollout.colocated=True",
            "--config.rollout.backend=vllm",
            "--config.rollout.replicas=2",
            "--config.publish.delta=True",
        ],
    )
    with pytest.raises(errors.UserError) as err:
        validate.check(cfg, inputs=False)
    text = str(err.value)
    for what in ("the colocated engine is jax", "rollout.replicas=2", "publish.delta"):
        assert what in text, text
