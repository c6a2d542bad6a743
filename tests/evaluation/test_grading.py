"""cisjax.evaluation.grading: hand-written cases of each benchmark graded through a real math-verify pool; a grader
that hangs (wrong, not a crash), one that raises, a gold answer math-verify cannot read."""

import time

import pytest

from cisjax.evaluation.grading import POOL_FN, Grade, grade_all, grade_locally, math_verify_equal
from cisjax.rl.rewards import RewardPool
from tests.evaluation.cases import BY_SET

TIMEOUT_S = 2.0


def hangs_on_marker(answer: str, gold: str) -> float:
    """The pool's fn in the hang test (module level: a spawned worker imports it): "HANG" never returns, "RAISE"
    raises, anything else is graded as cisjax eval grades it."""
    if answer == "HANG":
        time.sleep(3600)
    if answer == "RAISE":
        raise ValueError("scripted failure")
    return math_verify_equal(answer, gold)


@pytest.fixture(scope="module")
def pool():
    with RewardPool(workers=2, timeout_s=10.0, batch_deadline_s=120.0, fn=POOL_FN) as p:
        yield p


@pytest.mark.parametrize("name", list(BY_SET))
def test_grades_by_hand(pool, name):
    from cisjax.evaluation.answers import extract

    cases, numeric = BY_SET[name]
    answers = [extract(response).answer for response, *_ in cases]
    grades = grade_all(answers, [gold for _, gold, *_ in cases], [numeric] * len(cases), pool)
    expected = [Grade(correct, method) for *_, correct, method in cases]
    wrong = [(case[0], case[1], got, want) for case, got, want in zip(cases, grades, expected) if got != want]
    assert not wrong, wrong
    assert pool.metrics()["timed_out"] == 0 and pool.metrics()["errors"] == 0


@pytest.mark.parametrize(
    "answer, gold, numeric, expected",
    [
        (None, "1", True, Grade(False, "no_answer")),
        ("  ", "1", False, Grade(False, "no_answer")),
        ("$\\frac{1}{2}$", "\\dfrac{1}{2}", False, Grade(True, "exact")),
        ("7", "7", False, Grade(True, "exact")),
        ("8", "7", True, Grade(False, "numeric")),
        ("8", "7", False, None),
        ("\\frac{14}{2}", "7", True, None),
    ],
)
def test_grade_locally(answer, gold, numeric, expected):
    assert grade_locally(answer, gold, numeric=numeric) == expected


def test_a_hanging_grader_grades_wrong_and_the_rest_go_on():
    with RewardPool(workers=2, timeout_s=TIMEOUT_S, batch_deadline_s=60.0, fn=f"{__name__}:hangs_on_marker") as pool:
        t0 = time.monotonic()
        grades = grade_all(
            ["HANG", "\\frac{2}{4}", "RAISE", "\\frac{1}{3}", "5"], ["1", "0.5", "1", "0.5", "5"], [False] * 5, pool
        )
        elapsed = time.monotonic() - t0
        assert grades == [
            Grade(False, "timeout"),
            Grade(True, "math_verify"),
            Grade(False, "error"),
            Grade(False, "math_verify"),
            Grade(True, "exact"),
        ]
        assert elapsed < TIMEOUT_S + 5.0, elapsed  # the hard timeout, not the hang
        assert pool.metrics()["timed_out"] == 1 and pool.metrics()["errors"] == 1
        assert grade_all(["\\frac{3}{6}"], ["0.5"], [False], pool) == [Grade(True, "math_verify")]  # the pool lives on


def test_a_gold_answer_math_verify_cannot_read_is_an_error_not_a_pass(pool):
    # "\\text{}" reads as nothing: there is no gold answer to compare with
    assert grade_all(["\\frac{1}{2}"], ["\\text{}"], [False], pool) == [Grade(False, "error")]


def test_grade_all_checks_lengths(pool):
    with pytest.raises(ValueError, match="2 answers, 1 golds"):
        grade_all(["1", "2"], ["1"], [True, True], pool)
