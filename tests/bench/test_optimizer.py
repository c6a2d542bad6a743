"""`cisjax bench optimizer`: the learnable token stream, its entropy floor, and a tiny run end to end."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from cisjax import cli
from cisjax.bench import optimizer


def test_stream_follows_its_chain_and_targets_every_next_token():
    b = optimizer.stream_batch(step=3, rows=4, seq=16, vocab=32, follow=1.0, seed=7)
    tokens, targets, mask = b.tokens_MxBxT[0], b.targets_MxBxT[0], b.loss_mask_MxBxT[0]
    perm = np.random.default_rng(7).permutation(32)
    np.testing.assert_array_equal(tokens[:, 1:], perm[tokens[:, :-1]])  # follow=1: always the fixed successor
    np.testing.assert_array_equal(targets[:, :-1], tokens[:, 1:])
    assert mask[:, :-1].all() and not mask[:, -1].any()
    np.testing.assert_array_equal(b.advantages_MxBxT[0], mask.astype(np.float32))  # on-policy likelihood gradient
    again = optimizer.stream_batch(step=3, rows=4, seq=16, vocab=32, follow=1.0, seed=7)
    np.testing.assert_array_equal(again.tokens_MxBxT, b.tokens_MxBxT)  # a function of (seed, step)
    other = optimizer.stream_batch(step=4, rows=4, seq=16, vocab=32, follow=1.0, seed=7)
    assert not np.array_equal(other.tokens_MxBxT, b.tokens_MxBxT)


def test_floor_is_the_streams_entropy_by_hand():
    assert optimizer.floor_nll(32, 1.0) == pytest.approx(0.0, abs=1e-12)
    assert optimizer.floor_nll(32, 0.0) == pytest.approx(math.log(32))
    # follow 0.5 over 4 tokens: the successor with 0.5 + 0.125, each other token 0.125
    assert optimizer.floor_nll(4, 0.5) == pytest.approx(-(0.625 * math.log(0.625) + 3 * 0.125 * math.log(0.125)))


def test_stream_splits_its_rows_into_micro_batches():
    one = optimizer.stream_batch(step=1, rows=8, seq=16, vocab=32, follow=0.8, seed=5)
    four = optimizer.stream_batch(step=1, rows=8, seq=16, vocab=32, follow=0.8, seed=5, micro_batches=4)
    assert four.tokens_MxBxT.shape == (4, 2, 16)
    for a, b in zip(one, four):  # the same rows, in order
        np.testing.assert_array_equal(np.asarray(b).reshape(np.asarray(a).shape), a)


@pytest.mark.slow  # trains a tiny model twice (two compiles)
def test_bench_optimizer_runs_tiny(tmp_path):
    out = tmp_path / "opt.json"
    sizes = ["--hidden", "32", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--experts", "4", "--vocab", "32"]
    argv = ["bench", "optimizer", *sizes, "--steps", "24", "--batch", "16", "--seq", "16", "--lr", "3e-3"]
    # every memory option at once (bf16 moments, bf16 gradient sum over the two micro-batches, offload, bf16 params)
    assert cli.main([*argv, "--micro-batches", "2", "--options", "fp32", "every", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["curves"]) == {"fp32", "every"}
    for curve in res["curves"].values():
        assert len(curve) == 24 and all(math.isfinite(x) for x in curve)
    assert res["learned_nll"] > 0  # the baseline's NLL fell
    assert res["options"]["fp32"]["final_gap"] == 0.0 and isinstance(res["meets_target"], bool)
