"""The package's shape: modules and functions of a readable size, imports at the top, no import circle, and no import
from a lower floor up to a higher one (the floors below are the package map of docs/development.md)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "cisjax"

# Floors, low to high: a module imports from its own floor or below, never above.
FLOORS = (
    ("errors", "files", "safetensors_io", "console", "records", "config", "rounding", "answers"),
    ("sharding", "distributed", "runtime", "logprobs", "rows", "tokenizer", "data", "rl", "models"),
    ("exact_rows", "forward", "exact_forward", "score", "rollout", "export"),
    ("evaluation", "engines"),
    ("train",),
    ("mismatch", "plan", "sweep", "bench", "demo"),
    ("commands", "cli", "__main__"),
)
# The modules allowed past 500 lines, each one job whose docstring says why it stays one piece: none today.
LONG_MODULES = 0
MODULE_LINES = 500
# Functions of 80 lines or more (docstrings included): a staged protocol or a table of cases, at most this many.
LONG_FUNCTIONS = 10
FUNCTION_LINES = 80
# Imports inside functions: only at a process or engine boundary, each marked `# lazy: <reason>`.
LOCAL_IMPORTS = 60
LAZY = re.compile(r"#\s*lazy:\s*\w+")


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _floor(module: str) -> int:
    room = module.split(".")[1] if "." in module else ""
    for i, rooms in enumerate(FLOORS):
        if room in rooms:
            return i
    raise AssertionError(f"{module}: not on any floor of tests/test_structure.py (add its room to FLOORS)")


def _imports(module: str, path: Path) -> set[str]:
    """The cisjax modules `module` imports (anywhere in its body)."""
    out = set()
    for node in ast.walk(_tree(path)):
        names = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("cisjax"):
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("cisjax")]
        out.update(n for n in names if n in MODULES and n != module)
    return out


def _local_imports(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every import inside a function body (its first and last lines: the marker may be on either)."""
    lines = path.read_text().splitlines()
    found = []

    def visit(node, inside: bool):
        for child in ast.iter_child_nodes(node):
            if inside and isinstance(child, (ast.Import, ast.ImportFrom)):
                first, last = lines[child.lineno - 1], lines[child.end_lineno - 1]
                found.append((child.lineno, first if first == last else f"{first} ... {last.strip()}"))
            visit(child, inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(_tree(path), False)
    return found


def test_every_module_is_on_a_floor():
    for module in MODULES:
        if module != "cisjax":
            _floor(module)


def test_no_import_from_a_lower_floor_up():
    up = [
        f"{m} (floor {_floor(m)}) imports {t} (floor {_floor(t)})"
        for m, path in MODULES.items()
        if m != "cisjax"
        for t in sorted(_imports(m, path))
        if t != "cisjax" and _floor(t) > _floor(m)
    ]
    assert not up, "\n".join(up)


def test_no_import_circle():
    graph = {m: _imports(m, p) - {"cisjax"} for m, p in MODULES.items()}
    # a module importing its own package's __init__ (or the reverse) is not a circle of code
    graph = {m: {t for t in ts if not m.startswith(t + ".") and not t.startswith(m + ".")} for m, ts in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(t) :] + [t]))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_module_sizes():
    long = {m: len(p.read_text().splitlines()) for m, p in MODULES.items()}
    long = {m: n for m, n in long.items() if n > MODULE_LINES}
    assert len(long) <= LONG_MODULES, f"{len(long)} modules over {MODULE_LINES} lines: {long}"
    for m in long:
        doc = ast.get_docstring(_tree(MODULES[m])) or ""
        assert "one piece" in doc.lower(), f"{m} ({long[m]} lines): its docstring must say why it is one piece"


def test_function_sizes():
    long = []
    for m, path in MODULES.items():
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n >= FUNCTION_LINES:
                    long.append(f"{m}.{node.name}: {n}")
    assert len(long) <= LONG_FUNCTIONS, f"{len(long)} functions of {FUNCTION_LINES}+ lines:\n" + "\n".join(long)


def test_imports_at_the_top():
    local = [(m, line, text) for m, p in MODULES.items() for line, text in _local_imports(p)]
    unmarked = [f"{MODULES[m]}:{line}: {text.strip()}" for m, line, text in local if not LAZY.search(text)]
    assert not unmarked, "function-local imports without a `# lazy: <reason>`:\n" + "\n".join(unmarked)
    assert len(local) <= LOCAL_IMPORTS, f"{len(local)} function-local imports (at most {LOCAL_IMPORTS})"


@pytest.mark.parametrize(
    "source, complaint",
    [
        ("def f():\n    import os\n", "without a"),
        ("def f():\n    import os  # lazy: os\n", None),
    ],
)
def test_the_import_check_catches_an_unmarked_import(tmp_path, source, complaint):
    path = tmp_path / "m.py"
    path.write_text(source)
    found = _local_imports(path)
    assert len(found) == 1
    assert (LAZY.search(found[0][1]) is None) == (complaint is not None)


def _room(module: str) -> str:
    """A module's room: its folder under cisjax/ (cisjax.rollout.client -> rollout), or the module (cisjax.data)."""
    return module.split(".")[1] if "." in module else module


def _room_graph() -> dict[str, set[str]]:
    """Which rooms each room's modules import (itself left out)."""
    graph: dict[str, set[str]] = {}
    for m, p in MODULES.items():
        for t in _imports(m, p) - {"cisjax"}:
            if _room(t) != _room(m):
                graph.setdefault(_room(m), set()).add(_room(t))
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The nodes of `graph` that reach one another round a circle: each strongly connected set of two or more
    (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


# Folders that import one another round a circle: none (the engines stand on their own floor above the service).
KNOWN_FOLDER_CIRCLES: list[list[str]] = []


def test_no_import_circle_between_folders():
    assert _circles(_room_graph()) == KNOWN_FOLDER_CIRCLES


def test_circles_by_hand():
    # a -> b -> c -> a is one circle; d only enters it; e <-> f another; g -> g is no circle between rooms
    graph = dict(a={"b"}, b={"c"}, c={"a"}, d={"a"}, e={"f"}, f={"e"}, g={"g"})
    assert _circles(graph) == [["a", "b", "c"], ["e", "f"]]
    assert _circles(dict(a={"b"}, b={"c"})) == []


# Where the logical-axis rules are resolved from the config (sharding.rules_from_config): where a spec is built, once
# per run. Every stage that shards takes the spec's frozen table (TrainSpec.rules, ScoreSpec.rules) or a library
# default (sharding.DEFAULT_TABLE), never the config's rules again.
RESOLVES_RULES = {
    "cisjax.train.spec:from_config",  # TrainSpec.rules: the run's one table (build, plan, publish, the engine)
    "cisjax.train.validate:_mesh",  # the field's check (its error names sharding.rules); the value is the spec's
    "cisjax.score:ScoreSpec.from_config",  # ScoreSpec.rules: `cisjax score`'s and `cisjax mismatch`'s table
}


def _rules_resolved(module: str, path: Path) -> list[str]:
    """`module:function` (and line) of every reference to rules_from_config in `path`: a call, the function passed
    on, or an import of it under another name."""
    found = []

    def visit(node, scope: tuple[str, ...]):
        for child in ast.iter_child_nodes(node):
            name = None
            if isinstance(child, ast.Name) and child.id == "rules_from_config":
                name = child.id
            elif isinstance(child, ast.Attribute) and child.attr == "rules_from_config":
                name = child.attr
            elif isinstance(child, ast.ImportFrom):
                name = next((a.name for a in child.names if a.name == "rules_from_config" and a.asname), None)
            if name:
                found.append((f"{module}:{'.'.join(scope)}", child.lineno))
            inner = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            visit(child, scope + (child.name,) if inner else scope)

    visit(_tree(path), ())
    return [f"{where} (line {line})" for where, line in found]


def test_the_rules_are_resolved_only_where_a_spec_is_built():
    found = [hit for m, p in MODULES.items() for hit in _rules_resolved(m, p)]
    stray = [hit for hit in found if hit.split(" (")[0] not in RESOLVES_RULES]
    assert not stray, "sharding.rules_from_config outside a spec's building (take the spec's rules):\n" + "\n".join(
        stray
    )
    assert {hit.split(" (")[0] for hit in found} == RESOLVES_RULES  # each allowed place still resolves them


@pytest.mark.parametrize(
    "source, where",
    [
        ("from cisjax import sharding\ndef load(rules):\n    return sharding.rules_from_config(rules)\n", "m:load"),
        ("from cisjax.sharding import rules_from_config as r\n", "m:"),
        ("from cisjax.sharding import rules_from_config\nclass A:\n    x = max(rules_from_config)\n", "m:A"),
        ("from cisjax.sharding import rules_from_config\n", None),
    ],
)
def test_the_rules_check_catches_a_stage_resolving_them(tmp_path, source, where):
    path = tmp_path / "m.py"
    path.write_text(source)
    assert [hit.split(" (")[0] for hit in _rules_resolved("m", path)] == ([where] if where else [])
