"""Answers: a response's last \\boxed{}, a reference's normal form (GSM8K's ####), math-verify's judgement of the two."""

from __future__ import annotations

import re

__all__ = ["last_boxed", "normalize_reference", "verify", "boxed_equal", "MATH_VERIFY_TIMEOUT_S"]

# math-verify's own timeout per operation (parse answer, parse reference, compare), in whole seconds: it
# uses signal.alarm, which takes integers and works only in a process's main thread (so: pool workers).
# Typical answers take milliseconds, but the first parse of a new construct can take 0.4 s on an idle
# core and several times that on a loaded one: 3 s keeps those from scoring a silent 0.
MATH_VERIFY_TIMEOUT_S = 3

_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
# thousands separators only: MATH-500 has the answer "-2,1" (two solutions), which must stay as it is
_THOUSANDS = re.compile(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?")


def _braced(text: str, start: int) -> int | None:
    """Index just past the brace group opening at text[start] == "{", or None when it never closes
    (a response cut off inside its answer). Escaped braces (\\{ \\}) do not count."""
    depth = 0
    for k in range(start, len(text)):
        c = text[k]
        if c in "{}" and k > 0 and text[k - 1] == "\\":
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return k + 1
    return None


def last_boxed(text: str) -> str | None:
    """The content of the last top-level \\boxed{...} (or \\fbox{...}) in `text`, nested braces kept;
    `\\boxed 5` (the space form) gives "5". None when there is no box, or the last one never closes."""
    found, pos = None, 0
    while (m := _BOX.search(text, pos)) is not None:
        j = m.end()
        while j < len(text) and text[j] == " ":
            j += 1
        if j < len(text) and text[j] == "{":
            end = _braced(text, j)
            if end is None:
                return None
            found, pos = text[j + 1 : end - 1], end
        elif j > m.end():  # "\boxed 5": up to the next space or math delimiter, less a closing full stop
            value = re.match(r"[^\s$]*", text[j:]).group(0)
            found, pos = (value.rstrip(".,;") or None), j + len(value)
        else:
            pos = m.end()  # "\boxed" followed by something else: not an answer
    return found


def normalize_reference(answer: str) -> str:
    """A reference answer as compared: the text after GSM8K's last `####` (if any), stripped, and for a
    number the thousands separators removed ("#### 1,080" -> "1080"). "(3, 4)" and "-2,1" are kept."""
    if not isinstance(answer, str):
        raise TypeError(f"reference answer must be a string, got {type(answer).__name__}: {answer!r}")
    if "####" in answer:
        answer = answer.rsplit("####", 1)[1]
    answer = answer.strip()
    if _THOUSANDS.fullmatch(answer):
        answer = answer.replace(",", "")
    return answer


def verify(response_text: str, reference: str) -> float:
    """1.0 when math-verify judges the response's last \\boxed{} answer equal to the reference, else 0.0
    (also when there is no box). Run it in a process's main thread (math-verify's timeouts are signals)."""
    answer = last_boxed(response_text)
    if answer is None or not answer.strip():
        return 0.0
    return boxed_equal(answer, normalize_reference(reference), what=f"reference answer {reference!r}")


def boxed_equal(answer: str, gold: str, *, what: str) -> float:
    """1.0 when math-verify judges `answer` equal to `gold`, both read as the content of a \\boxed{} (so "\\$18",
    "18 \\text{ dollars}", "\\frac12" and "0.5" normalise alike; MATH references are bare LaTeX), else 0.0.
    Raises ValueError naming `what` when the gold side does not parse. The training reward and cisjax eval's grader
    both compare through this. Main thread only (math-verify's timeouts are signals)."""
    from math_verify import parse  # lazy: worker (pool processes import it; the trainer need not)
    from math_verify import verify as mv_verify  # lazy: worker

    gold_parsed = parse(f"\\boxed{{{gold}}}", parsing_timeout=MATH_VERIFY_TIMEOUT_S)
    if not gold_parsed:
        raise ValueError(f"math-verify cannot parse the {what} (or took over {MATH_VERIFY_TIMEOUT_S} s)")
    pred = parse(f"\\boxed{{{answer}}}", parsing_timeout=MATH_VERIFY_TIMEOUT_S)
    if not pred:
        return 0.0
    return 1.0 if mv_verify(gold_parsed, pred, timeout_seconds=MATH_VERIFY_TIMEOUT_S) else 0.0
