"""A step's metrics by hand; MetricsLog: every step in metrics.jsonl, step lines on the console every run.print_every steps."""

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


# ----------------------------------------------------------------------------- a step's metrics, by hand


def _rollouts():
    from types import SimpleNamespace

    from cisjax.train.batching import Rollout

    def r(reward, n, versions, finish="stop"):
        return Rollout([1, 2], list(range(n)), [-0.1] * n, versions, reward=reward, finish_reason=finish)

    groups = [[r(1.0, 2, [3, 3]), r(0.0, 4, [2, 2, 3, 3], "length")], [r(0.0, 1, [3]), r(0.0, 3, [3, 3, 3])]]
    texts = [["\\boxed{4}", "no"], ["\\boxed{1}", "x"]]
    return SimpleNamespace(groups=groups, texts=texts, data_state={"epoch": 1, "size": 10, "position": 4})


def test_rollout_metrics_by_hand():
    m = metrics_lib.rollout_metrics(_rollouts(), step=4)
    assert m["reward/mean"] == 0.25 and m["reward/accuracy"] == 0.25
    assert m["reward/solved_groups"] == 0.5 and m["reward/all_same_groups"] == 0.5
    assert (m["rollout/response_len"], m["rollout/response_len_max"], m["rollout/tokens"]) == (2.5, 4.0, 10.0)
    assert m["rollout/truncated"] == 0.25 and m["rollout/samples"] == 4.0 and m["rollout/boxed_frac"] == 0.5
    # versions 3 x8, 2 x2 at step 4: staleness 1 x8, 2 x2
    assert m["rollout/staleness_mean"] == pytest.approx(1.2) and m["rollout/staleness_max"] == 2.0
    assert m["data/position"] == 14.0  # one epoch of 10 prompts, then 4


def test_step_metrics_by_hand():
    from types import SimpleNamespace

    train = dict(grad_norm=2.0, entropy=0.5, acted_frac=0.1, skipped=0.0, tokens=100.0, loss=1.5)
    rollout = metrics_lib.rollout_metrics(_rollouts(), step=4)
    timings = dict(rollout_wait=0.5, rescore=1.0, train=2.0, publish=0.5, step=4.0)
    report = SimpleNamespace(metrics=lambda: {"publish/version": 5.0})
    out = metrics_lib.step_metrics(train, rollout, timings, publish=report, flips={"replay/x": 0.1}, lead={"a": 1})
    assert out["train/loss"] == 1.5 and out["train/grad_norm"] == 2.0 and out["reward/mean"] == 0.25
    assert (out["reward_mean"], out["accuracy"], out["response_len"], out["staleness_mean"]) == (0.25, 0.25, 2.5, 1.2)
    assert (out["grad_norm"], out["entropy"], out["corr/acted_frac"], out["skipped_steps"]) == (2.0, 0.5, 0.1, 0.0)
    assert out["time/step_s"] == 4.0 and out["time/rollout_wait_s"] == 0.5 and out["tokens_per_s"] == 25.0
    assert out["publish/version"] == 5.0 and out["replay/x"] == 0.1 and out["a"] == 1
    bare = metrics_lib.step_metrics(train, rollout, timings)
    assert "publish/version" not in bare and "a" not in bare and "replay/x" not in bare
    del train["acted_frac"]
    assert metrics_lib.step_metrics(train, rollout, timings)["corr/acted_frac"] == 0.0  # none: nothing acts
