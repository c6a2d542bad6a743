"""Evaluating sets through the rollout service: prompts as token ids to Generate (several calls in flight), responses decoded, answers extracted and graded, per-set progress."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import asdict, dataclass

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from cisjax import errors
from cisjax.evaluation import answers as answers_lib
from cisjax.evaluation import grading, scores
from cisjax.rollout.params import SamplingParams

log = logging.getLogger(__name__)

__all__ = ["Settings", "evaluate"]


@dataclass(frozen=True)
class Settings:
    """How the sets are sampled. temperature 0 = greedy (then n must be 1)."""

    n: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 3000
    seed: int = 0  # sampling seed (temperature > 0); samples of a prompt are reproducible given it
    batch_size: int = 32  # prompts per Generate call
    concurrency: int = 4  # Generate calls in flight (the engine batches them together)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def check(self) -> None:
        if self.n < 1 or self.max_new_tokens < 1 or self.batch_size < 1 or self.concurrency < 1:
            raise errors.UserError(f"n, max_new_tokens, batch_size and concurrency must be >= 1: {self}")
        if self.temperature < 0:
            raise errors.UserError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.greedy and self.n > 1:
            raise errors.UserError(
                f"n={self.n} with temperature 0: greedy samples are all the same; give a temperature > 0 for avg@{self.n}/pass@{self.n}"
            )
        if not 0 < self.top_p <= 1:
            raise errors.UserError(f"top_p must be in (0, 1], got {self.top_p}")

    def to_json(self) -> dict:
        return {**asdict(self), "greedy": self.greedy}


class _Progress:
    """A rich progress bar per set (problems, problems/s) on a terminal; elsewhere a line per finished call on stderr.
    `mode`: None = by the terminal, True = the bar, False = the lines, "off" = nothing (the loop logs its summary)."""

    def __init__(self, mode: bool | str | None):
        self.silent = mode == "off"
        self.enabled = (sys.stderr.isatty() if mode is None else mode is True) and not self.silent
        self._bar = None

    def start(self, name: str, total: int):
        self.name, self.total, self.done, self.t0 = name, total, 0, time.monotonic()
        if self.enabled:
            self._bar = Progress(
                TextColumn(f"[bold]eval {name}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[rate]} problems/s"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
            )
            self._task = self._bar.add_task("", total=total, rate="-")
            self._bar.start()

    def advance(self, k: int) -> None:
        self.done += k
        rate = self.done / max(time.monotonic() - self.t0, 1e-9)
        if self._bar is not None:
            self._bar.update(self._task, advance=k, rate=f"{rate:.2f}")
        elif not self.silent:
            print(
                f"eval {self.name}: {self.done}/{self.total} problems, {rate:.2f} problems/s",
                file=sys.stderr,
                flush=True,
            )

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def _chunks(budgets: list[int], batch_size: int) -> list[tuple[int, list[int]]]:
    """(max_new_tokens, problem indices) per Generate call: prompts grouped by their token budget, in order."""
    groups: dict[int, list[int]] = {}
    for i, b in enumerate(budgets):
        if b > 0:
            groups.setdefault(b, []).append(i)
    return [(b, idx[lo : lo + batch_size]) for b, idx in groups.items() for lo in range(0, len(idx), batch_size)]


def _evaluate_set(client, formatter, evalset, settings: Settings, pool, *, max_model_len: int, progress: _Progress):
    """(samples in problem order, the set's summary): its prompts through `client` in calls of one token budget, each
    call's responses graded and recorded as it returns."""
    problems = evalset.problems
    prompts = [formatter.encode(p.question) for p in problems]
    texts = [formatter.text(p.question) for p in problems]
    # each prompt's budget: max_new_tokens, less what the context length leaves (the server refuses more)
    budgets = [min(settings.max_new_tokens, max_model_len - len(ids)) for ids in prompts]
    stats = {
        "prompt_too_long": sum(b < 1 for b in budgets),
        "budget_capped": sum(0 < b < settings.max_new_tokens for b in budgets),
    }
    if stats["prompt_too_long"]:
        log.warning(
            "eval set %s: %d prompts leave no room in the context length %d: graded wrong",
            evalset.name,
            stats["prompt_too_long"],
            max_model_len,
        )
    records: list[list[dict]] = [
        _too_long_records(evalset.name, p, t, settings.n) if b < 1 else [] for p, t, b in zip(problems, texts, budgets)
    ]
    progress.start(evalset.name, len(problems))
    t0 = time.monotonic()
    try:
        with contextlib.closing(_generate(client, formatter, prompts, budgets, settings, evalset.name)) as calls:
            for idx, samples in calls:
                for i, record in _grade_call(evalset, texts, formatter, pool, idx, samples):
                    records[i].append(record)
                progress.advance(len(idx))
        if stats["prompt_too_long"]:  # graded (wrong) without a call
            progress.advance(stats["prompt_too_long"])
    finally:
        progress.stop()
    elapsed = time.monotonic() - t0
    samples = [r for per in records for r in sorted(per, key=lambda r: r["sample"])]
    return samples, _summary(evalset, samples, settings.n, stats, elapsed)


def _generate(client, formatter, prompts, budgets, settings: Settings, name: str) -> Iterator[tuple[list[int], list]]:
    """(problem indices, their samples) per Generate call, as the calls return: prompts grouped by token budget
    (_chunks), `settings.concurrency` calls in flight; the calls not started are cancelled when this is closed early."""

    def generate(call: int, budget: int, idx: list[int]):
        params = SamplingParams(
            n=settings.n,
            temperature=settings.temperature if not settings.greedy else 1.0,
            top_p=settings.top_p,
            max_new_tokens=budget,
            stop_token_ids=list(formatter.stop_token_ids),
            greedy=settings.greedy,
            seed=None if settings.greedy else settings.seed * 1_000_003 + call,
        )
        return idx, client.generate([prompts[i] for i in idx], params)

    calls = _chunks(budgets, settings.batch_size)
    with futures.ThreadPoolExecutor(max_workers=settings.concurrency, thread_name_prefix=f"eval-{name}") as ex:
        pending = [ex.submit(generate, c, b, idx) for c, (b, idx) in enumerate(calls)]
        try:
            for fut in futures.as_completed(pending):
                yield fut.result()
        except BaseException:
            for f in pending:
                f.cancel()
            raise


def _grade_call(evalset, texts: list[str], formatter, pool, idx: list[int], samples) -> list[tuple[int, dict]]:
    """(problem index, record) per sample of one call: each response decoded, its answer extracted and graded."""
    problems = evalset.problems
    flat = [(i, s) for i, per in zip(idx, samples) for s in per]
    responses = [formatter.decode(s.response_ids) for _, s in flat]
    extracted = [answers_lib.extract(r) for r in responses]
    grades = grading.grade_all(
        [e.answer for e in extracted],
        [problems[i].answer for i, _ in flat],
        [evalset.benchmark.numeric] * len(flat),
        pool,
    )
    return [
        (
            i,
            _record(
                evalset.name,
                problems[i],
                s.sample_index,
                texts[i],
                text,
                s.response_ids,
                s.finish_reason,
                s.version,
                found,
                g,
            ),
        )
        for (i, s), text, found, g in zip(flat, responses, extracted, grades)
    ]


def _too_long_records(set_name: str, problem, prompt_text: str, n: int) -> list[dict]:
    """The records of a prompt that leaves no room for a response: n samples, graded wrong without a call."""
    return [
        _record(
            set_name,
            problem,
            j,
            prompt_text,
            "",
            [],
            "prompt_too_long",
            -1,
            answers_lib.Extracted(None, "none"),
            grading.Grade(False, "no_answer"),
        )
        for j in range(n)
    ]


def _summary(evalset, samples: list[dict], n: int, stats: dict, elapsed: float) -> dict:
    """The set's scores (scores.summarize), its prompt statistics, source, sizes, speed and the versions sampled."""
    summary = scores.summarize(samples, n)
    versions = sorted({r["version"] for r in samples if r["version"] >= 0})
    summary.update(stats)
    summary.update(
        {
            "source": evalset.source,
            "source_size": evalset.source_size,
            "full_size": evalset.benchmark.full_size,
            "size_note": evalset.size_note,
            "elapsed_s": elapsed,
            "problems_per_s": len(evalset.problems) / max(elapsed, 1e-9),
            "versions": versions,
        }
    )
    return summary


def _record(
    set_name, problem, sample_index, prompt_text, response, response_ids, finish_reason, version, extracted, grade
) -> dict:
    return {
        "set": set_name,
        "id": problem.id,
        "sample": int(sample_index),
        "prompt": prompt_text,
        "response": response,
        "answer": extracted.answer,
        "rule": extracted.rule,
        "gold": problem.answer,
        "correct": bool(grade.correct),
        "graded_by": grade.method,
        "finish_reason": finish_reason,
        "response_tokens": len(response_ids),
        "version": int(version),
    }


def evaluate(
    client, formatter, evalsets, settings: Settings, pool, *, max_model_len: int, progress: bool | str | None = None
) -> tuple[dict, list[dict]]:
    """Every set in turn through `client` (a RolloutClient): ({set: summary}, samples in set and problem order).
    `pool` is a RewardPool running grading.POOL_FN; `max_model_len` the server's context length; `progress` as
    _Progress's mode."""
    settings.check()
    bar = _Progress(progress)
    per_set, samples = {}, []
    for evalset in evalsets:
        s, summary = _evaluate_set(
            client, formatter, evalset, settings, pool, max_model_len=max_model_len, progress=bar
        )
        per_set[evalset.name] = summary
        samples.extend(s)
        log.info(
            "eval %s: accuracy %.4f on %d problems (%.2f problems/s)",
            evalset.name,
            summary["accuracy"],
            summary["count"],
            summary["problems_per_s"],
        )
    return per_set, samples
