"""The demo's synthetic task: two-digit arithmetic problems in GSM8K format, split into train and held-out."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from cisjax import errors
from cisjax.answers import normalize_reference

# "What is 23 + 45?" / "What is 71 - 38?": two-digit operands (10..99); subtraction only with a >= b
# (answers 0..89), addition answers 20..198. The worked solution goes column by column, units first, the carry
# or borrow written out ("7 + 5 = 12, 2 + 4 + 1 = 7"); a problem's "answer" is GSM8K-shaped (solution, then
# "#### 72") so that cisjax.data.load_problems(DIR/data, split) reads it like GSM8K. The warm-up's target
# response is the solution then the boxed result ("7 + 5 = 12, 2 + 4 + 1 = 7, \boxed{72}"), then <|im_end|>.

LOW, HIGH = 10, 99  # operands
# Share of warm-up targets closing with \boxed{} (the rest: "so the answer is N", reward 0). The warm-up model then
# follows the prompt's boxing instruction only this often at temperature 1: what RL has to learn first.
BOXED_FRACTION = 0.3


def solve(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b


def solution(a: int, op: str, b: int) -> str:
    """The column-by-column working: units (with the carry / borrow), then tens."""
    (a1, a0), (b1, b0) = divmod(a, 10), divmod(b, 10)
    if op == "+":
        units, carry = a0 + b0, a0 + b0 >= 10
        return f"{a0} + {b0} = {units}, {a1} + {b1}{' + 1' if carry else ''} = {a1 + b1 + carry}"
    borrow = a0 < b0
    return f"{a0 + 10 * borrow} - {b0} = {a0 + 10 * borrow - b0}, {a1} - {b1}{' - 1' if borrow else ''} = {a1 - b1 - borrow}"


def problem_row(a: int, op: str, b: int) -> dict:
    """One GSM8K-format line: {"question", "answer"}, the answer the worked solution then "#### <n>"."""
    return {"question": f"What is {a} {op} {b}?", "answer": f"{solution(a, op, b)}\n#### {solve(a, op, b)}"}


def response_text(row: dict, boxed: bool = True) -> str:
    """The warm-up's target response for a row (before the end-of-turn token): its solution, then the result —
    boxed as the instruction asks, or (boxed=False) in the plain closing "so the answer is 72", which the reward,
    math-verify on the last \\boxed{}, scores 0."""
    work = row["answer"].rsplit("####", 1)[0].strip()
    answer = normalize_reference(row["answer"])
    end = f"\\boxed{{{answer}}}" if boxed else f"so the answer is {answer}"
    return f"{work}, {end}" if work else end


def _groups() -> list[list[tuple[int, str, int]]]:
    """Every problem of the task, grouped so that a + b and b + a fall in the same split (a held-out problem's
    commuted twin is never trained on)."""
    groups = []
    for a in range(LOW, HIGH + 1):
        for b in range(LOW, a + 1):
            groups.append([(a, "+", b)] + ([(b, "+", a)] if a != b else []))
            groups.append([(a, "-", b)])
    return groups


def _held_groups(seed: int, heldout: int) -> tuple[list, list]:
    """(held-out groups in the order drawn, training groups): whole groups (see _groups) are drawn in a seeded order
    for the held-out set until it has `heldout` problems; every other group is training."""
    groups = _groups()
    total = sum(len(g) for g in groups)
    if not 0 < heldout < total:
        raise errors.UserError(f"heldout={heldout}: must lie in 1..{total - 1}")
    held, train, count = [], [], 0
    for k in np.random.default_rng(seed).permutation(len(groups)):
        if count < heldout:
            held.append(groups[k])
            count += len(groups[k])
        else:
            train.append(groups[k])
    return held, train


def make_task(seed: int = 0, heldout: int = 512) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows), disjoint, deterministic from `seed`: whole groups (see _held_groups), each
    split's problems in a seeded order."""
    held_groups, train_groups = _held_groups(seed, heldout)
    held = [p for g in held_groups for p in g]
    train = [p for g in train_groups for p in g]
    rng = np.random.default_rng([seed, 1])
    held = [held[i] for i in rng.permutation(len(held))]
    train = [train[i] for i in rng.permutation(len(train))]
    return [problem_row(*p) for p in train], [problem_row(*p) for p in held]


def split_heldout(seed: int = 0, heldout: int = 512, test: int = 128) -> tuple[list[dict], list[dict]]:
    """make_task's held-out rows in two disjoint parts, (rl, test), each in the held-out file's order: the last
    groups drawn for the held-out set, until they hold `test` problems, are the test part. A sweep trains on `rl`
    and evaluates on `test`, problems neither the warm-up nor the RL phase saw (a + b and b + a stay together)."""
    held_groups, _ = _held_groups(seed, heldout)
    count = sum(len(g) for g in held_groups)
    if not 0 < test < count:
        raise errors.UserError(f"test={test}: must lie in 1..{count - 1} (the held-out problems)")
    tested = set()
    for g in reversed(held_groups):
        if len(tested) >= test:
            break
        tested.update(problem_row(*p)["question"] for p in g)
    _, held = make_task(seed, heldout)
    return [r for r in held if r["question"] not in tested], [r for r in held if r["question"] in tested]


def write_jsonl(path: Path, rows: Sequence[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)
