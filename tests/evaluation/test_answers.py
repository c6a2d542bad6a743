"""cisjax.evaluation.answers: extraction rules on hand-written responses of each benchmark; the forms answers are compared in."""

import pytest

from cisjax.evaluation.answers import Extracted, e_notation_to_latex, exact_form, extract, numeric_value, to_number
from tests.evaluation.cases import BY_SET

CASES = [(name, *case) for name, (cases, _) in BY_SET.items() for case in cases]


@pytest.mark.parametrize("name, response, gold, answer, rule, correct, method", CASES)
def test_extract(name, response, gold, answer, rule, correct, method):
    assert extract(response) == Extracted(answer, rule)


def test_at_least_ten_cases_per_set():
    assert {name: len(cases) >= 10 for name, (cases, _) in BY_SET.items()} == dict.fromkeys(BY_SET, True)


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            "\\boxed{\\frac{1}{2}} so the answer is 7",
            Extracted("\\frac{1}{2}", "boxed"),
        ),  # the box wins over the phrase
        ("The answer is: $x+1$ and more", Extracted("x+1", "answer_is")),
        ("the answer is \\(3\\)", Extracted("3", "answer_is")),
        ("The answer is 3.5.", Extracted("3.5", "answer_is")),
        (
            "The answer is\nunclear, but 12 is close",
            Extracted("12", "last_number"),
        ),  # nothing after the phrase on its line
        ("temperatures from -5 to -3", Extracted("-3", "last_number")),
        ("5-3", Extracted("3", "last_number")),  # a minus between numbers is not a sign
        ("x2 and y", Extracted(None, "none")),  # a digit inside a word is not a number
        ("it is .5 of it", Extracted(".5", "last_number")),
        ("about 6.6e-34 J s", Extracted("6.6e-34", "last_number")),
        ("a ratio of 3/4", Extracted("3/4", "last_number")),
        ("", Extracted(None, "none")),
    ],
)
def test_extract_rules(text, expected):
    assert extract(text) == expected


def test_extract_rejects_non_text():
    with pytest.raises(TypeError, match="string"):
        extract(None)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("1,080", 1080.0),
        ("$18$", 18.0),
        ("\\$18.00", 18.0),
        ("50\\%", 50.0),
        ("-0.5", -0.5),
        ("3/4", 0.75),
        ("1{,}000", 1000.0),
        ("4.4e7", 44000000.0),
        (".5", 0.5),
        ("18.", 18.0),
        ("\\frac{1}{2}", None),
        ("18 dollars", None),
        ("-2,1", None),
        ("x", None),
        ("1/0", None),
    ],
)
def test_to_number(text, expected):
    assert to_number(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("18 \\text{ dollars}", 18.0),
        ("x = 5", 5.0),
        ("15 apples", 15.0),
        ("\\frac{36}{2}", None),
        ("2 hours 30 minutes", None),
        ("no number", None),
        ("1,080", 1080.0),
    ],
)
def test_numeric_value(text, expected):
    assert numeric_value(text) == expected


@pytest.mark.parametrize(
    "a, b, same",
    [
        ("\\dfrac{1}{2}", "\\frac{1}{2}", True),
        ("$[-2, 7]$", "[-2,7]", True),
        ("72.", "72", True),
        ("\\tfrac12", "\\frac12", True),
        ("(1, 2)", "(2, 1)", False),
        ("0.5", "\\frac{1}{2}", False),
    ],
)
def test_exact_form(a, b, same):
    assert (exact_form(a) == exact_form(b)) is same


@pytest.mark.parametrize(
    "text, expected",
    [
        ("4.4e7", "4.4 \\times 10^{7}"),
        ("1.325e-27 kg", "1.325 \\times 10^{-27} kg"),
        ("1e11", "1 \\times 10^{11}"),
        ("x2e3", "x2e3"),
        ("e^{2}", "e^{2}"),
        ("2e", "2e"),
    ],
)
def test_e_notation_to_latex(text, expected):
    assert e_notation_to_latex(text) == expected
