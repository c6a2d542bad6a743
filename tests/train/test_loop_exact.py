"""`cisjax train` with rollout.exact: the colocated sampler on the exact path, so every sampled token's q is the train
step's p bit for bit (train/exact_frac = 1, every correction weight 1), and the configs it cannot serve refused."""

import os

import pytest

from cisjax import config as config_lib
from cisjax import errors
from cisjax.train import loop, validate
from tests.support import processes, runs

REPO = str(processes.REPO)


# the exact sampler holds the trainer's own weights: no canary to read between them
EXACT = ("--config.rollout.exact=True", "--config.publish.canary.every=0")


@pytest.mark.parametrize("extra", [(), ("--config.train.precision=bf16", "--config.rollout.top_k=20")])
def test_exact_run_samples_q_equal_to_p(prepared, tmp_path, monkeypatch, extra):
    runs.score_by_parity(monkeypatch)
    run_dir = tmp_path / "run"
    loop.train(runs.colocated_cfg(prepared, run_dir, *EXACT, *extra))
    rows = runs.metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["train/grad_norm"] > 0 and r["train/tokens"] > 0
        # every response token's p, inside the step, equals the sampler's q to the last bit: k = 1 everywhere
        assert r["train/exact_frac"] == 1.0
        assert r["train/abs_logk_max"] == 0.0 and r["train/acted_frac"] == 0.0 and r["train/weight_max"] == 1.0


def test_exact_config_is_checked():
    cfg = config_lib.load(
        os.path.join(REPO, "configs", "demo_cpu.py"),
        [
            "--config.rollout.exact=True",
            "--config.routing.replay=rollout",
            "--config.rollout.perturb=int8",
            "--config.train.precision=fp16",
            "--config.mesh.tensor=2",
        ],
    )
    with pytest.raises(errors.UserError) as err:
        validate.check(cfg, inputs=False)
    text = str(err.value)
    for what in (
        "needs rollout.colocated=True",
        "routing.replay='rollout'",
        "rollout.perturb",
        "precision='fp16'",
        "mesh.tensor",
    ):
        assert what in text, text
