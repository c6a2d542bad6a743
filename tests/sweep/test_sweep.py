"""`cisjax sweep` end to end: two arms, one seed, a few steps each as real `cisjax train` runs, the summary, the
cluster command list, and a second invocation that resumes the runs instead of redoing them. The runs sample with the
JAX engine (rollout.backend=jax, which starts in half the time of vLLM's); tests/train/test_loop.py runs vLLM's."""

import subprocess

import pytest

from tests.support import processes, runs

pytestmark = pytest.mark.slow  # train runs


def _sweep(prepared, out, cache, *extra):
    cmd = [
        *processes.cisjax_command(),
        "sweep",
        "--config",
        str(runs.DEMO_CONFIG),
        "--arms",
        "cis,none",
        "--seeds",
        "1",
        "--out",
        str(out),
        f"--config.model.path={prepared / 'model'}",
        f"--config.data.source={prepared / 'data' / 'heldout.jsonl'}",
        "--config.data.prompts_per_step=8",
        "--config.rollout.group_size=4",
        "--config.rollout.max_new_tokens=12",
        "--config.rollout.backend=jax",
        "--config.rollout.dtype=float32",
        "--config.publish.dtype=float32",
        "--config.publish.canary.num_sequences=2",
        "--config.publish.canary.response_len=8",
        "--config.reward.workers=1",
        "--config.run.dump_every=0",
        "--config.run.tensorboard=false",
        "--config.checkpoint.every=0",
        "--config.eval.sets=gsm8k",  # the final weights on held-out problems the run never trained on
        f"--config.eval.data=gsm8k={prepared / 'data' / 'test.jsonl'}",
        "--config.eval.limit=4",
        "--config.eval.max_new_tokens=12",
        *extra,
    ]
    return subprocess.run(cmd, env=processes.subprocess_env(cache), capture_output=True, text=True, timeout=1500)


def test_two_arms_run_summarise_and_resume(prepared, jax_cache, tmp_path):
    out, cache = tmp_path / "sweep", jax_cache

    listed = _sweep(prepared, out, cache, "--config.run.steps=2", "--print-commands")
    assert listed.returncode == 0, listed.stderr
    lines = [x for x in (out / "commands.sh").read_text().splitlines() if x.startswith("cisjax train")]
    assert len(lines) == 2 and "demo_cpu.py:cis " in lines[0] and "demo_cpu.py:none " in lines[1]
    assert all("--config.seed=0" in x and "--config.rollout.seed=0" in x for x in lines)
    assert not (out / "cis").exists()  # listing runs nothing

    done = _sweep(prepared, out, cache, "--config.run.steps=2")
    assert done.returncode == 0, done.stdout + done.stderr
    first = {arm: runs.metrics(out / arm / "seed0") for arm in ("cis", "none")}
    assert {arm: [r["step"] for r in rows] for arm, rows in first.items()} == {"cis": [0, 1], "none": [0, 1]}
    md = (out / "sweep.md").read_text()
    assert "| cis | 1 (1) |" in md and "| none | 1 (1) |" in md and (out / "sweep.png").is_file()
    assert "held-out gsm8k" in md and "not evaluated" not in md  # every run's final evaluation is in the table
    for rows in first.values():
        assert 0.0 <= rows[-1]["eval/gsm8k/accuracy"] <= 1.0

    # a longer sweep over the same directory: the runs resume from their checkpoints, steps 0-1 are not redone
    more = _sweep(prepared, out, cache, "--config.run.steps=3")
    assert more.returncode == 0, more.stdout + more.stderr
    for arm, rows in first.items():
        now = runs.metrics(out / arm / "seed0")
        assert [r["step"] for r in now] == [0, 1, 2]
        assert now[:2] == rows
    again = _sweep(prepared, out, cache, "--config.run.steps=3")  # all finished: nothing runs
    assert again.returncode == 0 and again.stdout.count("done before, kept") == 2


def test_bad_arm_fails_before_anything_runs(tmp_path):
    out = tmp_path / "sweep"
    r = subprocess.run(
        [
            *processes.cisjax_command(),
            "sweep",
            "--config",
            str(runs.DEMO_CONFIG),
            "--arms",
            "cis,bogus",
            "--out",
            str(out),
            "--config.run.steps=2",
            "--config.model.path=/nonexistent",
            "--config.data.source=/nonexistent",
        ],
        env=processes.subprocess_env(tmp_path / "cache"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and "bogus" in r.stderr, r.stderr
    assert not (out / "cis").exists()


def test_a_token_override_is_refused_before_anything_is_written(tmp_path, capsys):
    from cisjax import cli

    out = tmp_path / "sweep"
    argv = ["sweep", "--config", str(runs.DEMO_CONFIG), "--arms", "cis", "--out", str(out)]
    assert cli.main([*argv, "--config.rollout.token=s3cret"]) == 2
    err = capsys.readouterr().err
    assert "CISJAX_ROLLOUT_TOKEN" in err and "s3cret" not in err
    assert not (out / "sweep.json").exists()
