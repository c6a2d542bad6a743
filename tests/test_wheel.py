"""The wheel (`pip install .`, not editable), installed apart from the checkout: it ships the config files, finds them
by name and by default, and every command's --help starts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cisjax import config as config_lib

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
# The build's inputs, copied as a clone has them (`pip install git+URL` builds a clone): the checkout gets no build/ or
# *.egg-info, and no file left in its build/lib by an earlier build can slip into the wheel.
SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "cisjax", "configs")
# Every command path of the installed CLI's parser with its --help (run with the wheel's cisjax): {path: [code, out]}.
HELP_ALL = """
import argparse, contextlib, io, json, sys
from cisjax import cli

def walk(parser, path):
    yield path
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from walk(sub, (*path, name))

out = {}
for path in walk(cli.build_parser(), ()):
    buf, code = io.StringIO(), None
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            cli.main([*path, "--help"])
        except SystemExit as exit:
            code = exit.code
    out[" ".join(path)] = [code, buf.getvalue()]
print(json.dumps(out))
"""


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
    assert res.returncode == 0, f"{cmd}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The wheel built from the sources and installed with `pip install --target SITE`, and how to run it: Python with
    PYTHONPATH=SITE alone, in a folder outside the checkout. The checkout's editable install (a meta-path finder that
    .venv's site-packages adds after sys.path's own finder) never gets to answer `import cisjax`: SITE comes first on
    sys.path, and test_the_wheel_is_what_runs checks that it did."""
    tmp = tmp_path_factory.mktemp("wheel").resolve()
    src, dist, site, cwd = tmp / "src", tmp / "dist", tmp / "site", tmp / "cwd"
    src.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(REPO / name, src / name)
    cwd.mkdir()
    pip_env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    pip = [sys.executable, "-m", "pip"]
    _run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(dist), "."],
        cwd=src,
        env=pip_env,
    )
    (built,) = dist.glob("cisjax-*.whl")
    _run([*pip, "install", "--no-deps", "--no-index", "-q", "--target", str(site), str(built)], env=pip_env)
    env = dict(os.environ, PYTHONPATH=str(site))

    def python(*args: str) -> str:
        return _run([sys.executable, *args], cwd=cwd, env=env).stdout

    def cisjax(*args: str) -> str:
        return python("-m", "cisjax", *args)

    return dict(site=site, env=env, cwd=cwd, python=python, cisjax=cisjax)


def test_the_wheel_is_what_runs_and_ships_the_configs(wheel):
    out = wheel["python"]("-c", "import cisjax, cisjax.config as c; print(cisjax.__file__); print(c.configs_dir())")
    package, configs = (Path(line) for line in out.split())
    assert package == wheel["site"] / "cisjax" / "__init__.py", f"not the wheel's cisjax: {package}"
    assert configs == wheel["site"] / "cisjax" / "_configs"
    checkout = {p.relative_to(REPO / "configs") for p in (REPO / "configs").rglob("*") if p.is_file()}
    checkout = {p for p in checkout if "__pycache__" not in p.parts}
    shipped = {p.relative_to(configs) for p in configs.rglob("*") if p.is_file()}
    assert checkout <= shipped and Path("models", "qwen15_moe_a27b.json") in shipped, sorted(checkout - shipped)


def test_a_config_by_name_is_the_papers_recipe(wheel):
    """`--config qwen15_moe_a27b` prints what configs/qwen15_moe_a27b.py of the checkout sets, its model's
    architecture file the shipped copy."""
    shipped_json = wheel["site"] / "cisjax" / "_configs" / "models" / "qwen15_moe_a27b.json"
    want = config_lib.load(REPO / "configs" / "qwen15_moe_a27b.py", [f"--config.model.hf_config={shipped_json}"])
    out = wheel["cisjax"]("config", "--config", "qwen15_moe_a27b")
    assert out.strip() == str(config_lib.redacted(want)).strip()
    for line in ("method: cis", "lam: 2.3", "lr: 3.0e-06", "source: hf:openai/gsm8k:main", "max_new_tokens: 1024"):
        assert f"  {line}\n" in out, line
    assert shipped_json.is_file() and f"hf_config: {shipped_json}" in out
    # the console script, a name with .py and an arm
    script = wheel["site"] / "bin" / "cisjax"
    out = _run([str(script), "config", "--config", "qwen3_30b_a3b.py:tis+replay"], cwd=wheel["cwd"], env=wheel["env"])
    assert "  method: tis\n" in out.stdout and "  replay: rollout\n" in out.stdout


def test_an_unknown_name_lists_the_shipped_configs(wheel):
    res = subprocess.run(
        [sys.executable, "-m", "cisjax", "config", "--config", "qwen15"],
        cwd=wheel["cwd"],
        env=wheel["env"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 2 and "unknown config 'qwen15'" in res.stderr and "qwen15_moe_a27b" in res.stderr


def test_the_default_config_is_the_shipped_base(wheel):
    out = wheel["cisjax"]("config")
    assert out.strip() == str(config_lib.redacted(config_lib.load(REPO / "configs" / "base.py"))).strip()


def test_info_on_a_tiny_model(wheel, tiny_hf_dir):
    out = wheel["cisjax"]("info", "--model", tiny_hf_dir("qwen2_moe"))
    assert "architecture: Qwen2MoeForCausalLM" in out and "MoE layers (" in out


def test_every_command_has_help(wheel):
    """--help of the top level and of every command path of the wheel's parser (enumerated, not listed here); the
    mismatch report's operator defaults come from the shipped base.py."""
    assert "usage: cisjax" in wheel["cisjax"]("--help")
    helps = json.loads(wheel["python"]("-c", HELP_ALL))
    assert {"train", "config", "info", "bench", "bench loop", "mismatch report"} <= set(helps), sorted(helps)
    bad = {path: out[-500:] for path, (code, out) in helps.items() if code != 0 or f"usage: cisjax {path}" not in out}
    assert not bad, bad
    lam = config_lib.load(REPO / "configs" / "base.py").correction.lam
    assert f"CIS lambda (default {lam})" in " ".join(helps["mismatch report"][1].split())
