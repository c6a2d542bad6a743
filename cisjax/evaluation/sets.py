"""The five benchmarks (names, row layouts, full sizes) and where their test splits come from: `--sets` and `--data` parsed, loaded, sizes checked."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from cisjax import data as data_lib
from cisjax import errors

log = logging.getLogger(__name__)

__all__ = ["Benchmark", "BENCHMARKS", "EvalSet", "parse_sets", "parse_data", "locate", "load_set"]


@dataclass(frozen=True)
class Benchmark:
    name: str  # what --sets and the reports call it
    kind: str  # cisjax.data row layout
    folder: str  # its directory (or file stem) in a data directory: <dir>/<folder>/test.jsonl or <dir>/<folder>.jsonl
    full_size: int  # problems in the full test split
    numeric: bool  # answers are plain numbers, compared as numbers
    hub: str | None  # default hub source for --data hf (its layout is the kind's), None = none known
    split: str = "test"


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        Benchmark("gsm8k", "gsm8k", "gsm8k", 1319, True, "openai/gsm8k:main"),
        Benchmark("math500", "math500", "math500", 500, False, "HuggingFaceH4/MATH-500"),
        Benchmark("svamp", "svamp", "svamp", 1000, True, None),
        Benchmark("minerva", "minerva_math", "minerva_math", 272, False, None),
        Benchmark("olympiadbench", "olympiadbench", "olympiadbench", 675, False, None),
    )
}
ALIASES = {"minerva_math": "minerva", "math-500": "math500", "math_500": "math500", "olympiad": "olympiadbench"}


@dataclass
class EvalSet:
    """One benchmark's problems as evaluated, and where they came from."""

    name: str
    benchmark: Benchmark
    problems: list  # cisjax.data.Problem, after --limit
    source: str  # the file (or hub source) read
    source_size: int  # problems in the source, before --limit
    size_note: str  # "" when source_size is the full set's size, else what differs


def parse_sets(text: str) -> list[str]:
    """ "gsm8k,math500,minerva" -> canonical names in the given order (duplicates dropped); ValueError naming an
    unknown set."""
    names = []
    for raw in str(text).split(","):
        name = raw.strip().lower()
        if not name:
            continue
        name = ALIASES.get(name, name)
        if name not in BENCHMARKS:
            raise errors.UserError(f"unknown eval set {raw.strip()!r}; known: {', '.join(BENCHMARKS)}")
        if name not in names:
            names.append(name)
    if not names:
        raise errors.UserError(f"no eval sets given; known: {', '.join(BENCHMARKS)}")
    return names


def parse_data(spec: str) -> tuple[str | None, dict[str, str]]:
    """`--data`: comma-separated entries, each a default source for every set (a directory, `hf` for the sets' hub
    defaults, or one hub dataset hf:<dataset>[:<config>][@split]) or `set=SOURCE` for one set (a .jsonl/.parquet file, a directory holding test.jsonl,
    or hf:<dataset>[:<config>], optionally @<split>). Returns (default or None, {set: source})."""
    default, per_set = None, {}
    for entry in (e.strip() for e in str(spec or "").split(",")):
        if not entry:
            continue
        name, eq, source = entry.partition("=")
        if eq and not name.strip().startswith("hf:"):
            key = ALIASES.get(name.strip().lower(), name.strip().lower())
            if key not in BENCHMARKS:
                raise errors.UserError(
                    f"--data {entry!r}: unknown eval set {name.strip()!r}; known: {', '.join(BENCHMARKS)}"
                )
            if not source.strip():
                raise errors.UserError(f"--data {entry!r}: no source after '='")
            per_set[key] = source.strip()
        elif default is not None:
            raise errors.UserError(
                f"--data has two default sources, {default!r} and {entry!r}; name the set of one: SET=SOURCE"
            )
        else:
            default = entry
    return default, per_set


def locate(bench: Benchmark, default: str | None, per_set: dict[str, str]) -> tuple[str, str]:
    """(source, split) of a benchmark: its own --data entry, else the default directory's file for it (the
    layouts <dir>/<folder>/test.jsonl of shared data, <dir>/<folder>.jsonl of test fixtures), else its hub
    default. FileNotFoundError / ValueError naming the set and what was looked for."""
    source = per_set.get(bench.name)
    if source is None and default is None:
        raise errors.UserError(
            f"eval set {bench.name}: no data source; pass --data DIR (holding {bench.folder}/test.jsonl), "
            f"--data {bench.name}=FILE, or --data hf"
        )
    if source is None and default in ("hf", "hf:"):
        if bench.hub is None:
            raise errors.UserError(
                f"eval set {bench.name}: no default hub dataset is known in this layout; pass "
                f"--data {bench.name}=FILE (e.g. the Qwen2.5-Math harness's {bench.folder}/test.jsonl) or "
                f"{bench.name}=hf:<dataset>[:<config>][@split]"
            )
        return "hf:" + bench.hub, bench.split
    if source is None and default.startswith("hf:"):  # one hub dataset for the set(s) without an entry of their own
        source = default
    if source is None:
        if not os.path.isdir(default):
            raise errors.MissingInput(f"eval data directory {default} does not exist (for set {bench.name})")
        tried = [os.path.join(default, bench.folder, f"{bench.split}{ext}") for ext in (".jsonl", ".parquet")]
        tried += [
            os.path.join(default, f"{stem}{ext}")
            for stem in dict.fromkeys((bench.folder, bench.name))
            for ext in (".jsonl", ".parquet")
        ]
        found = next((t for t in tried if os.path.isfile(t)), None)
        if found is None:
            raise errors.MissingInput(f"eval set {bench.name}: none of {', '.join(tried)} exists")
        return found, bench.split
    split = bench.split
    if source.startswith("hf:") and "@" in source:
        source, split = source.rsplit("@", 1)
    if not source.startswith("hf:") and not os.path.exists(source):
        raise errors.MissingInput(f"eval set {bench.name}: data source {source} does not exist")
    return source, split


def load_set(name: str, default: str | None, per_set: dict[str, str], *, limit: int = 0) -> EvalSet:
    """A benchmark's problems (the first `limit` when > 0). The size of the source is checked against the full
    set's: a difference is logged and kept in `size_note`. A problem without a gold answer is an error naming it."""
    bench = BENCHMARKS[name]
    source, split = locate(bench, default, per_set)
    problems = data_lib.load_problems(source, split, kind=bench.kind)
    empty = next((p for p in problems if not str(p.answer).strip()), None)
    if empty is not None:
        raise errors.UserError(f"eval set {name} ({source}): problem {empty.id} has no gold answer")
    note = ""
    if len(problems) != bench.full_size:
        note = f"{source} holds {len(problems)} problems; the full {name} test set has {bench.full_size}"
        log.warning("eval set %s: %s", name, note)
    if limit < 0:
        raise errors.UserError(f"limit must be >= 0, got {limit}")
    return EvalSet(
        name=name,
        benchmark=bench,
        problems=problems[:limit] if limit else problems,
        source=source,
        source_size=len(problems),
        size_note=note,
    )
