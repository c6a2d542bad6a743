"""`cisjax train` with rollout.colocated: the JAX sampler in the trainer's process on its mesh (8 fake CPU devices),
each step's params swapped in memory (the last step's alone exported), the canary and the in-loop evaluation through the loopback server."""

import logging
import os

import pytest

from cisjax import config as config_lib
from cisjax import errors
from cisjax.train import loop, validate
from tests.support import processes, runs

REPO = str(processes.REPO)


# the engine in fp32 as the trainer: the canary's bounds fail a stale engine; the in-loop evaluation at step 2
COLOCATED = (
    "--config.rollout.dtype=float32",
    "--config.publish.canary.num_sequences=2",
    "--config.publish.canary.response_len=8",
    "--config.publish.canary.mean_abs=1e-5",
    "--config.publish.canary.max_abs=1e-4",
    "--config.eval.sets=gsm8k",
    "--config.eval.every=2",
    "--config.eval.limit=4",
    "--config.eval.max_new_tokens=12",
)


@pytest.mark.slow
def test_colocated_run_publishes_in_memory(prepared, tmp_path, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="cisjax.engines.jax.engine")

    runs.score_by_parity(monkeypatch)
    run_dir = tmp_path / "run"
    eval_data = f"--config.eval.data=gsm8k={prepared / 'data' / 'heldout.jsonl'}"
    loop.train(runs.colocated_cfg(prepared, run_dir, *COLOCATED, eval_data))
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
