"""The benches' synthetic train batch: its layout checked position by position on a small one."""

import numpy as np

from cisjax.bench import synthetic


def test_layout_of_a_small_batch():
    b = synthetic.train_batch(2, 3, 8, vocab=11, seed=5)
    assert b.tokens_MxBxT.shape == (2, 3, 8) and b.tokens_MxBxT.dtype == np.int32
    assert b.tokens_MxBxT.min() >= 0 and b.tokens_MxBxT.max() < 11
    np.testing.assert_array_equal(b.targets_MxBxT[..., :-1], b.tokens_MxBxT[..., 1:])
    np.testing.assert_array_equal(b.positions_MxBxT[1, 2], np.arange(8))
    np.testing.assert_array_equal(b.segment_ids_MxBxT, 1)
    # seq 8: the response's targets are positions 1..6 (8 // 4 - 1 up to the last target, 7, excluded)
    np.testing.assert_array_equal(b.loss_mask_MxBxT[0, 0], [0, 1, 1, 1, 1, 1, 1, 0])
    adv = b.advantages_MxBxT
    assert set(np.unique(adv[b.loss_mask_MxBxT])) <= {-1.0, 1.0} and not adv[~b.loss_mask_MxBxT].any()
    assert all(len(np.unique(row[mask])) == 1 for row, mask in zip(adv.reshape(6, 8), b.loss_mask_MxBxT.reshape(6, 8)))
    assert not b.infer_logprobs_MxBxT.any() and not b.prox_logprobs_MxBxT.any()


def test_logprobs_are_negative_and_the_same_seed_gives_the_same_batch():
    a = synthetic.train_batch(1, 4, 16, vocab=7, seed=3, logprobs=True)
    b = synthetic.train_batch(1, 4, 16, vocab=7, seed=3, logprobs=True)
    assert (a.prox_logprobs_MxBxT < 0).all() and (a.infer_logprobs_MxBxT <= 0).all()
    assert not np.array_equal(a.prox_logprobs_MxBxT, a.infer_logprobs_MxBxT)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    # the same seed without logprobs draws the same tokens and advantages first
    c = synthetic.train_batch(1, 4, 16, vocab=7, seed=3)
    np.testing.assert_array_equal(c.tokens_MxBxT, a.tokens_MxBxT)
    np.testing.assert_array_equal(c.advantages_MxBxT, a.advantages_MxBxT)
