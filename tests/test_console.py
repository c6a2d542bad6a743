"""cisjax.console: libraries' INFO lines off by default, back with --verbose (CISJAX_VERBOSE for child processes)."""

import logging

import pytest

from cisjax import cli, console


@pytest.fixture(autouse=True)
def _restore_levels(monkeypatch):
    names = ("cisjax", *console.LIBRARIES)
    levels = {n: logging.getLogger(n).level for n in names}
    monkeypatch.delenv(console.ENV, raising=False)
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    yield
    for n, level in levels.items():
        logging.getLogger(n).setLevel(level)


def test_quiet_by_default():
    console.setup()
    assert not logging.getLogger("absl").isEnabledFor(logging.INFO)
    assert not logging.getLogger("orbax.checkpoint").isEnabledFor(logging.INFO)
    assert logging.getLogger("absl").isEnabledFor(logging.WARNING)
    assert logging.getLogger("cisjax.train").isEnabledFor(logging.INFO)
    assert not logging.getLogger("cisjax.train").isEnabledFor(logging.DEBUG)


def test_verbose_flag_anywhere_turns_library_info_back_on(monkeypatch, capsys):
    monkeypatch.setattr(
        cli, "build_parser", lambda rest: pytest.fail(f"parsed {rest}") if "--verbose" in rest else _Stop()
    )
    with pytest.raises(_Done):
        cli.main(["config", "--verbose"])
    import os

    assert os.environ[console.ENV] == "1"  # the rollout server child inherits it
    assert logging.getLogger("absl").isEnabledFor(logging.INFO)
    assert logging.getLogger("cisjax.train.publish").isEnabledFor(logging.DEBUG)


class _Done(Exception):
    pass


class _Stop:
    def parse_args(self, rest):
        raise _Done
