"""`cisjax mismatch measure --dump`: a training run's token dumps read as one measurement (no engine needed)."""

import argparse

import numpy as np
import pytest

from cisjax import errors
from cisjax.commands import mismatch as command
from cisjax.mismatch import records
from cisjax.train import metrics as metrics_lib


def _args(out, run_dir):
    p = argparse.ArgumentParser()
    command.add_args(p)
    return p.parse_args(["measure", "--out", str(out), "--dump", str(run_dir), "--no-progress"])


def test_dump_reader(tmp_path):
    run_dir = tmp_path / "run"
    rng = np.random.default_rng(0)
    for step in (2, 4, 6, 8, 10, 12):
        shape = (3, 10)
        infer = -rng.exponential(1.0, shape)
        metrics_lib.write_dump(
            run_dir,
            step,
            infer_logprobs=infer,
            prox_logprobs=infer + rng.normal(0, 0.01, shape),
            mask=rng.random(shape) < 0.7,
            weights=np.ones(shape),
            acted=np.zeros(shape, bool),
            token_versions=np.full(shape, step - 1),
            current_version=step,
            sample_tokens=8,
            seed=0,
        )
    args = _args(tmp_path / "out", run_dir)
    args.model = args.prompts = None
    assert command.run(args, []) == 0
    m = records.load(tmp_path / "out" / "train-dump")
    assert (
        m.meta["pair"] == "train-dump"
        and m.meta["side_p"] == "xla (proximal)"
        and m.meta["side_q"] == "vllm (sampling)"
    )
    assert m.n_tokens == 6 * 8 and m.meta["staleness_mean"] == 1.0
    np.testing.assert_array_equal(np.bincount(m.tokens["phase"]), [16, 16, 16])  # steps 2,4 | 6,8 | 10,12
    assert m.meta["phase_steps"] == {"early": [2, 4], "middle": [6, 8], "late": [10, 12]}
    z = np.load(run_dir / "dumps" / "step_0000002.npz")
    np.testing.assert_array_equal(m.tokens["logq"][:8], z["logp_infer"])
    np.testing.assert_array_equal(m.tokens["logp"][:8], np.minimum(z["logp_prox"], 0))
    assert m.tokens["seq_id"].max() < 6 * 3


def test_dump_alone_takes_no_overrides(tmp_path):
    with pytest.raises(errors.UserError, match="--dump alone takes no --config overrides"):
        command.run(_args(tmp_path / "out", tmp_path), ["--config.score.rows=2"])
