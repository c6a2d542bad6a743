"""cisjax.train.updates: a rollout batch's mini-batches, one proximal rescoring, one optimizer step per mini-batch."""

from __future__ import annotations

import types

import numpy as np
import pytest

from cisjax import sharding
from cisjax.train import state as state_lib
from cisjax.train import step as step_lib
from cisjax.train import updates
from tests.support import steps as U
from tests.support.runs import spec_of


def test_split_takes_consecutive_micro_batches():
    host = U.host_batch(m=4, b=2, t=8)
    minis = updates.split(host, 2)
    assert len(minis) == 2
    for u, mini in enumerate(minis):
        assert mini.tokens_MxBxT.shape == (2, 2, 8)
        np.testing.assert_array_equal(mini.tokens_MxBxT, host.tokens_MxBxT[2 * u : 2 * u + 2])
        np.testing.assert_array_equal(mini.advantages_MxBxT, host.advantages_MxBxT[2 * u : 2 * u + 2])
        assert mini.routing_MxBxTxXxK is None
    assert updates.split(host, 1)[0].tokens_MxBxT.shape == (4, 2, 8)
    with pytest.raises(ValueError, match="4 micro-batches do not split into 3 updates"):
        updates.split(host, 3)


def test_combine_one_update_is_unchanged_and_several_by_tokens():
    one = {"loss": 0.1, "tokens": 3.0, "seqs": 1.0, "skipped": 0.0, "lr": 1e-3, "ratio_max": 1.5}
    assert updates.combine([one]) is one
    a = {"loss": 1.0, "tokens": 10.0, "seqs": 2.0, "skipped": 0.0, "lr": 0.1, "ratio_max": 1.5, "seq_clip_frac": 0.5}
    b = {"loss": 4.0, "tokens": 30.0, "seqs": 2.0, "skipped": 1.0, "lr": 0.2, "ratio_max": 1.2, "seq_clip_frac": 0.0}
    got = updates.combine([a, b])
    assert got["loss"] == pytest.approx((1.0 * 10 + 4.0 * 30) / 40)  # 3.25: a token mean over the rollout batch
    assert got["tokens"] == 40.0 and got["seqs"] == 4.0
    assert got["ratio_max"] == pytest.approx(1.5)
    assert got["seq_clip_frac"] == pytest.approx(0.25)  # per-sequence: by sequences
    assert got["skipped"] == 1.0  # updates skipped
    assert got["lr"] == 0.2  # the last update's


def test_updates_share_one_proximal_policy():
    """train.updates_per_batch=2 (auto: rescore): both mini-batches are rescored under the params before the first
    update, then one step each in order. The second update's ratio p_theta / p_prox leaves 1 (its params moved):
    a rescoring between the updates would keep it at 1. Params, counters and metrics are those of the two steps
    taken by hand."""
    cfg, mesh = U.make_cfg(proximal="auto", updates_per_batch=2, micro_batches=1), U.mesh_for("single")
    spec = spec_of(cfg)
    assert spec.step.proximal == "rescore" and spec.updates_per_batch == 2
    graphdef, tx, rules, state = U.build(cfg, mesh)
    train_step = step_lib.make_train_step(graphdef, tx, spec.step, mesh, rules, state_lib.shardings(state))
    rescore = step_lib.make_rescore(graphdef, spec.step, mesh, rules)
    run = types.SimpleNamespace(mesh=mesh, rules=rules, rescore=rescore, train_step=train_step, replay=False)
    host = U.host_batch(m=2)
    host = host._replace(infer_logprobs_MxBxT=np.full(host.tokens_MxBxT.shape, -3.0, np.float32))

    # by hand: both p_prox under the initial params, then step, step
    minis = updates.split(host, 2)
    place = lambda b: sharding.place(b, mesh, rules, sharding.BATCH_AXES)  # noqa: E731
    prox = [np.asarray(rescore(state.params, place(mini))) for mini in minis]
    hand_state, _ = U.build(cfg, mesh)[3], None
    hand = []
    for mini, p in zip(minis, prox, strict=True):
        hand_state, m = train_step(hand_state, place(mini._replace(prox_logprobs_MxBxT=p)))
        hand.append({k: float(v) for k, v in m.items()})

    batches, flips = updates.rescore(run, state.params, updates.place(minis, run))
    assert flips is None
    np.testing.assert_array_equal(updates.host_prox(batches), np.concatenate(prox))
    state, got, batches, _ = updates.update(run, state, batches, flips)

    assert int(state.step) == 2
    U.assert_same_update(U.flat_params(state.params), U.flat_params(hand_state.params), lr=cfg.train.lr, steps=2)
    assert hand[0]["ratio_max"] == pytest.approx(1.0, abs=1e-5)  # the first update starts at p_prox
    assert abs(hand[1]["ratio_mean"] - 1.0) > 1e-3  # the second does not
    tokens = float(host.loss_mask_MxBxT.sum())
    assert got["tokens"] == tokens == hand[0]["tokens"] + hand[1]["tokens"]
    want_ratio = (hand[0]["ratio_mean"] * hand[0]["tokens"] + hand[1]["ratio_mean"] * hand[1]["tokens"]) / tokens
    assert got["ratio_mean"] == pytest.approx(want_ratio, rel=1e-5)
    assert got["skipped"] == 0.0 and got["lr"] == pytest.approx(cfg.train.lr)
