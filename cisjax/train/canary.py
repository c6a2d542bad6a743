"""The weight canary: fixed token sequences, trainer-vs-engine logprob comparison against bounds, and per-family weight differences."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from cisjax import errors

__all__ = [
    "canary_sequences",
    "compare",
    "CanaryReport",
    "family",
    "family_differences",
    "FamilyDiff",
    "format_differences",
]


def canary_sequences(
    vocab_size: int, *, num: int, prompt_len: int, response_len: int, seed: int
) -> list[tuple[list[int], list[int]]]:
    """`num` (prompt_ids, response_ids) pairs of token ids drawn uniformly from [0, vocab_size), the
    same for the same arguments (numpy PCG64 from `seed`): the fixed set both engines score."""
    for what, value, low in (
        ("vocab_size", vocab_size, 1),
        ("num", num, 1),
        ("prompt_len", prompt_len, 1),
        ("response_len", response_len, 1),
    ):
        if isinstance(value, bool) or int(value) != value or value < low:
            raise errors.UserError(f"{what}={value!r}: want an integer >= {low}")
    ids = np.random.default_rng(int(seed)).integers(
        0, int(vocab_size), size=(int(num), int(prompt_len) + int(response_len))
    )
    return [(row[:prompt_len].tolist(), row[prompt_len:].tolist()) for row in ids]


@dataclass(frozen=True)
class CanaryReport:
    """The trainer's vs the engine's logprobs of the canary's response tokens (|Δ| = |trainer - engine|)."""

    ok: bool  # both bounds hold (a NaN or a one-sided inf is a failure)
    tokens: int  # response tokens compared
    sequences: int
    mean_abs: float  # mean |Δ| over all tokens
    max_abs: float  # max |Δ|
    worst_sequence: int  # where max |Δ| is: the sequence
    worst_position: int  # and its response token (0-based)
    trainer_at_worst: float  # the two logprobs there
    engine_at_worst: float
    per_sequence_max: tuple[float, ...]  # max |Δ| of each sequence
    max_abs_bound: float  # the bounds checked (inf = not checked)
    mean_abs_bound: float
    exceeded: tuple[str, ...] = ()  # names of the bounds that failed: "mean_abs", "max_abs"

    def summary(self) -> str:
        status = "ok" if self.ok else "FAILED (" + ", ".join(self.exceeded) + " exceeded)"
        lines = [
            f"weight canary {status}: {self.tokens} response tokens in {self.sequences} sequences, |trainer - engine| logprob:",
            f"  mean {self.mean_abs:.3e} (bound {_bound(self.mean_abs_bound)}), max {self.max_abs:.3e} (bound {_bound(self.max_abs_bound)})",
            f"  worst: sequence {self.worst_sequence}, response token {self.worst_position}: trainer {self.trainer_at_worst:.5f}, "
            f"engine {self.engine_at_worst:.5f}",
            "  max per sequence: " + " ".join(f"{v:.2e}" for v in self.per_sequence_max),
        ]
        return "\n".join(lines)


def _bound(value: float) -> str:
    return "not checked" if math.isinf(value) else f"{value:.3e}"


def compare(
    trainer_logprobs: Sequence[Sequence[float]],
    engine_logprobs: Sequence[Sequence[float]],
    *,
    max_abs: float,
    mean_abs: float,
) -> CanaryReport:
    """Compare per-sequence logprobs of the same response tokens; ok when mean |Δ| <= mean_abs and
    max |Δ| <= max_abs (a bound of math.inf is not checked). Equal values (also -inf on both sides)
    differ by 0; NaN or inf on one side only counts as an infinite difference. ValueError when the
    numbers of sequences or the lengths of a sequence differ, or when there is no token at all."""
    for what, value in (("max_abs", max_abs), ("mean_abs", mean_abs)):
        if not (isinstance(value, (int, float)) and value >= 0):  # also rejects NaN
            raise ValueError(f"{what}={value!r}: a bound must be a number >= 0 (math.inf = not checked)")
    if len(trainer_logprobs) != len(engine_logprobs):
        raise ValueError(
            f"canary: {len(trainer_logprobs)} trainer sequences but {len(engine_logprobs)} engine sequences"
        )
    diffs, pairs = [], []
    for i, (t, e) in enumerate(zip(trainer_logprobs, engine_logprobs)):
        t, e = np.asarray(t, np.float64).reshape(-1), np.asarray(e, np.float64).reshape(-1)
        if t.shape != e.shape:
            raise ValueError(f"canary: sequence {i} has {t.size} trainer logprobs but {e.size} engine logprobs")
        with np.errstate(invalid="ignore"):
            d = np.abs(t - e)
        d[t == e] = 0.0
        d[~np.isfinite(d)] = np.inf
        diffs.append(d)
        pairs.append((t, e))
    tokens = sum(d.size for d in diffs)
    if tokens == 0:
        raise ValueError("canary: no response tokens to compare")
    per_seq = tuple(float(d.max()) if d.size else 0.0 for d in diffs)
    worst_seq = max((i for i in range(len(diffs)) if diffs[i].size), key=lambda i: per_seq[i])
    worst_pos = int(np.argmax(diffs[worst_seq]))
    flat = np.concatenate(diffs)
    mean, top = float(flat.mean()), float(flat.max())
    exceeded = tuple(
        name for name, value, bound in (("mean_abs", mean, mean_abs), ("max_abs", top, max_abs)) if not value <= bound
    )
    return CanaryReport(
        ok=not exceeded,
        tokens=tokens,
        sequences=len(diffs),
        mean_abs=mean,
        max_abs=top,
        worst_sequence=worst_seq,
        worst_position=worst_pos,
        trainer_at_worst=float(pairs[worst_seq][0][worst_pos]),
        engine_at_worst=float(pairs[worst_seq][1][worst_pos]),
        per_sequence_max=per_seq,
        max_abs_bound=float(max_abs),
        mean_abs_bound=float(mean_abs),
        exceeded=exceeded,
    )


# ----------------------------------------------------------------------------- weight families

_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")


def family(name: str) -> str:
    """The tensor family of an HF tensor name: every numeric path component (layer, expert) becomes `*`,
    e.g. model.layers.3.mlp.experts.7.down_proj.weight -> model.layers.*.mlp.experts.*.down_proj.weight."""
    return _INDEX.sub("*", name)


class FamilyDiff(NamedTuple):
    family: str
    max_abs: (
        float  # max |expected - actual| over the family's tensors (inf: a tensor missing, extra or of another shape)
    )
    relative: (
        float  # ||expected - actual|| / ||expected||, Frobenius norms over all the family's tensors (inf as above)
    )
    tensors: int  # tensors of the family (in expected; in actual for a family only there)
    worst: str  # the family's tensor with the largest relative difference ("" when none differs)
    note: str  # "" or what is structurally wrong: "2 missing (e.g. NAME)", "1 extra (e.g. NAME)", "shape (4, 8) != (8, 4) in NAME"


def family_differences(expected: Mapping[str, np.ndarray], actual: Mapping[str, np.ndarray]) -> list[FamilyDiff]:
    """How far `actual` (e.g. the exported files read back) is from `expected` (the trainer's params as
    HF tensors), per family, worst first: structural problems (missing, extra, mis-shaped tensors),
    then by relative, then max absolute difference. `expected.items()` is iterated exactly once, in
    full (it may be a lazy, collective stream); `actual` is looked up by name. Values are compared in
    float64; equal values (also equal infs) differ by 0, a NaN on either side counts as inf."""
    acc: dict[str, dict] = {}

    def slot(fam: str) -> dict:
        return acc.setdefault(
            fam, dict(sq_diff=0.0, sq_ref=0.0, max_abs=0.0, tensors=0, worst=("", -1.0), missing=[], extra=[], shape="")
        )

    seen = set()
    for name, want in expected.items():
        seen.add(name)
        s = slot(family(name))
        s["tensors"] += 1
        if name not in actual:
            s["missing"].append(name)
            continue
        want = np.asarray(want, np.float64)
        have = np.asarray(actual[name], np.float64)
        if want.shape != have.shape:
            s["shape"] = s["shape"] or f"shape {tuple(have.shape)} != {tuple(want.shape)} in {name}"
            continue
        with np.errstate(invalid="ignore", over="ignore"):
            d = np.abs(want - have)
        d[want == have] = 0.0
        d[np.isnan(d)] = np.inf
        with np.errstate(over="ignore"):
            sq_diff, sq_ref = float(np.sum(np.square(d))), float(np.sum(np.square(want)))
        s["sq_diff"] += sq_diff
        s["sq_ref"] += sq_ref
        s["max_abs"] = max(s["max_abs"], float(d.max()) if d.size else 0.0)
        rel = _relative(sq_diff, sq_ref)
        if sq_diff > 0 and rel > s["worst"][1]:
            s["worst"] = (name, rel)
    for name in actual.keys():
        if name not in seen:
            slot(family(name))["extra"].append(name)

    out = []
    for fam, s in acc.items():
        notes = [
            f"{len(s['missing'])} missing (e.g. {s['missing'][0]})" if s["missing"] else "",
            f"{len(s['extra'])} extra (e.g. {s['extra'][0]})" if s["extra"] else "",
            s["shape"],
        ]
        note = ", ".join(n for n in notes if n)
        tensors = s["tensors"] or len(s["extra"])
        if note:
            out.append(FamilyDiff(fam, math.inf, math.inf, tensors, s["worst"][0], note))
        else:
            out.append(FamilyDiff(fam, s["max_abs"], _relative(s["sq_diff"], s["sq_ref"]), tensors, s["worst"][0], ""))
    out.sort(key=lambda f: (not f.note, -f.relative, -f.max_abs, f.family))
    return out


def _relative(sq_diff: float, sq_ref: float) -> float:
    if sq_diff == 0:
        return 0.0
    if math.isinf(sq_diff) or not sq_ref > 0:
        return math.inf
    return math.sqrt(sq_diff / sq_ref)


def format_differences(diffs: Sequence[FamilyDiff], top: int = 8) -> str:
    """The families that differ (worst first, at most `top`) as indented lines; a line saying so when none does."""
    bad = [f for f in diffs if f.note or f.max_abs > 0]
    if not bad:
        return f"  all {len(diffs)} tensor families identical"
    lines = []
    for f in bad[:top]:
        what = f.note if f.note else f"relative {f.relative:.3e}, max |diff| {f.max_abs:.3e}"
        worst = f" (worst: {f.worst})" if f.worst and not f.note else ""
        lines.append(f"  {f.family} [{f.tensors} tensors]: {what}{worst}")
    if len(bad) > top:
        lines.append(f"  ... and {len(bad) - top} more families differ")
    return "\n".join(lines)
