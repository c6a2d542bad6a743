"""What every bench shares: its common flags, the interleaved timing of candidates, medians and paired ratios, the
printed table, `--json` and `python -m cisjax.bench.<name>`."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

# --- the flags every bench takes -------------------------------------------------------------------------------------


def add_repeats(parser: argparse._ActionsContainer, default: int, help: str) -> None:
    """--repeats: the timed calls (or rounds) per candidate."""
    parser.add_argument("--repeats", type=int, default=default, help=f"{help} (default: %(default)s)")


def add_seed(parser: argparse._ActionsContainer, help: str | None = None) -> None:
    """--seed (default 0)."""
    parser.add_argument("--seed", type=int, default=0, help=help)


def add_json(parser: argparse._ActionsContainer) -> None:
    """--json PATH: the results as JSON."""
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON to PATH")


def add_server_timeout(parser: argparse._ActionsContainer) -> None:
    """--server-timeout: how long a rollout server subprocess may take to start."""
    parser.add_argument(
        "--server-timeout",
        type=float,
        default=600.0,
        help="seconds the server may take to start (default: %(default)s)",
    )


def smallest(args: argparse.Namespace, names: Iterable[str]) -> int | float:
    """The smallest of the named arguments (a bench's "sizes must be positive" check)."""
    return min(getattr(args, name) for name in names)


def recorded(args: argparse.Namespace) -> dict:
    """The arguments as a bench records them in its results (all but --json)."""
    return {k: v for k, v in vars(args).items() if k != "json"}


# --- timing ----------------------------------------------------------------------------------------------------------


def timed(fn: Callable, *args, **kwargs) -> tuple[float, Any]:
    """(wall seconds of one call `fn(*args, **kwargs)`, its result)."""
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - t0, out


def median(xs: Iterable[float]) -> float:
    return statistics.median(list(xs))


def paired(a_s: Sequence[float], b_s: Sequence[float]) -> float:
    """The median over rounds of a / b, each a against the b of its own round: load drift on a shared machine
    cancels."""
    return statistics.median(a / b for a, b in zip(a_s, b_s))


@dataclass
class Timings:
    """What `interleave` measured: each candidate's wall seconds per call, its CPU seconds per call (where a CPU clock
    was given and answered), the result of its last call and, with keep_all, every call's result."""

    wall_s: dict[str, list[float]]
    cpu_s: dict[str, list[float]]
    last: dict[str, Any] = field(default_factory=dict)
    results: dict[str, list] = field(default_factory=dict)

    def median(self, name: str) -> float:
        return statistics.median(self.wall_s[name])

    def min(self, name: str) -> float:
        return min(self.wall_s[name])

    def paired(self, a: str, b: str) -> float:
        """Median over rounds of a's time / b's time in the same round."""
        return paired(self.wall_s[a], self.wall_s[b])


def interleave(
    candidates: Mapping[str, Callable[[], Any]],
    repeats: int,
    *,
    cpu_clock: Callable[[], float | None] | None = None,
    limit: Mapping[str, int] | None = None,
    keep_all: bool = False,
    after_round: Callable[[int], None] | None = None,
) -> Timings:
    """Each round calls every candidate once, in order, so that load drift on a shared machine hits every candidate
    alike. A candidate returns when its work is done (block on JAX results inside it). `cpu_clock`: CPU seconds read
    before and after each call (a None reading skips that call's CPU time); `limit`: at most that many rounds for the
    named candidates (slow ones); `after_round(i)`: untimed work after round i. A candidate's previous result is
    dropped before it is called again, so that at most one result per candidate is alive during a call."""
    limit = limit or {}
    t = Timings({k: [] for k in candidates}, {k: [] for k in candidates}, results={k: [] for k in candidates})
    for i in range(repeats):
        for name, fn in candidates.items():
            if i >= limit.get(name, repeats):
                continue
            t.last.pop(name, None)
            c0 = cpu_clock() if cpu_clock else None
            wall, t.last[name] = timed(fn)  # no other reference to the result: the next call's pop frees it
            c1 = cpu_clock() if cpu_clock else None
            t.wall_s[name].append(wall)
            if c0 is not None and c1 is not None:
                t.cpu_s[name].append(c1 - c0)
            if keep_all:
                t.results[name].append(t.last[name])
        if after_round is not None:
            after_round(i)
    return t


# --- printing and writing --------------------------------------------------------------------------------------------


def verdict(ok: bool) -> str:
    """A target's verdict, coloured for rich."""
    return "[green]met[/]" if ok else "[red]NOT met[/]"


def console(min_width: int | None = None) -> Console:
    """rich's console; at least `min_width` columns when the output is not a terminal (a log, a pipe)."""
    out = Console()
    if min_width and not out.is_terminal:
        out.width = max(out.width, min_width)
    return out


def table(title: str, columns: Sequence[str], rows: Iterable[Sequence[str]], caption: str | None = None) -> Table:
    """A results table: the first column (the candidate) left-justified, the figures right-justified."""
    out = Table(title=title, caption=caption, caption_justify="left")
    for i, col in enumerate(columns):
        out.add_column(col, justify="right" if i else "left")
    for row in rows:
        out.add_row(*row)
    return out


def write_json(path: str | None, res: Mapping) -> None:
    """The results as JSON to `path` (the --json flag; nothing when it is None)."""
    if path:
        Path(path).write_text(json.dumps(res, indent=2))


def report(res: dict, show: Callable[[dict], None], json_path: str | None) -> int:
    """A bench's end: its results shown (`show`), written to --json's path; exit code 0."""
    show(res)
    write_json(json_path, res)
    return 0


def main(name: str, add_args: Callable, run: Callable, argv: list[str] | None = None) -> int:
    """`python -m cisjax.bench.<name>`: as `cisjax bench <name>` (--config.x=y overrides included)."""
    from cisjax.config import split_overrides  # lazy: ml_collections (absent where the GPU check runs benches)

    rest, overrides = split_overrides(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog=f"cisjax bench {name}")
    add_args(parser)
    return run(parser.parse_args(rest), overrides)
