"""cisjax.sweep.summary on hand-written metrics: final reward, spreads over seeds, cost against `none`, the markdown."""

import json
import math

from cisjax.sweep import runs as runs_lib
from cisjax.sweep import summary


def _run(tmp_path, arm, seed, rewards, train_s, acted=0.0, extra=None):
    run_dir = tmp_path / arm / f"seed{seed}"
    run_dir.mkdir(parents=True)
    rows = []
    for step, r in enumerate(rewards):
        row = {"step": step, "reward/mean": r, "time/train_s": train_s[step], "time/step_s": 2 * train_s[step]}
        row.update({"train/acted_frac": acted, "train/abs_logk_mean": 0.01, "train/grad_norm": 1.0})
        row.update((extra or {}).get(step, {}))
        rows.append(json.dumps(row))
    (run_dir / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    return runs_lib.Run(arm, seed, run_dir, [])


def test_arm_table_by_hand(tmp_path):
    runs = [
        # window 2 (4 steps // 4 = 1 -> given 2): the last two rewards; train s skips step 0 (compile)
        _run(tmp_path, "cis", 0, [0.0, 0.1, 0.4, 0.6], [9.0, 1.0, 1.2, 1.1], acted=0.01),
        _run(tmp_path, "cis", 1, [0.0, 0.2, 0.6, 0.8], [9.0, 1.3, 1.1, 1.2], acted=0.03),
        _run(tmp_path, "none", 0, [0.0, 0.1, 0.2, 0.2], [9.0, 1.0, 1.0, 1.0], extra={3: {"eval/gsm8k/accuracy": 0.25}}),
    ]
    t = summary.arm_table(runs, steps=4, window=2)
    assert t["cis"]["final_reward_per_seed"] == [0.5, 0.7]
    f = t["cis"]["final_reward"]
    assert math.isclose(f["mean"], 0.6) and math.isclose(f["sd"], math.sqrt(0.02)) and f["n"] == 2
    assert (f["min"], f["max"]) == (0.5, 0.7)
    assert math.isclose(t["cis"]["train s"]["mean"], (1.1 + 1.2) / 2)  # medians 1.1 and 1.2 over steps 1-3
    assert math.isclose(t["cis"]["acted frac"]["mean"], 0.02)
    assert all(math.isclose(a, b) for a, b in zip(t["cis"]["curve"]["mean"], [0.0, 0.15, 0.5, 0.7]))
    assert t["cis"]["curve"]["min"] == [0.0, 0.1, 0.4, 0.6]
    assert t["none"]["held_out"]["gsm8k"]["mean"] == 0.25 and t["cis"]["held_out"] == {}
    assert t["none"]["complete"] == 1


def test_markdown_and_plot(tmp_path):
    runs = [
        _run(tmp_path, "cis", 0, [0.0, 0.5], [5.0, 1.1], extra={1: {"eval/gsm8k/accuracy": 0.75}}),
        _run(tmp_path, "cis", 1, [0.0, 0.5], [5.0, 1.1], extra={1: {"eval/gsm8k/accuracy": 0.25}}),
        _run(tmp_path, "none", 0, [0.0, 0.2], [5.0, 1.0]),
        runs_lib.Run("tis", 0, tmp_path / "tis" / "seed0", []),  # not run yet
    ]
    # the held-out reward: a correct \\boxed{} answer only (seed 0: 1 of 4; seed 1: 2 of 2); the latest version counts
    samples = {
        0: [("boxed", True), ("answer_is", True), ("boxed", False), ("last_number", True)],
        1: [("boxed", True), ("boxed", True)],
    }
    for seed, rows in samples.items():
        for v, these in ((1, rows), (0, [("boxed", False)])):
            d = tmp_path / "cis" / f"seed{seed}" / "eval" / f"v{v:06d}"
            d.mkdir(parents=True)
            text = "".join(json.dumps({"set": "gsm8k", "rule": r, "correct": c}) + "\n" for r, c in these)
            (d / "samples.jsonl").write_text(text)
    (tmp_path / "sweep.json").write_text(json.dumps({"config": "c.py", "arms": ["cis", "none", "tis"], "seeds": 1}))
    md = summary.write(tmp_path, runs, steps=2, window=1).read_text()
    # held-out accuracy: sd of (0.75, 0.25); held-out reward: 0.25 and 1.0, sd 0.53
    assert "| cis | 2 (2) | 0.5 ± 0 (0.5–0.5) | 0.5 ± 0.35 (0.25–0.75) | 0.625 ± 0.53 (0.25–1) |" in md
    assert "| none | 1 (1) | 0.2 | — | — |" in md and "| 1.100 |" in md  # not evaluated; cost: 1.1 / 1.0
    assert "- tis: no runs yet" in md
    assert "- cis: seed 0: 0.750, seed 1: 0.250\n- none: not evaluated" in md
    assert (tmp_path / "sweep.png").stat().st_size > 0
    assert json.loads((tmp_path / "sweep_summary.json").read_text())["none"]["final_reward"]["mean"] == 0.2


def test_crashed_last_line_keeps_the_rows_before(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 0, "reward/mean": 0.1}\n{"step": 1, "rew')
    assert summary.read_rows(p) == [{"step": 0, "reward/mean": 0.1}]


def test_trailing_mean_by_hand():
    import numpy as np

    x = np.array([1.0, 3.0, np.nan, 5.0])
    np.testing.assert_allclose(summary._trailing(x, 2), [1.0, 2.0, 3.0, 5.0])
