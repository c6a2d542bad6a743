"""The demo's synthetic task: deterministic, disjoint splits that keep a + b and b + a together, GSM8K-readable."""

import pytest

from cisjax import errors
from cisjax.data import load_problems
from cisjax.demo import task


def test_task_deterministic_and_disjoint(tmp_path):
    train, held = task.make_task(seed=3, heldout=300)
    assert (train, held) == task.make_task(seed=3, heldout=300)
    assert held != task.make_task(seed=4, heldout=300)[1]
    assert 300 <= len(held) <= 301  # whole groups: a + b and b + a together
    questions = {r["question"] for r in train}
    assert len(questions) == len(train) and not questions & {r["question"] for r in held}
    assert len(train) + len(held) == 90 * 90 + 90 * 91 // 2  # every addition, every subtraction with a >= b
    for r in held:
        a, op, b = r["question"][len("What is ") : -1].split()
        assert f"What is {b} {op} {a}?" not in questions
        assert int(r["answer"].rsplit("#### ", 1)[1]) == task.solve(int(a), op, int(b)) >= 0
    task.write_jsonl(tmp_path / "heldout.jsonl", held)
    problems = load_problems(tmp_path, "heldout")
    assert [p.question for p in problems] == [r["question"] for r in held]
    assert problems[0].answer == held[0]["answer"].rsplit("#### ", 1)[1]


def test_heldout_split_into_rl_and_test_by_groups():
    _, held = task.make_task(seed=3, heldout=300)
    rl, test = task.split_heldout(seed=3, heldout=300, test=80)
    assert (rl, test) == task.split_heldout(seed=3, heldout=300, test=80)
    assert 80 <= len(test) <= 81 and len(rl) + len(test) == len(held)
    # both parts keep the held-out file's order, and together they are it
    order = {r["question"]: i for i, r in enumerate(held)}
    assert [order[r["question"]] for r in rl] == sorted(order[r["question"]] for r in rl)
    assert sorted(rl + test, key=lambda r: order[r["question"]]) == held
    rl_q = {r["question"] for r in rl}
    for r in test:  # a test problem's commuted twin is not trained on
        a, op, b = r["question"][len("What is ") : -1].split()
        assert r["question"] not in rl_q and f"What is {b} {op} {a}?" not in rl_q
    with pytest.raises(errors.UserError, match="test=300"):
        task.split_heldout(seed=3, heldout=300, test=300)
