"""Benchmark scores from graded samples: the unbiased pass@k estimator, avg@k, and one set's summary."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from cisjax.evaluation.answers import RULES
from cisjax.evaluation.grading import METHODS

__all__ = ["pass_at_k", "avg_at_k", "ks_for", "summarize", "average"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one problem with c correct among n samples (Chen et al. 2021):
    1 - C(n - c, k) / C(n, k), the chance that k samples drawn without replacement hold a correct one.
    Computed as a product (no huge binomials): C(n-c, k) / C(n, k) = prod_{i<k} (n - c - i) / (n - i)."""
    if not (isinstance(n, int) and isinstance(c, int) and isinstance(k, int)):
        raise TypeError(f"pass_at_k takes integers, got n={n!r}, c={c!r}, k={k!r}")
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(k):
        miss *= (n - c - i) / (n - i)
    return 1.0 - miss


def avg_at_k(correct: Sequence[Sequence[bool]]) -> float:
    """avg@k: the mean over problems of the fraction of their k samples that are correct (= pass@1's estimate)."""
    if not correct:
        raise ValueError("avg_at_k of no problems")
    return sum(sum(map(bool, per)) / len(per) for per in correct) / len(correct)


def ks_for(n: int) -> list[int]:
    """The k reported for n samples per problem: 1, 2, 4, ... below n, and n itself."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def summarize(samples: Sequence[Mapping], n: int) -> dict:
    """One set's scores from its graded samples (dicts with "id", "correct", "rule", "graded_by",
    "response_tokens", "finish_reason"; n per problem): accuracy (pass@1; with n = 1, greedy, the share of
    problems solved), count (problems), answered (share of samples with an extracted answer), mean response
    tokens, truncated (share that hit max_new_tokens), how answers were found and graded; for n > 1 also
    avg@n and pass@k for ks_for(n)."""
    by_problem: dict[str, list[bool]] = {}
    for s in samples:
        by_problem.setdefault(s["id"], []).append(bool(s["correct"]))
    short = {pid: len(v) for pid, v in by_problem.items() if len(v) != n}
    if short:
        pid = next(iter(short))
        raise ValueError(f"problem {pid} has {short[pid]} graded samples, expected {n}")
    if not samples:
        return {
            "accuracy": 0.0,
            "count": 0,
            "samples": 0,
            "answered": 0.0,
            "mean_response_tokens": 0.0,
            "truncated": 0.0,
            "rules": {r: 0 for r in RULES},
            "graded_by": {m: 0 for m in METHODS},
        }
    correct = list(by_problem.values())
    rules, methods = Counter(s["rule"] for s in samples), Counter(s["graded_by"] for s in samples)
    out = {
        "accuracy": avg_at_k(correct),
        "count": len(correct),
        "samples": len(samples),
        "answered": sum(s["rule"] != "none" for s in samples) / len(samples),
        "mean_response_tokens": sum(s["response_tokens"] for s in samples) / len(samples),
        "truncated": sum(s["finish_reason"] == "length" for s in samples) / len(samples),
        "rules": {r: rules.get(r, 0) for r in RULES},
        "graded_by": {m: methods.get(m, 0) for m in METHODS},
    }
    if n > 1:
        out[f"avg@{n}"] = out["accuracy"]
        for k in ks_for(n):
            out[f"pass@{k}"] = sum(pass_at_k(n, sum(c), k) for c in correct) / len(correct)
    return out


def average(per_set: Mapping[str, Mapping]) -> float:
    """The unweighted mean of the sets' accuracies (each benchmark counts once, whatever its size)."""
    if not per_set:
        raise ValueError("average of no sets")
    return sum(s["accuracy"] for s in per_set.values()) / len(per_set)
