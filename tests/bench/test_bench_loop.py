"""`cisjax bench loop`: the summary arithmetic by hand, and the command end to end on a tiny config (transformers engine)."""

import json
import subprocess

import pytest

from cisjax.bench import loop as bench_loop
from tests.support import processes, runs


def test_summary_against_hand_values():
    rows = [
        {
            "time/step_s": s,
            "time/generate_s": g,
            "time/reward_s": 0.5,
            "time/rescore_s": 0.25,
            "time/train_s": 0.5,
            "time/publish_s": 0.25,
            "time/rollout_wait_s": w,
            "staleness_mean": 1.0,
        }
        for s, g, w in ((3.0, 1.5, 0.0), (5.0, 2.5, 1.0), (4.0, 3.5, 2.0))
    ]
    t = bench_loop.phase_times(rows)
    assert t == {"step_s": 4.0, "rollout_s": 3.0, "train_s": 1.0, "wait_s": 1.0, "staleness_mean": 1.0, "steps": 3}
    sync = dict(t, step_s=4.0)
    res = bench_loop.summarize(sync, dict(t, step_s=3.3, train_s=3.0))  # async phases: max(3.0, 3.0) = 3.0
    assert res["bound_sync_s"] == 3.0 and res["bound_async_s"] == 3.0
    assert res["async_over_bound"] == pytest.approx(1.1) and res["meets_target"]
    assert res["async_over_sync"] == pytest.approx(3.3 / 4.0)
    assert not bench_loop.summarize(sync, dict(t, step_s=3.9))["meets_target"]  # 3.9 / 3.0 = 1.3 > 1.2
    contended = bench_loop.summarize(dict(t, train_s=1.0, rollout_s=2.0), dict(t, step_s=3.3, train_s=3.2))
    assert contended["meets_target"] and contended["async_over_bound"] == pytest.approx(3.3 / 3.2)
    assert contended["async_over_sync_bound"] == pytest.approx(3.3 / 2.0)  # reported, not the target's ratio
    # train.proximal=step: no rescoring pass, no time/rescore_s; the train side is the update and the publish
    own = [{k: v for k, v in r.items() if k != "time/rescore_s"} for r in rows]
    assert bench_loop.phase_times(own)["train_s"] == 0.75


@pytest.mark.slow  # not in the fast tier (make test-fast): two full loop runs
def test_bench_loop_tiny(prepared, jax_cache, tmp_path):
    out = tmp_path / "bench.json"
    argv = [
        "bench",
        "loop",
        "--steps",
        "3",
        "--skip",
        "1",
        "--json",
        str(out),
        "--dir",
        str(tmp_path / "runs"),
        f"--config.model.path={prepared / 'model'}",
        f"--config.data.source={prepared / 'data' / 'heldout.jsonl'}",
        "--config.rollout.backend=transformers",
        "--config.rollout.dtype=float32",
        "--config.publish.dtype=float32",
        "--config.data.prompts_per_step=8",
        "--config.rollout.group_size=2",
        "--config.rollout.max_new_tokens=8",
        "--config.publish.canary.num_sequences=2",
        "--config.publish.canary.response_len=8",
        "--config.reward.workers=1",
        "--config.run.tensorboard=false",
        "--config.run.dump_every=0",
    ]
    res = subprocess.run(
        [*processes.cisjax_command(), *argv],
        capture_output=True,
        text=True,
        timeout=900,
        env=processes.subprocess_env(jax_cache),
        cwd=str(processes.REPO),
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    assert "async step / max(rollout, train)" in res.stdout
    r = json.loads(out.read_text())
    for mode in ("sync", "async"):
        m = r[mode]
        assert m["steps"] == 2 and m["step_s"] > 0 and m["rollout_s"] > 0 and m["train_s"] > 0, m
        assert len(runs.metrics(tmp_path / "runs" / mode)) == 3
    assert r["sync"]["staleness_mean"] == 0.0  # synchronous: every token from the step's own weights
    assert r["bound_sync_s"] == max(r["sync"]["rollout_s"], r["sync"]["train_s"])
    assert r["bound_async_s"] == max(r["async"]["rollout_s"], r["async"]["train_s"])
    assert isinstance(r["meets_target"], bool) and r["target"] == 1.2
