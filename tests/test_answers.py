"""cisjax.answers: boxed extraction, reference normal forms and math-verify judgements, by hand."""

from __future__ import annotations

import pytest

from cisjax.answers import last_boxed, normalize_reference, verify


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so the answer is \\boxed{42}.", "42"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # nested braces
        ("first \\boxed{3}, then \\boxed{4}", "4"),  # the last box
        ("\\boxed{\\fbox{1} + 2}", "\\fbox{1} + 2"),  # the last top-level box, not the inner one
        ("\\boxed{\\boxed{5}}", "\\boxed{5}"),
        ("\\fbox{7}", "7"),
        ("\\boxed {8}", "8"),
        ("\\boxed 9.", "9"),  # the space form
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces do not close the box
        ("\\boxed{}", ""),
        ("no box: 42", None),
        ("\\boxed{3} and then cut off \\boxed{\\frac{1}{", None),  # the last box never closes
        ("\\boxedfoo{3}", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    "answer, expected",
    [
        ("She sold 48/2 = <<48/2=24>>24 clips in May.\n#### 1,080", "1080"),
        ("#### 850,000", "850000"),
        ("  72 ", "72"),
        ("58,500", "58500"),
        ("-2,1", "-2,1"),  # a MATH-500 answer: two solutions, not a thousands separator
        ("(3, 4)", "(3, 4)"),
    ],
)
def test_normalize_reference(answer, expected):
    assert normalize_reference(answer) == expected


@pytest.mark.parametrize(
    "response, reference, expected",
    [
        ("... so she earned \\boxed{1080} dollars", "1,080", 1.0),
        ("\\boxed{1,080}", "1080", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{$18$}", "18", 1.0),
        ("It costs $18$ in total. \\boxed{\\$18}", "18", 1.0),
        ("\\boxed{18 \\text{ dollars}}", "18", 1.0),
        ("\\boxed{(3,\\frac{\\pi}{2})}", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
        ("\\boxed{17}", "18", 0.0),
        ("\\boxed{18} was wrong, it is \\boxed{17}", "18", 0.0),  # only the last box counts
        ("the answer is 18", "18", 0.0),  # no box
        ("\\boxed{}", "18", 0.0),
        ("\\boxed{-2,1}", "-2,1", 1.0),
        ("\\boxed{21}", "-2,1", 0.0),
    ],
)
def test_verify(response, reference, expected):
    assert verify(response, reference) == expected


def test_verify_rejects_an_empty_reference():
    with pytest.raises(ValueError, match="reference"):
        verify("\\boxed{1}", "")
