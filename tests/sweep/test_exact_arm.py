"""The sweep's on-policy arm `exact`: its config (the colocated exact sampler, unperturbed whatever the sweep's
overrides), its place in the run list, and the summary's recovery columns on hand-written metrics."""

import importlib.util
import json
import math
import subprocess

import pytest

from cisjax import cli
from cisjax import config as config_lib
from cisjax.sweep import runs as runs_lib
from cisjax.sweep import summary
from cisjax.train import validate
from tests.support import processes, runs

SWEEP_CONFIG = runs.REPO / "configs" / "demo_sweep.py"
NOISE = ["--config.rollout.perturb=noise", "--config.rollout.perturb_scale=0.05", "--config.rollout.max_staleness=2"]


def _base():
    spec = importlib.util.spec_from_file_location("cisjax_test_base", runs.REPO / "configs" / "base.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_exact_arm_is_on_policy_whatever_the_overrides():
    cfg = config_lib.load(f"{SWEEP_CONFIG}:exact", runs_lib.arm_overrides("exact", NOISE))
    validate.check(cfg)
    assert (cfg.rollout.backend, cfg.rollout.colocated, cfg.rollout.exact) == ("jax", True, True)
    r = cfg.rollout
    assert (r.perturb, r.perturb_scale, r.lag, r.max_staleness) == ("none", 0, 0, 0)
    assert (cfg.routing.replay, cfg.correction.method) == ("none", "none")
    other = config_lib.load(f"{SWEEP_CONFIG}:cis", runs_lib.arm_overrides("cis", NOISE))
    assert (other.rollout.perturb, other.rollout.exact, other.correction.method) == ("noise", False, "cis")
    alone = config_lib.load(f"{SWEEP_CONFIG}:exact")  # `cisjax train --config demo_sweep.py:exact`: not int4
    validate.check(alone)
    assert alone.rollout.perturb == "none" and alone.rollout.exact


def test_the_sweeps_pins_are_base_on_policy():
    base = _base()
    pins = dict(p.removeprefix("--config.").split("=", 1) for p in runs_lib.ON_POLICY)
    assert base.ON_POLICY_ARM == runs_lib.ON_POLICY_ARM == summary.ON_POLICY_ARM == "exact"
    assert pins.keys() == base.ON_POLICY.keys()
    for path, text in pins.items():
        assert config_lib._parse_value(text, base.ON_POLICY[path]) == base.ON_POLICY[path], path


def test_the_command_list_has_the_exact_arm_with_its_pins_last(tmp_path):
    out = tmp_path / "sweep"
    argv = ["sweep", "--config", str(SWEEP_CONFIG), "--arms", "cis,none,exact", "--seeds", "2", "--out", str(out)]
    assert cli.main([*argv, "--print-commands", "--config.run.steps=2", *NOISE]) == 0
    lines = [x for x in (out / "commands.sh").read_text().splitlines() if x.startswith("cisjax train")]
    assert len(lines) == 6 and sum("demo_sweep.py:exact " in x for x in lines) == 2
    exact = next(x for x in lines if "demo_sweep.py:exact " in x)
    assert exact.index("--config.rollout.perturb=noise") < exact.index("--config.rollout.perturb=none")
    assert "--config.rollout.exact=true" in exact and f"--config.run.dir={out / 'exact' / 'seed0'}" in exact
    assert all("--config.rollout.exact=true" not in x for x in lines if "demo_sweep.py:exact " not in x)
    assert json.loads((out / "sweep.json").read_text())["arms"] == ["cis", "none", "exact"]


def _run(tmp_path, arm, seed, accuracy):
    run_dir = tmp_path / arm / f"seed{seed}"
    run_dir.mkdir(parents=True)
    rows = [{"step": 0, "reward/mean": 0.1}, {"step": 1, "reward/mean": 0.2, "eval/gsm8k/accuracy": accuracy}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return runs_lib.Run(arm, seed, run_dir, [])


def test_recovery_by_hand(tmp_path):
    # seed means: exact 0.5, none 0.3, cis (0.4 + 0.5) / 2 = 0.45, tis 0.3
    table = summary.arm_table(
        [
            _run(tmp_path, "exact", 0, 0.5),
            _run(tmp_path, "none", 0, 0.3),
            _run(tmp_path, "cis", 0, 0.4),
            _run(tmp_path, "cis", 1, 0.5),
            _run(tmp_path, "tis", 0, 0.3),
        ],
        steps=2,
    )
    r = summary.recovery(table, "gsm8k")
    assert math.isclose(r["cis"]["of exact"], 0.9) and math.isclose(r["cis"]["gap closed"], 0.75)
    assert math.isclose(r["tis"]["of exact"], 0.6) and r["tis"]["gap closed"] == 0.0
    assert r["exact"] == {"of exact": 1.0, "gap closed": 1.0} and r["none"]["gap closed"] == 0.0


def test_recovery_without_a_none_arm_or_an_exact_arm(tmp_path):
    table = summary.arm_table([_run(tmp_path, "exact", 0, 0.5), _run(tmp_path, "cis", 0, 0.4)], steps=2)
    r = summary.recovery(table, "gsm8k")
    assert math.isclose(r["cis"]["of exact"], 0.8) and math.isnan(r["cis"]["gap closed"])
    assert summary.recovery(summary.arm_table([_run(tmp_path / "b", "cis", 0, 0.4)], steps=2), "gsm8k") == {}


def test_the_markdown_has_the_recovery_columns(tmp_path):
    runs_ = [_run(tmp_path, "exact", 0, 0.5), _run(tmp_path, "none", 0, 0.25), _run(tmp_path, "cis", 0, 0.4)]
    md = summary.write(tmp_path, runs_, steps=2, window=1).read_text()
    assert "| gsm8k of exact | gsm8k gap closed |" in md
    assert "| cis | 1 (1) | 0.2 | 0.4 | — | 0.800 | 0.600 |" in md  # 0.4 / 0.5; 0.15 / 0.25
    assert "| none | 1 (1) | 0.2 | 0.25 | — | 0.500 | 0.000 |" in md
    saved = json.loads((tmp_path / "sweep_summary.json").read_text())
    assert math.isclose(saved["cis"]["recovery"]["gsm8k"]["gap closed"], 0.6)


@pytest.mark.slow  # two train runs
def test_a_sweep_with_the_exact_arm_runs_it_on_policy(prepared, jax_cache, tmp_path):
    """`cisjax sweep --arms none,exact` with the engine perturbed by noise for the sweep: the none run's engine serves
    the noisy copy, the exact run samples with q == p on every token (train/exact_frac 1, no staleness, no
    perturbation), and sweep.md has the recovery columns."""
    out = tmp_path / "sweep"
    cmd = [*processes.cisjax_command(), "sweep", "--config", str(runs.DEMO_CONFIG), "--arms", "none,exact"]
    cmd += ["--seeds", "1", "--out", str(out), f"--config.model.path={prepared / 'model'}"]
    cmd += [f"--config.data.source={prepared / 'data' / 'heldout.jsonl'}", "--config.data.prompts_per_step=4"]
    cmd += ["--config.rollout.group_size=4", "--config.rollout.max_new_tokens=8", "--config.rollout.backend=jax"]
    cmd += ["--config.rollout.dtype=float32", "--config.publish.dtype=float32", "--config.publish.canary.every=0"]
    cmd += ["--config.reward.workers=1", "--config.run.dump_every=0", "--config.run.tensorboard=false"]
    cmd += ["--config.checkpoint.every=0", "--config.eval.sets=gsm8k", "--config.eval.limit=4"]
    cmd += [f"--config.eval.data=gsm8k={prepared / 'data' / 'test.jsonl'}", "--config.eval.max_new_tokens=8"]
    cmd += ["--config.run.steps=2", *NOISE]
    done = subprocess.run(cmd, env=processes.subprocess_env(jax_cache), capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout + done.stderr
    none, exact = (runs.metrics(out / arm / "seed0") for arm in ("none", "exact"))
    assert [r["step"] for r in exact] == [0, 1] and all(r["train/exact_frac"] == 1.0 for r in exact)
    assert all(r["rollout/staleness_mean"] == 0 and not r.get("publish/perturb_rel_rms") for r in exact)
    assert all(r["publish/perturb_rel_rms"] > 0 for r in none[:1]) and none[0]["train/exact_frac"] < 1.0
    assert "gsm8k gap closed" in (out / "sweep.md").read_text()
