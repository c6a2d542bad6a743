"""Rollout groups -> TrainBatch: row layout, masks, q placement, padding rows, advantages (hand-computed)."""

import dataclasses

import numpy as np
import pytest

from cisjax import errors
from cisjax.records import SamplingSupport
from cisjax.rl.advantages import AdvantageSpec
from cisjax.train.batching import Rollout, build_batch


def _adv(group_norm=True, batch_norm=False):
    return AdvantageSpec(
        reward_scale=10.0,
        reward_bias=-0.5,
        group_norm=group_norm,
        group_eps=1e-5,
        batch_norm=batch_norm,
        batch_eps=1e-5,
    )


def _groups():
    return [
        [
            Rollout([1, 2, 3], [4, 5], [-0.5, -0.25], [0, 0], reward=1.0),
            Rollout([1, 2, 3], [6], [-1.0], [0], reward=0.0),
        ],
        [
            Rollout([7], [8, 9, 10], [-0.1, -0.2, -0.3], [1, 1, 1], reward=1.0),
            Rollout([7], [11, 12], [-2.0, -3.0], [0, 1], reward=1.0),
        ],
    ]


def test_rows_masks_and_q():
    batch, info = build_batch(_groups(), micro_batches=1, rows_multiple=3, length_multiple=8, advantages=_adv())
    m, b, t = batch.tokens_MxBxT.shape
    assert (m, b, t) == (1, 6, 8)  # 4 rows padded to a multiple of 3; longest sequence 3 + 2 - 1 = 4 positions -> 8
    tok, tgt, mask, q = (
        np.asarray(x)[0]
        for x in (batch.tokens_MxBxT, batch.targets_MxBxT, batch.loss_mask_MxBxT, batch.infer_logprobs_MxBxT)
    )
    # row 0: prompt [1, 2, 3] + response [4, 5]: inputs 1 2 3 4, targets 2 3 4 5, response targets at positions 2, 3
    assert tok[0, :4].tolist() == [1, 2, 3, 4] and tgt[0, :4].tolist() == [2, 3, 4, 5]
    assert mask[0].tolist() == [False, False, True, True, False, False, False, False]
    assert q[0, 2:4].tolist() == [-0.5, -0.25] and q[0, :2].tolist() == [0, 0]
    # row 2: prompt [7] + [8, 9, 10]: every position predicts a response token
    assert mask[2, :3].all() and not mask[2, 3:].any() and np.allclose(q[2, :3], [-0.1, -0.2, -0.3])
    assert np.asarray(batch.positions_MxBxT)[0, 2, :3].tolist() == [0, 1, 2]
    assert np.asarray(batch.segment_ids_MxBxT)[0, 1].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert not mask[4:].any() and not np.asarray(batch.segment_ids_MxBxT)[0, 4:].any()  # padding rows
    assert info["rows"] == 4 and info["tokens"] == 2 + 1 + 3 + 2 and info["index"] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # each response token's policy version at the position that predicts it, -1 elsewhere (padding rows too)
    v = info["versions"]
    assert v.shape == (6, 8) and v[0].tolist() == [-1, -1, 0, 0, -1, -1, -1, -1]
    assert v[3, :2].tolist() == [0, 1] and (v[3, 2:] == -1).all() and (v[4:] == -1).all()


def test_group_advantages_by_hand():
    batch, _ = build_batch(_groups(), micro_batches=2, rows_multiple=1, length_multiple=4, advantages=_adv())
    adv = np.asarray(batch.advantages_MxBxT).reshape(4, -1)
    mask = np.asarray(batch.loss_mask_MxBxT).reshape(4, -1)
    # group 0: shaped rewards 5, -5; mean 0, unbiased std sqrt(50) -> +-1/sqrt(2) on each valid token
    np.testing.assert_allclose(adv[0][mask[0]], 1 / np.sqrt(2), rtol=1e-4)
    np.testing.assert_allclose(adv[1][mask[1]], -1 / np.sqrt(2), rtol=1e-4)
    # group 1: all solved -> no signal
    assert not adv[2:].any()
    assert not adv[~mask].any()


def test_batch_normalisation_is_token_weighted():
    batch, _ = build_batch(
        _groups(), micro_batches=1, rows_multiple=1, length_multiple=4, advantages=_adv(batch_norm=True)
    )
    adv = np.asarray(batch.advantages_MxBxT)[0]
    mask = np.asarray(batch.loss_mask_MxBxT)[0]
    vals = adv[mask]
    # group values over the 8 valid tokens: 2 x a, 1 x -a, 5 x 0 (a = 1/sqrt 2): mean a/8
    a = 1 / np.sqrt(2)
    raw = np.array([a, a, -a, 0, 0, 0, 0, 0])
    want = (raw - raw.mean()) / raw.std(ddof=1)
    np.testing.assert_allclose(np.sort(vals), np.sort(want), rtol=1e-4)


def test_bad_groups():
    with pytest.raises(ValueError, match="same number"):
        build_batch([_groups()[0], _groups()[1][:1]], micro_batches=1, rows_multiple=1)
    bad = _groups()
    bad[0][0] = dataclasses.replace(bad[0][0], logprobs=[-1.0])
    with pytest.raises(ValueError, match="logprobs"):
        build_batch(bad, micro_batches=1, rows_multiple=1)
    bad = _groups()
    bad[1][0] = dataclasses.replace(bad[1][0], versions=[1])
    with pytest.raises(ValueError, match="3 response tokens but 3 logprobs and 1 versions"):
        build_batch(bad, micro_batches=1, rows_multiple=1)
    with pytest.raises(ValueError, match="maximum"):
        build_batch(_groups(), micro_batches=1, rows_multiple=1, length_multiple=8, max_length=4)


def _with_routing(groups, k=2, layers=3):
    """Each rollout's routing: position p, layer x -> experts (10x + p, 100 + x) (distinct, recognisable)."""
    out = []
    for g in groups:
        out.append([])
        for r in g:
            n = len(r.prompt_ids) + len(r.response_ids) - 1
            ids = np.zeros((n, layers, k), np.uint8)
            ids[..., 0] = (10 * np.arange(n))[:, None] % 200
            ids[..., 1] = 100 + np.arange(layers)[None, :]
            out[-1].append(dataclasses.replace(r, routing=ids))
    return out


def test_routing_rows_follow_the_tokens():
    """Routing of every input position (prompt and response) lands at the token's position; padding positions and
    rows hold the distinct ids 0..k-1; without replay the batch carries none."""
    groups = _with_routing(_groups())
    plain, _ = build_batch(groups, micro_batches=1, rows_multiple=3, length_multiple=8)
    assert plain.routing_MxBxTxXxK is None
    batch, _ = build_batch(groups, micro_batches=2, rows_multiple=3, length_multiple=8, replay=True)
    ids = np.asarray(batch.routing_MxBxTxXxK).reshape(6, 8, 3, 2)
    assert batch.routing_MxBxTxXxK.shape == (2, 3, 8, 3, 2) and ids.dtype == np.uint8
    # row 0: prompt [1, 2, 3] + response [4, 5] -> 4 input positions, position p has expert 10p in every layer
    assert ids[0, :4, :, 0].tolist() == [[0] * 3, [10] * 3, [20] * 3, [30] * 3]
    assert ids[0, 2, :, 1].tolist() == [100, 101, 102]
    assert ids[0, 4:].tolist() == [[[0, 1]] * 3] * 4  # padding positions
    assert ids[4:].tolist() == [[[[0, 1]] * 3] * 8] * 2  # padding rows


def test_replay_without_routing_names_the_rollout():
    from cisjax import errors

    groups = _with_routing(_groups())
    groups[1][0] = dataclasses.replace(groups[1][0], routing=None, problem_id="gsm8k-17")
    with pytest.raises(errors.UserError, match="rollout 2 .problem 'gsm8k-17'. came without the engine's routing"):
        build_batch(groups, micro_batches=1, rows_multiple=1, replay=True)
    groups = _with_routing(_groups())
    groups[0][1] = dataclasses.replace(groups[0][1], routing=groups[0][1].routing[:-1])
    with pytest.raises(errors.UserError, match=r"rollout 1 .*routing \(2, 3, 2\) for 3 input positions"):
        build_batch(groups, micro_batches=1, rows_multiple=1, replay=True)


def _with_support(groups):
    """Each response token's support: its own id and id + 100, except where a count of 0 says nothing was cut."""
    out = []
    for g in groups:
        row = []
        for r in g:
            counts = np.array([0 if j == 1 else 2 for j in range(len(r.response_ids))], np.int32)
            ids = np.array([x for j, t in enumerate(r.response_ids) if counts[j] for x in (t, t + 100)], np.int32)
            row.append(dataclasses.replace(r, support=SamplingSupport(ids, counts)))
        out.append(row)
    return out


def test_sampling_support_at_the_positions_that_predict_the_tokens():
    batch, _ = build_batch(_with_support(_groups()), micro_batches=1, rows_multiple=1, length_multiple=4)
    s = batch.support_MxBxTxS[0]
    assert s.shape == (4, 4, 8)  # 4 rows, T = 4 (longest 4 + ... - 1, rounded up to 4), S = 8 (at least 8)
    # row 0: prompt [1, 2, 3], response [4, 5]: token 4 predicted at position 2, token 5 (count 0) at 3
    np.testing.assert_array_equal(s[0, 2], [4, 104, -1, -1, -1, -1, -1, -1])
    assert np.all(s[0, 3] == -1) and np.all(s[0, :2] == -1)
    # row 2: prompt [7], response [8, 9, 10] at positions 0, 1 (count 0), 2
    np.testing.assert_array_equal(s[2, 0, :3], [8, 108, -1])
    assert np.all(s[2, 1] == -1)
    np.testing.assert_array_equal(s[2, 2, :3], [10, 110, -1])
    # without supports, none
    assert build_batch(_groups(), micro_batches=1, rows_multiple=1)[0].support_MxBxTxS is None


def test_sampling_support_of_some_rollouts_only_or_misshapen_is_named():
    groups = _with_support(_groups())
    groups[1][1] = dataclasses.replace(groups[1][1], support=None)
    with pytest.raises(errors.UserError, match="1 of 4 rollouts came without their sampling support"):
        build_batch(groups, micro_batches=1, rows_multiple=1)
    groups = _with_support(_groups())
    bad = groups[0][0].support
    groups[0][0] = dataclasses.replace(groups[0][0], support=SamplingSupport(bad.ids[:1], bad.counts))
    with pytest.raises(errors.UserError, match="rollout 0 .*2 counts summing to 2 for 2 response tokens and 1 ids"):
        build_batch(groups, micro_batches=1, rows_multiple=1)
