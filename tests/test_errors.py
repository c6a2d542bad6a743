"""Declared user errors (cisjax.errors) are one line on stderr and exit code 2; any other exception is a bug and propagates."""

import argparse

import pytest

from cisjax import cli, errors


def _fake_command(monkeypatch, raise_it):
    """`cisjax fake` runs raise_it(): a command without the weight of a real one."""

    def build_parser(argv=None):
        parser = argparse.ArgumentParser(prog="cisjax")
        sub = parser.add_subparsers(dest="command", required=True)
        sub.add_parser("fake").set_defaults(_run=lambda args, overrides: raise_it())
        return parser

    monkeypatch.setattr(cli, "build_parser", build_parser)


def _raise(exc):
    def raise_it():
        raise exc

    return raise_it


def test_the_classes():
    assert issubclass(errors.UserError, ValueError)
    assert issubclass(errors.MissingInput, errors.UserError) and issubclass(errors.MissingInput, FileNotFoundError)
    assert str(errors.MissingInput("--input x.jsonl: no such file")) == "--input x.jsonl: no such file"
    from cisjax.models.hf_config import CheckpointError

    assert issubclass(CheckpointError, errors.UserError)  # a model or checkpoint directory that does not fit


@pytest.mark.parametrize(
    "exc", [errors.UserError("--thing 3: must be even"), errors.MissingInput("--thing 3: must be even")]
)
def test_a_user_error_is_one_line_and_exit_code_2(monkeypatch, capsys, exc):
    _fake_command(monkeypatch, _raise(exc))
    assert cli.main(["fake"]) == 2
    out, err = capsys.readouterr()
    assert err == "cisjax fake: error: --thing 3: must be even\n" and out == ""


@pytest.mark.parametrize(
    "exc", [ValueError("shapes (2, 3) and (4,) differ"), KeyError("layers.0.wq"), FileNotFoundError("/tmp/x")]
)
def test_any_other_error_is_a_bug_and_propagates(monkeypatch, capsys, exc):
    _fake_command(monkeypatch, _raise(exc))
    with pytest.raises(type(exc)) as raised:
        cli.main(["fake"])
    assert raised.value is exc  # not turned into exit code 2: its traceback shows
    assert "error:" not in capsys.readouterr().err


def _one_line_error(capsys, command: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    last = err.rstrip("\n").splitlines()[-1]
    assert last.startswith(f"cisjax {command}: error: "), err
    return last


def test_unknown_config_field(capsys):
    assert cli.main(["config", "--config.mesh.fsdpp=2"]) == 2
    assert _one_line_error(capsys, "config") == "cisjax config: error: unknown config field 'mesh.fsdpp'"


def test_unknown_eval_set(tmp_path, capsys):
    argv = ["eval", "--model", str(tmp_path), "--sets", "gsm8k,aime", "--out", str(tmp_path / "out")]
    assert cli.main(argv) == 2
    assert "unknown eval set 'aime'" in _one_line_error(capsys, "eval")
    assert not (tmp_path / "out").exists()  # named before anything is written


def test_unknown_plan_topology(capsys):
    assert cli.main(["plan", "--topology", "tpu-8"]) == 2
    assert "unknown target 'tpu-8'" in _one_line_error(capsys, "plan")


def test_missing_score_input(tmp_path, capsys):
    argv = [
        "score",
        "--model",
        str(tmp_path),
        "--input",
        str(tmp_path / "nope.jsonl"),
        "--output",
        str(tmp_path / "o.jsonl"),
    ]
    assert cli.main(argv) == 2
    assert _one_line_error(capsys, "score") == f"cisjax score: error: --input {tmp_path / 'nope.jsonl'}: no such file"
