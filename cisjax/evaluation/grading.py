"""Grading an extracted answer against the gold one: exact string match, then numbers as numbers (GSM8K, SVAMP), then math-verify in the reward worker pool (a hang or a crash grades wrong)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cisjax.answers import boxed_equal
from cisjax.evaluation.answers import e_notation_to_latex, exact_form, numbers_equal, numeric_value

__all__ = ["METHODS", "Grade", "grade_locally", "math_verify_equal", "grade_all", "POOL_FN"]

# How a grade was decided: exact string match; both plain numbers (numeric sets); math-verify's judgement; the
# math-verify item ran past the pool's hard timeout (or the batch deadline); it raised (e.g. a gold answer
# math-verify cannot parse) or crashed its worker twice; no answer was extracted.
METHODS = ("exact", "numeric", "math_verify", "timeout", "error", "no_answer")

# The pool's worker function, importable in a spawned process.
POOL_FN = "cisjax.evaluation.grading:math_verify_equal"


@dataclass(frozen=True)
class Grade:
    correct: bool
    method: str  # one of METHODS


def grade_locally(answer: str | None, gold: str, *, numeric: bool) -> Grade | None:
    """The grade when it needs no math-verify, else None: no answer is wrong; an exact match (exact_form) is
    right; on a numeric set (GSM8K, SVAMP) an answer stating one number ("$18", "18 \\text{ dollars}", "1,080")
    and the gold compare as numbers, right or wrong."""
    if answer is None or not answer.strip():
        return Grade(False, "no_answer")
    if exact_form(answer) == exact_form(gold):
        return Grade(True, "exact")
    if numeric:
        a, g = numeric_value(answer), numeric_value(gold)
        if a is not None and g is not None:
            return Grade(numbers_equal(a, g), "numeric")
    return None


def math_verify_equal(answer: str, gold: str) -> float:
    """1.0 when math-verify judges the answer equal to the gold answer, else 0.0. Both are read as the content
    of a \\boxed{} (LaTeX), as the training reward reads them: fractions and \\dfrac, decimals, intervals,
    sets of several answers, degrees, \\text{} units are normalised alike; "4.4e7" is read as 4.4 \\times 10^{7}. Raises ValueError when the gold
    answer does not parse. Runs in a pool worker's main thread (math-verify's timeouts are signals)."""
    gold, answer = e_notation_to_latex(gold), e_notation_to_latex(answer)
    return boxed_equal(answer, gold, what=f"gold answer {gold!r}")


_POOL_METHOD = {"ok": "math_verify", "timeout": "timeout", "error": "error", "crashed": "error"}


def grade_all(answers: Sequence[str | None], golds: Sequence[str], numeric: Sequence[bool], pool) -> list[Grade]:
    """Grades in order. What grade_locally cannot decide goes to `pool` (a cisjax.rl.rewards.RewardPool running
    POOL_FN) in one call: an item that hangs past the pool's hard timeout grades wrong ("timeout"), one that
    raises or crashes its worker grades wrong ("error"); the call returns either way."""
    if not len(answers) == len(golds) == len(numeric):
        raise ValueError(f"grade_all: {len(answers)} answers, {len(golds)} golds, {len(numeric)} numeric flags")
    grades: list[Grade | None] = [grade_locally(a, g, numeric=n) for a, g, n in zip(answers, golds, numeric)]
    todo = [i for i, g in enumerate(grades) if g is None]
    if todo:
        outcomes: list[str] = []
        scores = pool.score([answers[i] for i in todo], [golds[i] for i in todo], outcomes=outcomes)
        for i, score, outcome in zip(todo, scores, outcomes):
            method = _POOL_METHOD[outcome]
            grades[i] = Grade(method == "math_verify" and score >= 1.0, method)
    return grades
