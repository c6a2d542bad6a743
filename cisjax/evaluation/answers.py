"""A response's final answer (the last \\boxed{}, else "the answer is ...", else the last number; the rule that fired) and the string/number forms it is compared in."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from cisjax.answers import last_boxed

__all__ = [
    "RULES",
    "Extracted",
    "extract",
    "exact_form",
    "to_number",
    "numeric_value",
    "numbers_equal",
    "e_notation_to_latex",
]

# The extraction rules, in the order they are tried; "none" when no rule finds an answer.
RULES = ("boxed", "answer_is", "last_number", "none")


@dataclass(frozen=True)
class Extracted:
    """The answer text (None when no rule found one) and the rule that found it (one of RULES)."""

    answer: str | None
    rule: str


# "The answer is 42." / "so the final answer is: $\frac{1}{2}$" / "Answer is 7" (the last such phrase counts)
_ANSWER_IS = re.compile(r"\banswer\s+is\b[ \t]*:?[ \t]*", re.IGNORECASE)
# An inline math span right after the phrase: its content is the answer.
_MATH_SPAN = re.compile(r"\$\$(.+?)\$\$|\$(.+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.DOTALL)
# A number as written in prose: optional sign (not a hyphen inside a word or after a digit), thousands separators,
# decimals, an exponent (4.4e7), or a plain fraction a/b. "5-3" gives 5 and 3, not -3.
_NUMBER = re.compile(
    r"(?<![\w.)\]}])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+(?![\w.]))?(?:/\d+)?|(?<![\w.])-?\.\d+"
)
_THOUSANDS = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def _answer_is(text: str) -> str | None:
    """What follows the last "answer is": its first math span when it starts with one, else the rest of the
    sentence (up to a line break or a full stop followed by a space or the end)."""
    matches = list(_ANSWER_IS.finditer(text))
    for m in reversed(matches):
        rest = text[m.end() :]
        span = _MATH_SPAN.match(rest)
        if span is not None:
            value = next(g for g in span.groups() if g is not None).strip()
        else:
            value = re.split(r"\n|\.(?:\s|$)", rest, maxsplit=1)[0].strip()
            value = value.rstrip(".,;!").strip()
        if value:
            return value
    return None


def _last_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def extract(text: str) -> Extracted:
    """The final answer of a response by the first rule that finds one: the last brace-matched top-level
    \\boxed{} (or \\fbox{}) with content; else what follows the last "answer is"; else the last number."""
    if not isinstance(text, str):
        raise TypeError(f"response must be a string, got {type(text).__name__}")
    boxed = last_boxed(text)
    if boxed is not None and boxed.strip():
        return Extracted(boxed.strip(), "boxed")
    said = _answer_is(text)
    if said is not None:
        return Extracted(said, "answer_is")
    number = _last_number(text)
    if number is not None:
        return Extracted(number, "last_number")
    return Extracted(None, "none")


# ----------------------------------------------------------------------------- forms compared


def _strip_delimiters(s: str) -> str:
    s = s.strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if len(s) >= len(left) + len(right) and s.startswith(left) and s.endswith(right):
            s = s[len(left) : -len(right)].strip()
    return s


def exact_form(s: str) -> str:
    """The form of the exact-string comparison: math delimiters and a closing full stop dropped, \\dfrac and
    \\tfrac as \\frac, no whitespace. Two answers equal in this form are the same answer."""
    s = _strip_delimiters(s).rstrip(".").strip()
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return re.sub(r"\s+", "", s)


def to_number(s: str) -> float | None:
    """A plain number written in `s` — "1,080", "$18", "\\$18.00", "50\\%", "-0.5", "3/4", "1{,}000", "4.4e7" — as a float;
    None for anything else (expressions, units, LaTeX fractions: those go to math-verify)."""
    if s is None:
        return None
    s = _strip_delimiters(s)
    s = s.replace("{,}", ",").replace("\\!", "").replace("\\,", "").replace("\\ ", "")
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "").strip().rstrip(".").strip()
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    if re.fullmatch(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?", s):
        return float(s)
    m = re.fullmatch(r"([-+]?\d+)/(\d+)", s)
    if m and int(m.group(2)) != 0:
        return int(m.group(1)) / int(m.group(2))
    return None


def numeric_value(s: str) -> float | None:
    """The number an answer of a numeric set states: the whole answer as a number (to_number), else the one
    number written in it ("18 \\text{ dollars}", "x = 5", "15 apples"); None when it holds none or several
    ("\\frac{36}{2}", "2 hours 30 minutes": math-verify decides those)."""
    value = to_number(s)
    if value is not None or s is None:
        return value
    found = _NUMBER.findall(s)
    return to_number(found[0]) if len(found) == 1 else None


def numbers_equal(a: float, b: float) -> bool:
    """Numeric answers (GSM8K, SVAMP) agree: equal to a relative 1e-6 (so 0.5 = 1/2, 18 = 18.00; 0.33 != 1/3)."""
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


_E_NOTATION = re.compile(r"(?<![\w.\\])(\d+(?:\.\d+)?)[eE]([-+]?\d+)(?![\w.])")


def e_notation_to_latex(s: str) -> str:
    """ "4.4e7" -> "4.4 \\times 10^{7}" (Minerva's gold answers): math-verify's LaTeX reader takes the e of "4.4e7" for
    Euler's number."""
    return _E_NOTATION.sub(lambda m: f"{m.group(1)} \\times 10^{{{int(m.group(2))}}}", s)
