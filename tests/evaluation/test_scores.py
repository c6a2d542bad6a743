"""cisjax.evaluation.scores: the unbiased pass@k estimator and avg@k against hand-computed values; a set's summary."""

import math

import pytest

from cisjax.evaluation.scores import average, avg_at_k, ks_for, pass_at_k, summarize


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (1, 1, 1, 1.0),
        (1, 0, 1, 0.0),
        (4, 1, 1, 1 / 4),  # pass@1 = c / n
        (5, 2, 2, 7 / 10),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (10, 3, 5, 11 / 12),  # 1 - C(7,5)/C(10,5) = 1 - 21/252
        (4, 2, 3, 1.0),  # C(2,3) = 0: every 3 of the 4 hold a correct one
        (10, 0, 10, 0.0),
        (3, 3, 2, 1.0),
        (8, 1, 4, 1 / 2),  # 1 - C(7,4)/C(8,4) = 1 - 35/70
        (16, 4, 2, 9 / 20),  # 1 - C(12,2)/C(16,2) = 1 - 66/120
    ],
)
def test_pass_at_k(n, c, k, expected):
    assert math.isclose(pass_at_k(n, c, k), expected, rel_tol=1e-12)


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_avg_at_k():
    # problems with 1/4, 4/4 and 0/4 correct: (0.25 + 1 + 0) / 3
    assert math.isclose(avg_at_k([[True, False, False, False], [True] * 4, [False] * 4]), 1.25 / 3)
    with pytest.raises(ValueError):
        avg_at_k([])


def test_ks_for():
    assert ks_for(1) == [1] and ks_for(4) == [1, 2, 4] and ks_for(6) == [1, 2, 4, 6]


def _sample(pid, correct, rule="boxed", method="exact", tokens=10, finish="stop"):
    return {
        "id": pid,
        "correct": correct,
        "rule": rule,
        "graded_by": method,
        "response_tokens": tokens,
        "finish_reason": finish,
    }


def test_summarize_greedy():
    samples = [
        _sample("a", True, tokens=10),
        _sample("b", False, rule="none", method="no_answer", tokens=30, finish="length"),
        _sample("c", True, rule="answer_is", method="numeric", tokens=20),
        _sample("d", False, rule="last_number", method="math_verify", tokens=40),
    ]
    s = summarize(samples, 1)
    assert s["accuracy"] == 0.5 and s["count"] == 4 and s["samples"] == 4
    assert s["answered"] == 0.75 and s["mean_response_tokens"] == 25.0 and s["truncated"] == 0.25
    assert s["rules"] == {"boxed": 1, "answer_is": 1, "last_number": 1, "none": 1}
    assert s["graded_by"] == {"exact": 1, "numeric": 1, "math_verify": 1, "timeout": 0, "error": 0, "no_answer": 1}
    assert "pass@1" not in s


def test_summarize_sampled():
    # two problems, 4 samples each: a has 1 correct, b has 2
    samples = [_sample("a", c) for c in (True, False, False, False)] + [
        _sample("b", c) for c in (True, True, False, False)
    ]
    s = summarize(samples, 4)
    assert math.isclose(s["accuracy"], (1 / 4 + 2 / 4) / 2) and s["avg@4"] == s["accuracy"]
    assert math.isclose(s["pass@1"], (1 / 4 + 2 / 4) / 2)
    assert math.isclose(s["pass@2"], ((1 - 3 / 6) + (1 - 1 / 6)) / 2)  # C(3,2)/C(4,2) = 3/6, C(2,2)/C(4,2) = 1/6
    assert s["pass@4"] == 1.0
    with pytest.raises(ValueError, match="problem a has 3 graded samples, expected 4"):
        summarize(samples[1:], 4)


def test_average_is_unweighted():
    assert average({"gsm8k": {"accuracy": 0.5, "count": 1319}, "minerva": {"accuracy": 0.1, "count": 272}}) == 0.3
