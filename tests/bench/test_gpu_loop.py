"""The GPU check's loop section: its learning verdict by hand and on a recorded run's metrics, a run's figures from
metrics.jsonl rows. (The section itself runs end to end in tests/bench/test_gpu_check.py's launcher call.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cisjax.bench import gpu_loop

RECORDED = Path(__file__).resolve().parents[1] / "fixtures" / "gpu_check" / "loop_colocated_cpu.jsonl"


def test_learning_by_hand():
    # first two 0.1 and 0.3 (mean 0.2), last two 0.4 and 0.4 (mean 0.4): a gain of 0.2 >= 0.1
    r = gpu_loop.learning([0.1, 0.3, 0.9, 0.0, 0.4, 0.4], window=2)
    assert r["first"] == pytest.approx(0.2) and r["last"] == pytest.approx(0.4) and r["met"] is True
    assert gpu_loop.learning([0.3, 0.3, 0.35, 0.35], window=2)["met"] is False  # 0.05 < 0.1
    assert gpu_loop.learning([0.3, 0.3, 0.35, 0.35], window=2, margin=0.04)["met"] is True
    short = gpu_loop.learning([0.1, 0.9, 0.9], window=2)  # fewer than two windows: no verdict
    assert short["met"] is None and short["first"] is None


def test_the_verdict_on_a_recorded_run():
    """The demo's 64 colocated steps on a CPU (the loop section's full-size command, recorded: the fixture's rows)
    learn; the same rows in reverse order, or with the later rewards held at the start's, do not."""
    rows = [json.loads(line) for line in RECORDED.read_text().splitlines()]
    rewards = [r["reward_mean"] for r in rows]
    assert len(rows) == gpu_loop.SIZES["full"]["steps"] == 64
    window = gpu_loop.SIZES["full"]["window"]
    assert gpu_loop.learning(rewards, window)["met"] is True
    assert gpu_loop.learning(rewards[::-1], window)["met"] is False
    flat = rewards[:window] * (len(rewards) // window)
    assert gpu_loop.learning(flat, window)["met"] is False


def test_summarize_reads_the_phases_canary_memory_and_evaluation():
    rows = [
        {"reward_mean": 0.1, "time/generate_s": 9.0, "time/step_s": 12.0, "publish/canary_mean_abs": 0.01},
        {"reward_mean": 0.2, "time/generate_s": 1.0, "time/step_s": 2.0, "publish/canary_mean_abs": 0.05},
        {"reward_mean": 0.3, "time/generate_s": 3.0, "time/step_s": 4.0, "device/peak_gib": 1.5},
        {"reward_mean": 0.6, "time/eval_s": 5.0, "eval/gsm8k/accuracy": 0.5, "device/peak_gib": 2.5},
    ]
    s = gpu_loop.summarize(rows, window=2)
    assert s["steps"] == 4 and s["rewards"] == [0.1, 0.2, 0.3, 0.6]
    assert s["learning"]["first"] == pytest.approx(0.15) and s["learning"]["met"] is True
    # the median over the steps after the first (which compiles), the first apart
    assert s["phases"]["generate"] == dict(first_s=9.0, median_s=2.0, total_s=13.0, n=3)
    assert s["phases"]["eval"]["median_s"] == 5.0 and "train" not in s["phases"]
    assert s["canary"] == dict(checked=2, mean_abs_max=0.05) and s["peak_gib"] == 2.5
    assert s["eval"] == {"eval/gsm8k/accuracy": 0.5}
    empty = gpu_loop.summarize([], window=2)
    assert empty["steps"] == 0 and empty["peak_gib"] is None and empty["canary"]["checked"] == 0


def test_a_stage_past_the_deadline_is_skipped_saying_so(tmp_path):
    saved = []
    out = gpu_loop.run("small", 0.0, saved.append, str(tmp_path))
    assert out["stages"]["prepare"]["status"] == "skipped" and "time box" in out["stages"]["prepare"]["reason"]
    assert list(out["stages"]) == ["prepare"] and saved
