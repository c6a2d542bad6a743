"""README.md and docs/: a short front door, a guide with a checked example for every command, links that resolve,
no dated measurements outside docs/results.md, and a few of the guides' examples run as written."""

from __future__ import annotations

import argparse
import json
import re
import shlex
from pathlib import Path

import pytest

from cisjax import cli
from tests.test_launchers import DOCS, REPO, _logical_lines, _shell_blocks, docs_examples

README = REPO / "README.md"
RESULTS = REPO / "docs" / "results.md"
# The guides: every docs/*.md but the results log (docs/sweeps/ holds tables the sweep command wrote).
GUIDES = [p for p in DOCS if p.parent == REPO / "docs" and p != RESULTS]
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def _command_paths() -> list[tuple[str, ...]]:
    """Every leaf command of the CLI: ("train",), ("mismatch", "measure"), ("bench", "moe"), ..."""

    def walk(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> list[tuple[str, ...]]:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            return [path]
        return [leaf for name, p in subs[0].choices.items() for leaf in walk(p, (*path, name))]

    return walk(cli.build_parser(), ())


def test_the_command_paths_cover_the_cli():
    paths = _command_paths()
    assert {p[0] for p in paths} == {*cli.COMMANDS, "bench"}
    assert ("mismatch", "report") in paths and ("bench", "loop") in paths and ("demo", "prepare") in paths


def test_every_command_has_a_guide_with_a_checked_example():
    """Each command (and each subcommand and bench) is named by a checked ```bash example of some guide in docs/."""
    examples = docs_examples()
    named = {tuple(path) for guide in GUIDES for path in examples[str(guide.relative_to(REPO))]}
    missing = [" ".join(p) for p in _command_paths() if p not in named]
    assert not missing, f"no guide in docs/ has a ```bash example of: {missing}"


def test_readme_command_table_links_each_command_to_its_guide():
    """The README's command table has a row per command, linking a guide whose examples name that command."""
    examples = docs_examples()
    rows = {}
    for line in README.read_text().splitlines():
        m = re.match(r"\| `cisjax ([a-z]+)[^`]*` \|.*\]\((docs/[\w./-]+\.md)\) \|$", line)
        if m:
            rows[m.group(1)] = m.group(2)
    assert set(rows) == {*cli.COMMANDS, "bench"}, sorted(rows)
    for command, guide in rows.items():
        assert any(path[0] == command for path in examples[guide]), f"{guide} has no `cisjax {command}` example"


def test_readme_is_a_short_front_door():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    assert "make demo" in text and "make test" in text  # the two set-up commands (CI runs .ci/run = make test)
    assert "docs/results.md" in text


@pytest.mark.parametrize("doc", [README, *GUIDES], ids=lambda p: str(p.relative_to(REPO)))
def test_no_dated_measurements_outside_results(doc):
    """Dated figures live in docs/results.md (date, commit, machine, command, figures); the README and guides link."""
    dates = _DATE.findall(doc.read_text())
    assert not dates, f"{doc.relative_to(REPO)} holds dates {dates}: move the measurement to docs/results.md"


def _anchors(path: Path) -> set[str]:
    """The heading anchors of a markdown file, as GitHub makes them (lower case, punctuation dropped, spaces to -)."""
    out, seen, code = set(), {}, False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            code = not code
        if code or not (m := re.match(r"#{1,6} (.*)", line)):
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # links in code blocks are code
    return [t for t in _LINK.findall(text) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(doc):
    """Every relative link (and image) names a file or folder that exists, and an anchor a heading of its file."""
    bad = []
    for target in _links(doc):
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists():
            bad.append(target)
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            bad.append(target)
    assert not bad, f"{doc.relative_to(REPO)}: links that do not resolve: {bad}"


def test_the_link_checks_catch_a_broken_link(tmp_path):
    doc = tmp_path / "a.md"
    doc.write_text("# A title: `x.sh`\n\n[ok](#a-title-xsh) [bad](#nope) [gone](b.md) [web](https://x.org/y)\n")
    assert _anchors(doc) == {"a-title-xsh"}
    assert _links(doc) == ["#a-title-xsh", "#nope", "b.md"]


# ----------------------------------------------------------------------------- the guides' examples, run


def _example(guide: str, command: str, values: dict[str, str]) -> list[str]:
    """The argv of the first `cisjax <command> ...` line of a guide's shell blocks, its placeholders replaced."""
    for line in _logical_lines(_shell_blocks(REPO / "docs" / guide)):
        words = shlex.split(line.split(" #", 1)[0])
        if words and words[0].endswith("cisjax") and " ".join(words[1:]).startswith(command + " "):
            return [values.get(w, w) for w in words[1:]]
    raise AssertionError(f"docs/{guide} has no `cisjax {command}` example")


@pytest.fixture
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # the guides' paths (configs/...) are relative to the repository root


def test_config_example_runs(in_repo, capsys):
    argv = _example("training.md", "config", {})
    assert argv[:3] == ["config", "--config", "configs/demo_cpu.py"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"^run:\n(  .*\n)*?  steps: 8$", out, flags=re.M), out[:2000]


def test_info_example_runs(in_repo, tiny_hf_dir, capsys):
    model = tiny_hf_dir("qwen2_moe")
    argv = _example("training.md", "info", {"path/to/hf_model": model})
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "architecture: Qwen2MoeForCausalLM" in out and "MoE layers (" in out and "parameters: " in out


def test_score_example_runs(in_repo, tiny_hf_dir, tmp_path):
    model = tiny_hf_dir("qwen2_moe")
    items = [{"prompt_ids": [1, 2, 3], "response_ids": [4, 5]}, {"prompt_ids": [6, 7], "response_ids": [8, 9, 10]}]
    rollouts, scores = tmp_path / "rollouts.jsonl", tmp_path / "scores.jsonl"
    rollouts.write_text("".join(json.dumps(it) + "\n" for it in items))
    values = {"path/to/hf_model": model, "rollouts.jsonl": str(rollouts), "scores.jsonl": str(scores)}
    argv = _example("mismatch.md", "score", values)
    assert cli.main([*argv, "--no-progress"]) == 0
    lines = [json.loads(line) for line in scores.read_text().splitlines()]
    assert [len(line["logprobs"]) for line in lines] == [2, 3]
    assert all(len(line["entropy"]) == len(line["logprobs"]) for line in lines)
    assert all(len(ids) == 5 for line in lines for ids in line["topk_ids"])
    assert all(lp <= 0 for line in lines for lp in line["logprobs"])
