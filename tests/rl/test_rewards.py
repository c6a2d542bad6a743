"""cisjax.rl.rewards: the process pool of math-verify judgements under hanging, killed, crashing and raising items."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from cisjax.answers import normalize_reference, verify
from cisjax.rl.rewards import RewardPool

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TIMEOUT_S = 2.0


def scripted(text: str, ref: str) -> float:
    """The pool's injected fn (module level, so a spawned worker can import it): "hang" never returns,
    "die" kills its worker, "raise" raises, "slow:<s>:<text>" sleeps s seconds then verifies <text>."""
    if text == "hang":
        time.sleep(3600)
    if text == "die":
        os._exit(3)
    if text == "raise":
        raise ValueError("scripted failure")
    if text.startswith("slow:"):
        _, seconds, text = text.split(":", 2)
        time.sleep(float(seconds))
    return verify(text, ref)


# ----------------------------------------------------------------------------- the pool


@pytest.fixture(scope="module")
def pool():
    # 2 s per item: far above a verify call (milliseconds) even on a loaded 2-core machine
    with RewardPool(workers=2, timeout_s=TIMEOUT_S, batch_deadline_s=30.0, fn=scripted) as p:
        yield p


def _gsm8k_refs():
    with open(FIXTURES / "gsm8k" / "train.jsonl") as f:
        return [normalize_reference(json.loads(line)["answer"]) for line in f]


def test_pool_scores_in_order(pool):
    refs = _gsm8k_refs()
    texts = [f"The answer is \\boxed{{{r}}}." if i % 2 == 0 else "\\boxed{-1}" for i, r in enumerate(refs)]
    assert pool.score(texts, refs) == [1.0 if i % 2 == 0 else 0.0 for i in range(len(refs))]
    assert pool.score([], []) == []


def test_pool_raising_item_scores_zero(pool):
    before = pool.metrics()
    assert pool.score(["raise", "\\boxed{1}"], ["1", "1"]) == [0.0, 1.0]
    assert pool.metrics()["errors"] - before["errors"] == 1
    assert pool.metrics()["restarts"] == before["restarts"]
    assert "scripted failure" in pool.last_error


def test_pool_rejects_bad_input(pool):
    with pytest.raises(ValueError, match="2 texts but 1 references"):
        pool.score(["a", "b"], ["1"])
    with pytest.raises(TypeError, match=r"refs\[1\] is int"):
        pool.score(["a", "b"], ["1", 2])


def test_pool_hanging_item_scores_zero_and_pool_recovers(pool):
    before = pool.metrics()
    t0 = time.monotonic()
    assert pool.score(["\\boxed{1}", "hang", "\\boxed{2}", "\\boxed{4}"], ["1", "2", "2", "3"]) == [1.0, 0.0, 1.0, 0.0]
    elapsed = time.monotonic() - t0
    assert elapsed < TIMEOUT_S + 3.0, elapsed  # the item timeout, not the hang
    after = pool.metrics()
    assert after["timed_out"] - before["timed_out"] == 1, (before, after)
    assert after["restarts"] - before["restarts"] == 1, (before, after)
    assert pool.score(["\\boxed{5}", "\\boxed{6}"], ["5", "7"]) == [1.0, 0.0]  # keeps working


def test_pool_killed_worker_is_replaced_and_its_item_rerun(pool):
    pid = pool.pids()[0]
    before = pool.metrics()
    killer = threading.Timer(0.3, os.kill, (pid, signal.SIGKILL))
    killer.start()
    scores = pool.score(["slow:0.6:\\boxed{3}", "slow:0.6:\\boxed{4}", "\\boxed{5}"], ["3", "4", "6"])
    killer.join()
    assert scores == [1.0, 1.0, 0.0]
    assert pid not in pool.pids()
    after = pool.metrics()
    assert after["restarts"] - before["restarts"] == 1
    assert after["crashed"] == before["crashed"] and after["timed_out"] == before["timed_out"]


def test_pool_item_that_crashes_every_worker_scores_zero(pool):
    before = pool.metrics()
    assert pool.score(["die", "\\boxed{1}"], ["1", "1"]) == [0.0, 1.0]
    after = pool.metrics()
    assert after["crashed"] - before["crashed"] == 1
    assert after["restarts"] - before["restarts"] == 2  # it ran twice, killing a worker each time


def test_pool_batch_deadline_bounds_the_call(pool):
    before = pool.metrics()
    t0 = time.monotonic()
    assert pool.score(["hang", "hang", "\\boxed{1}"], ["1", "1", "1"], deadline_s=0.5) == [0.0, 0.0, 0.0]
    elapsed = time.monotonic() - t0
    assert elapsed < TIMEOUT_S, elapsed  # the deadline, before the item timeout
    assert pool.metrics()["timed_out"] - before["timed_out"] == 3
    assert pool.score(["\\boxed{1}"], ["1"]) == [1.0]


def test_pool_rejects_unpicklable_fn():
    with pytest.raises(ValueError, match="module-level function"):
        RewardPool(workers=1, fn=lambda text, ref: 1.0)
    with pytest.raises(ValueError, match="module:function"):
        RewardPool(workers=1, fn="verify")


def test_pool_default_verify_and_close():
    pool = RewardPool(workers=1, timeout_s=5.0)
    with pool:
        assert pool.score(["\\boxed{\\frac{1}{2}}", "\\boxed{3}"], ["0.5", "4"]) == [1.0, 0.0]
    with pytest.raises(RuntimeError, match="closed"):
        pool.score(["\\boxed{1}"], ["1"])


def test_pool_names_an_fn_it_cannot_import():
    with pytest.raises(RuntimeError, match="no_such_module"):
        RewardPool(workers=1, fn="no_such_module:fn")


def test_pool_reports_how_each_item_ended(pool):
    outcomes = []
    scores = pool.score(
        ["hang", "raise", "die", "\\boxed{1}", "\\boxed{2}"], ["1", "1", "1", "1", "1"], outcomes=outcomes
    )
    assert scores == [0.0, 0.0, 0.0, 1.0, 0.0]
    assert outcomes == ["timeout", "error", "crashed", "ok", "ok"]
