"""`cisjax --help` lists the commands and every command has --help."""

import subprocess
import sys

import pytest

from cisjax import cli


def _help(*args):
    return subprocess.run(
        [sys.executable, "-m", "cisjax.cli", *args, "--help"], capture_output=True, text=True, timeout=120
    )


def test_top_level_help_lists_commands():
    res = _help()
    assert res.returncode == 0, res.stderr
    for name in list(cli.COMMANDS) + ["bench"]:
        assert name in res.stdout


@pytest.mark.parametrize("command", [[c] for c in cli.COMMANDS] + [["bench"]] + [["bench", b] for b in cli.BENCHES])
def test_each_command_has_help(command):
    res = _help(*command)
    assert res.returncode == 0, res.stderr
    assert "usage: cisjax " + " ".join(command) in res.stdout


def test_the_cli_and_the_rollout_server_import_no_jax():
    """`cisjax --help` and `cisjax serve` (the rollout server process) load neither jax nor the trainer: the CLI
    imports only the chosen command's module."""
    code = (
        "import sys; from cisjax import cli; cli.build_parser(['serve']); "
        "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'cisjax.train'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_console_script_installed():
    import shutil

    exe = shutil.which("cisjax") or str(__import__("pathlib").Path(sys.executable).parent / "cisjax")
    res = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "score" in res.stdout


def test_python_dash_m_cisjax():
    res = subprocess.run([sys.executable, "-m", "cisjax", "--help"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "plan" in res.stdout, res.stderr


def test_config_command_prints_overrides(capsys):
    assert cli.main(["config", "--config.mesh.tensor=4"]) == 0
    assert "tensor: 4" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(  # every dispatch impl compiled, forward and backward: `slow`
            [
                "bench",
                "moe",
                "--shapes",
                "4x2x16",
                "--tokens",
                "64",
                "--hidden",
                "32",
                "--repeats",
                "1",
                "--slow-repeats",
                "1",
            ],
            marks=pytest.mark.slow,
        ),
        [
            "bench",
            "logprobs",
            "--vocab",
            "512",
            "--tokens",
            "64",
            "--hidden",
            "32",
            "--chunk-size",
            "16",
            "--repeats",
            "1",
        ],
        pytest.param(  # compiles train steps (several configurations): `slow`
            [
                "bench",
                "step",
                "--hidden",
                "32",
                "--layers",
                "1",
                "--heads",
                "4",
                "--kv-heads",
                "2",
                "--experts",
                "4",
                "--moe-intermediate",
                "16",
                "--shared-intermediate",
                "16",
                "--vocab",
                "64",
                "--batch",
                "8",
                "--seq",
                "16",
                "--repeats",
                "1",
                "--exact",
                "--precision",
                "bf16",
            ],
            marks=pytest.mark.slow,
        ),
    ],
    ids=["moe", "logprobs", "step"],
)
def test_bench_runs_tiny_and_writes_json(argv, tmp_path, capsys):
    """Each bench end to end through the CLI at toy sizes (the numbers are not checked: benches report, tests don't time)."""
    import json

    out = tmp_path / "bench.json"
    assert cli.main(argv + ["--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res
    if argv[1] == "step":  # the loop's trainer time per step under both train.proximal settings, both trained
        p = res["proximal"]
        assert p["rescore_s"] > 0 and p["step_s"] > 0 and p["ratio"] == p["step_s"] / p["rescore_s"], p
        assert isinstance(res["meets_proximal_target"], bool)
        # --exact: the step of rollout.exact timed beside the CIS step, and their ratio
        rows = {r["candidate"]: r for r in res["rows"]}
        assert rows["JAX step (cis+exact)"]["median_s"] > 0 and rows["JAX step (cis)"]["median_s"] > 0
        assert res["exact_step_ratio"] > 0 and isinstance(res["meets_exact_target"], bool)
        assert res["exact_step_ratio_of_medians"] == pytest.approx(
            rows["JAX step (cis+exact)"]["median_s"] / rows["JAX step (cis)"]["median_s"]
        )


def test_command_imports_only_its_own_module():
    """`cisjax serve` must not import the trainer side (jax) into the server process."""
    code = (
        "import sys; from cisjax import cli; cli.build_parser(['serve', '--help']); "
        "print('jax' in sys.modules, 'cisjax.score' in sys.modules)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["False", "False"]
