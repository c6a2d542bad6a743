"""Hand-written grading cases, at least ten per benchmark: (response, gold as the set's loader gives it, the answer
extracted, the rule that found it, correct?, how the grade was decided). Every expectation was written by hand from
the maths, not read off the code."""

GSM8K = [
    ("She sells 16 - 3 - 4 = 9 eggs, 9 * 2 = 18.\n\\boxed{18}", "18", "18", "boxed", True, "exact"),
    ("\\boxed{\\$18}", "18", "\\$18", "boxed", True, "numeric"),
    ("\\boxed{1,080}", "1080", "1,080", "boxed", True, "numeric"),  # thousands separator
    ("The answer is 18.00", "18", "18.00", "answer_is", True, "numeric"),  # decimals vs integer
    ("so the answer is 72.", "72", "72", "answer_is", True, "exact"),
    ("3 + 4 = 7, then 7 * 2 = 14 eggs", "14", "14", "last_number", True, "exact"),
    ("first \\boxed{17}, no wait: \\boxed{18}", "18", "18", "boxed", True, "exact"),  # \boxed twice: the last
    ("\\boxed{18 \\text{ dollars}}", "18", "18 \\text{ dollars}", "boxed", True, "numeric"),  # \text{} unit
    ("\\boxed{17}", "18", "17", "boxed", False, "numeric"),
    ("\\boxed{\\frac{36}{2}}", "18", "\\frac{36}{2}", "boxed", True, "math_verify"),  # a fraction equal to the integer
    ("I cannot solve this.", "18", None, "none", False, "no_answer"),
    ("The answer is 1,000,000", "1000000", "1,000,000", "answer_is", True, "numeric"),
    ("The answer is 17. Later: 18", "18", "17", "answer_is", False, "numeric"),  # the phrase beats the last number
    ("\\boxed{-3}", "-3", "-3", "boxed", True, "exact"),
    ("\\boxed{0.5}", "1/2", "0.5", "boxed", True, "numeric"),  # a fraction vs a decimal, as numbers
]

SVAMP = [
    ("\\boxed{145}", "145", "145", "boxed", True, "exact"),
    ("\\boxed{145.0}", "145", "145.0", "boxed", True, "numeric"),
    ("He has 20 - 5 = 15 apples left", "15", "15", "last_number", True, "exact"),
    ("the answer is 15 apples", "15", "15 apples", "answer_is", True, "numeric"),
    ("\\boxed{15}", "16", "15", "boxed", False, "numeric"),
    ("\\boxed{\\frac{30}{2}}", "15", "\\frac{30}{2}", "boxed", True, "math_verify"),
    ("Answer is: 8", "8", "8", "answer_is", True, "exact"),
    ("No number here", "8", None, "none", False, "no_answer"),
    ("\\boxed{2} ... \\boxed{3}", "3", "3", "boxed", True, "exact"),
    ("\\boxed{ 51 }", "51", "51", "boxed", True, "exact"),
    ("The total is 3,021 pencils", "3021", "3,021", "last_number", True, "numeric"),
    ("\\boxed{}", "4", None, "none", False, "no_answer"),  # an empty box is no answer
]

MATH500 = [
    (
        "\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}",
        "\\left( 3, \\frac{\\pi}{2} \\right)",
        "\\left( 3, \\frac{\\pi}{2} \\right)",
        "boxed",
        True,
        "exact",
    ),
    (
        "\\boxed{(3,\\frac{\\pi}{2})}",
        "\\left( 3, \\frac{\\pi}{2} \\right)",
        "(3,\\frac{\\pi}{2})",
        "boxed",
        True,
        "math_verify",
    ),
    ("\\boxed{\\dfrac{14}{3}}", "\\frac{14}{3}", "\\dfrac{14}{3}", "boxed", True, "exact"),  # \dfrac
    ("\\boxed{0.5}", "\\frac{1}{2}", "0.5", "boxed", True, "math_verify"),  # decimal vs fraction
    ("\\boxed{0.33}", "\\frac{1}{3}", "0.33", "boxed", False, "math_verify"),
    ("\\boxed{\\text{Evelyn}}", "\\text{Evelyn}", "\\text{Evelyn}", "boxed", True, "exact"),  # \text{} answer
    ("\\boxed{\\text{(C)}}", "\\text{(C)}", "\\text{(C)}", "boxed", True, "exact"),
    ("\\boxed{[-2, 7]}", "[-2,7]", "[-2, 7]", "boxed", True, "exact"),
    ("\\boxed{x \\in [-2, 7]}", "[-2,7]", "x \\in [-2, 7]", "boxed", True, "math_verify"),  # an interval
    ("\\boxed{1,-2}", "-2,1", "1,-2", "boxed", True, "math_verify"),  # two answers in another order
    (
        "\\boxed{\\frac{\\sqrt{21}}{5}}",
        "\\frac{\\sqrt{21}}{5}",
        "\\frac{\\sqrt{21}}{5}",
        "boxed",
        True,
        "exact",
    ),  # nested braces
    ("\\boxed{90^\\circ}", "90", "90^\\circ", "boxed", True, "math_verify"),  # degrees
    ("The answer is $\\frac{1}{8}$.", "\\frac{1}{8}", "\\frac{1}{8}", "answer_is", True, "exact"),
    (
        "\\boxed{3} and then \\boxed{\\frac{1}{",
        "3",
        "1",
        "last_number",
        False,
        "math_verify",
    ),  # the last box is cut off
    ("\\boxed{p - q}", "p - q", "p - q", "boxed", True, "exact"),
    ("\\boxed{0.35625}", ".35625", "0.35625", "boxed", True, "math_verify"),
]

MINERVA = [
    ("The final answer is 4.4e7. I hope it is correct.", "4.4e7", "4.4e7", "answer_is", True, "exact"),
    ("\\boxed{4.4 \\times 10^{7}}", "4.4e7", "4.4 \\times 10^{7}", "boxed", True, "math_verify"),  # e-notation gold
    ("\\boxed{44000000}", "4.4e7", "44000000", "boxed", True, "math_verify"),
    ("\\boxed{4.5e7}", "4.4e7", "4.5e7", "boxed", False, "math_verify"),
    ("\\boxed{5.3 \\times 10^{-9}}", "5.3e-9", "5.3 \\times 10^{-9}", "boxed", True, "math_verify"),
    ("\\boxed{27.39}", "27.39", "27.39", "boxed", True, "exact"),
    ("\\boxed{27.4}", "27.39", "27.4", "boxed", False, "math_verify"),
    ("\\boxed{\\frac{K-1}{L}}", "\\frac{K-1}{L}", "\\frac{K-1}{L}", "boxed", True, "exact"),
    ("\\boxed{(K-1)/L}", "\\frac{K-1}{L}", "(K-1)/L", "boxed", True, "math_verify"),
    ("\\boxed{100 \\text{ km}}", "100", "100 \\text{ km}", "boxed", True, "math_verify"),  # a unit
    ("so the answer is 0.003", "0.003", "0.003", "answer_is", True, "exact"),
    ("\\boxed{3 \\times 10^{-3}}", "0.003", "3 \\times 10^{-3}", "boxed", True, "math_verify"),
]

OLYMPIADBENCH = [
    ("\\boxed{\\frac{1}{2 n+2}}", "\\frac{1}{2 n+2}", "\\frac{1}{2 n+2}", "boxed", True, "exact"),
    (
        "\\boxed{\\frac{1}{2(n+1)}}",
        "\\frac{1}{2 n+2}",
        "\\frac{1}{2(n+1)}",
        "boxed",
        True,
        "math_verify",
    ),  # another form
    (
        "\\boxed{90^{\\circ}, 60^{\\circ}}",
        "90^{\\circ}, 60^{\\circ}",
        "90^{\\circ}, 60^{\\circ}",
        "boxed",
        True,
        "exact",
    ),
    (
        "\\boxed{60^\\circ, 90^\\circ}",
        "90^{\\circ}, 60^{\\circ}",
        "60^\\circ, 90^\\circ",
        "boxed",
        True,
        "math_verify",
    ),  # several answers
    ("\\boxed{(3,2),(1,1)}", "(1,1), (3,2)", "(3,2),(1,1)", "boxed", True, "math_verify"),
    ("\\boxed{(1,1)}", "(1,1), (3,2)", "(1,1)", "boxed", False, "math_verify"),  # one of two answers
    ("\\boxed{2^{1009}}", "2^{1009}", "2^{1009}", "boxed", True, "exact"),
    (
        "\\boxed{(-\\infty, 0) \\cup \\{1\\}}",
        "(-\\infty, 0) \\cup\\{1\\}",
        "(-\\infty, 0) \\cup \\{1\\}",
        "boxed",
        True,
        "exact",
    ),  # escaped braces
    ("\\boxed{\\dfrac{9}{32}}", "\\frac{9}{32}", "\\dfrac{9}{32}", "boxed", True, "exact"),
    (
        "\\boxed{\\frac{9\\sqrt{2}}{32}}",
        "M=\\frac{9}{32} \\sqrt{2}",
        "\\frac{9\\sqrt{2}}{32}",
        "boxed",
        True,
        "math_verify",
    ),
    ("\\boxed{-1+\\sqrt{2}}", "\\sqrt{2}-1", "-1+\\sqrt{2}", "boxed", True, "math_verify"),
    ("\\boxed{15, 5}", "5,15", "15, 5", "boxed", True, "math_verify"),
    ("\\boxed{2^{12}}", "4096", "2^{12}", "boxed", True, "math_verify"),
    ("We find $n = 5$ works.", "4", "5", "last_number", False, "math_verify"),
]

# set name -> (cases, numeric set?)
BY_SET = {
    "gsm8k": (GSM8K, True),
    "svamp": (SVAMP, True),
    "math500": (MATH500, False),
    "minerva": (MINERVA, False),
    "olympiadbench": (OLYMPIADBENCH, False),
}
