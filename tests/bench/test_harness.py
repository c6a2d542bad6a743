"""cisjax.bench.harness: the interleaved timer's order, limits, CPU readings and kept results; paired ratios; the table,
--json and `python -m cisjax.bench.<name>`; and the flags every bench shares."""

import argparse
import io
import json

import pytest
from rich.console import Console

from cisjax.bench import harness


def test_interleave_calls_round_by_round_and_keeps_the_last_result():
    calls = []

    def cand(name):
        def call():
            calls.append(name)
            return f"{name}{calls.count(name)}"

        return call

    rounds = []
    t = harness.interleave(
        {"a": cand("a"), "b": cand("b"), "slow": cand("slow")},
        3,
        limit={"slow": 1},
        keep_all=True,
        after_round=rounds.append,
    )
    assert calls == ["a", "b", "slow", "a", "b", "a", "b"]  # interleaved; "slow" only in its first round
    assert rounds == [0, 1, 2]
    assert {k: len(v) for k, v in t.wall_s.items()} == {"a": 3, "b": 3, "slow": 1}
    assert all(s >= 0 for v in t.wall_s.values() for s in v)
    assert t.last == {"a": "a3", "b": "b3", "slow": "slow1"}
    assert t.results == {"a": ["a1", "a2", "a3"], "b": ["b1", "b2", "b3"], "slow": ["slow1"]}
    assert t.cpu_s == {"a": [], "b": [], "slow": []}  # no CPU clock given


def test_interleave_cpu_clock_and_unanswered_readings():
    readings = iter([0.0, 1.5, None, 2.0, 3.0, 3.25])
    t = harness.interleave({"x": lambda: None}, 3, cpu_clock=lambda: next(readings))
    assert t.cpu_s["x"] == [1.5, 0.25]  # the round whose first reading was None has no CPU time
    assert len(t.wall_s["x"]) == 3


def test_interleave_frees_a_result_before_the_next_call():
    """At most one result per candidate is alive during a call (the logprobs bench's RSS peak relies on it)."""
    import weakref

    class Big:
        pass

    refs = []

    def call():
        alive = sum(r() is not None for r in refs)
        assert alive == 0, f"{alive} earlier results still alive"
        out = Big()
        refs.append(weakref.ref(out))
        return out

    t = harness.interleave({"x": call}, 3)
    assert refs[-1]() is t.last["x"]


def test_timings_statistics():
    t = harness.Timings(wall_s={"a": [2.0, 4.0, 9.0], "b": [1.0, 1.0, 3.0]}, cpu_s={})
    assert t.median("a") == 4.0 and t.min("a") == 2.0
    assert t.paired("a", "b") == 3.0  # median of 2, 4, 3: each round against the b of its own round
    assert harness.paired([1.0, 6.0], [2.0, 2.0]) == pytest.approx(1.75)
    assert harness.median(x for x in (3.0, 1.0, 2.0)) == 2.0


def test_timed_passes_arguments():
    seconds, out = harness.timed(lambda a, b=0: a + b, 1, b=2)
    assert out == 3 and seconds >= 0


def test_common_flags():
    p = argparse.ArgumentParser()
    harness.add_repeats(p, 7, "rounds")
    harness.add_seed(p)
    harness.add_server_timeout(p)
    harness.add_json(p)
    args = p.parse_args([])
    assert (args.repeats, args.seed, args.server_timeout, args.json) == (7, 0, 600.0, None)
    assert "rounds (default: 7)" in p.format_help()
    args = p.parse_args(["--repeats", "2", "--json", "out.json"])
    assert harness.recorded(args) == {"repeats": 2, "seed": 0, "server_timeout": 600.0}
    assert harness.smallest(args, ("repeats", "seed")) == 0


def test_write_json_and_report(tmp_path, capsys):
    harness.write_json(None, {"a": 1})  # no --json: nothing written
    shown = []
    path = tmp_path / "res.json"
    assert harness.report({"a": 1, "b": [0.5]}, shown.append, str(path)) == 0
    assert shown == [{"a": 1, "b": [0.5]}]
    assert json.loads(path.read_text()) == {"a": 1, "b": [0.5]}


def test_table_and_verdict():
    out = io.StringIO()
    console = Console(file=out, width=100, color_system=None)
    console.print(harness.table("title", ("candidate", "s"), [("one", "1.0"), ("two", "22.5")], "a caption"))
    console.print(f"target: {harness.verdict(True)} / {harness.verdict(False)}")
    text = out.getvalue()
    for word in ("title", "candidate", "one", "22.5", "a caption", "target: met / NOT met"):
        assert word in text
    assert harness.console(300).width >= 300  # not a terminal here: widened


def test_main_parses_like_the_cli(capsys):
    seen = {}

    def add_args(p):
        p.add_argument("--n", type=int, default=1)

    def run(args, overrides):
        seen.update(n=args.n, overrides=overrides)
        return 0

    assert harness.main("toy", add_args, run, ["--n", "3", "--config.a=1"]) == 0
    assert seen == {"n": 3, "overrides": ["--config.a=1"]}
    with pytest.raises(SystemExit):
        harness.main("toy", add_args, run, ["--help"])
    assert "usage: cisjax bench toy" in capsys.readouterr().out
