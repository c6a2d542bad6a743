"""MetricsLog: every step in metrics.jsonl, step lines on the console every run.print_every steps."""

import json

import pytest

from cisjax.train import metrics as metrics_lib


def test_print_every_thins_the_console_not_the_file(tmp_path, capsys):
    mlog = metrics_lib.MetricsLog(tmp_path, total_steps=10, tensorboard=False, progress=False, print_every=4)
    for s in range(10):
        mlog.log(s, {"reward_mean": s / 10})
    mlog.close()
    printed = [line.split()[1] for line in capsys.readouterr().out.splitlines()]
    assert printed == ["1/10", "4/10", "8/10", "10/10"]  # the first, every fourth, the last
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(10))


def test_print_every_counts_from_a_resumed_step(tmp_path, capsys):
    mlog = metrics_lib.MetricsLog(
        tmp_path, total_steps=8, start_step=5, tensorboard=False, progress=False, print_every=4
    )
    for s in range(5, 8):
        mlog.log(s, {"reward_mean": 0.5})
    mlog.close()
    assert [line.split()[1] for line in capsys.readouterr().out.splitlines()] == ["6/8", "8/8"]


def test_print_every_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="print_every"):
        metrics_lib.MetricsLog(tmp_path, total_steps=3, tensorboard=False, progress=False, print_every=0)
