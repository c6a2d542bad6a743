"""Per-logit perturbation delta and routing flips against hand-computed values (the arithmetic is in the comments)."""

import math

import numpy as np
import pytest

from cisjax.mismatch import deltas as D


def test_paired_topk_hand_example():
    ids_train = np.array([[5, 1, 7], [2, 3, -1]])
    lp_train = np.array([[-0.5, -1.0, -2.0], [-0.1, -3.0, 5.0]])  # 5.0 sits on padding: never read
    ids_infer = np.array([[1, 5, 9, 8], [3, 2, 4, 0]])  # K differs between the engines
    lp_infer = np.array([[-0.8, -0.4, -3.0, -4.0], [-2.5, -0.2, -4.0, -5.0]])
    delta, pos = D.paired_topk(ids_train, lp_train, ids_infer, lp_infer)
    # t=0: id 1: -0.8 - (-1) = 0.2, id 5: -0.4 - (-0.5) = 0.1; t=1: id 2: -0.2 - (-0.1) = -0.1, id 3: -2.5 + 3 = 0.5
    np.testing.assert_allclose(delta, [0.2, 0.1, -0.1, 0.5], atol=1e-15)
    np.testing.assert_array_equal(pos, [0, 0, 1, 1])


def test_paired_topk_bad_inputs():
    ids, lp = np.array([[1, 2]]), np.array([[-1.0, -2.0]])
    with pytest.raises(ValueError, match="repeats"):
        D.paired_topk(np.array([[1, 1]]), lp, ids, lp)
    with pytest.raises(ValueError, match="positions"):
        D.paired_topk(ids, lp, np.array([[1, 2], [1, 2]]), np.array([[-1.0, -2.0]] * 2))
    with pytest.raises(ValueError, match="positive"):
        D.paired_topk(ids, np.array([[-1.0, 0.5]]), ids, lp)
    with pytest.raises(ValueError, match="shape"):
        D.paired_topk(ids, lp[:, :1], ids, lp)


def test_delta_stats_hand_values():
    out = D.delta_stats(np.array([-2.0, -0.5, 0.0, 0.5, 1.0, 4.0]))
    assert out["entries"] == 6
    assert out["median"] == 0.25  # (0 + 0.5) / 2
    assert out["mean"] == 0.5  # 3 / 6
    # deviations -2.5, -1, -0.5, 0, 0.5, 3.5: squares sum to 20, population variance 20 / 6
    assert out["sd"] == pytest.approx(math.sqrt(10 / 3), rel=1e-15)
    assert out["abs_mean_over_sd"] == pytest.approx(0.5 / math.sqrt(10 / 3), rel=1e-15)
    # |delta| sorted 0, .5, .5, 1, 2, 4: q99 at position 0.99 * 5 = 4.95 -> 2 + 0.95 * 2; q99.9 at 4.995 -> 3.99
    assert out["q99_abs"] == pytest.approx(3.9, abs=1e-12)
    assert out["q99.9_abs"] == pytest.approx(3.99, abs=1e-12)
    assert out["frac_abs_gt_0.5"] == 0.5  # strict: 1, 2, 4 (the two 0.5s do not count)
    assert out["frac_abs_gt_1"] == pytest.approx(1 / 3)  # 2, 4
    assert (out["max_abs"], out["min"], out["max"]) == (4.0, -2.0, 4.0)


def test_delta_stats_empty_and_nonfinite():
    out = D.delta_stats(np.array([]))
    assert out["entries"] == 0 and math.isnan(out["sd"]) and math.isnan(out["q99_abs"])
    with pytest.raises(ValueError, match="non-finite"):
        D.delta_stats(np.array([0.1, np.inf]))


def test_n_flip_sets_ignore_order():
    a = np.array([[[0, 1], [2, 3], [4, 5]], [[0, 1], [1, 2], [3, 4]]])  # [L=2, T=3, K=2]
    b = np.array([[[1, 0], [2, 4], [5, 4]], [[0, 2], [2, 1], [3, 4]]])
    # layer 0: same, differ, same (order swapped); layer 1: differ, same (swapped), same
    np.testing.assert_array_equal(D.n_flip(a, b), [1, 1, 0])
    count = np.array([[True, True, True], [False, True, True]])  # layer 1's flip at t=0 does not count
    np.testing.assert_array_equal(D.n_flip(a, b, count), [0, 1, 0])
    with pytest.raises(ValueError, match="repeats"):
        D.n_flip(np.array([[[1, 1]]]), np.array([[[1, 2]]]))
    with pytest.raises(ValueError, match="shape"):
        D.n_flip(a, b[:, :2])


def test_delta_by_nflip_bins():
    delta = np.array([0.2, 0.1, -0.1, 0.7, 2.0, 0.3])
    pos = np.array([0, 0, 1, 1, 2, 4])
    nflip = np.array([0, 3, 7, 1, 4, 6])  # 6 positions; 3 and 5 have no pairs
    out = D.delta_by_nflip(delta, pos, nflip)
    assert out["labels"] == ["0", "1", "2-3", "4-6", ">=7"]
    np.testing.assert_array_equal(out["positions"], [1, 1, 1, 2, 1])  # 2 -> "2-3", 4 and 6 -> "4-6", 7 -> ">=7"
    np.testing.assert_allclose(out["position_frac"], np.array([1, 1, 1, 2, 1]) / 6)
    np.testing.assert_array_equal(out["entries"], [2, 0, 2, 1, 1])
    # bin 0: {0.2, 0.1}, sd 0.05; bin 2-3: {-0.1, 0.7}, mean 0.3, sd 0.4; bin 4-6: {0.3}; bin >=7: {2.0}
    np.testing.assert_allclose(out["sd"], [0.05, np.nan, 0.4, 0.0, 0.0], atol=1e-15)
    np.testing.assert_allclose(out["frac_abs_gt_0.5"], [0.0, np.nan, 0.5, 0.0, 1.0])
    np.testing.assert_allclose(out["frac_abs_gt_1"], [0.0, np.nan, 0.0, 0.0, 1.0])
    assert out["nflip_mean"] == 3.5  # 21 / 6
    two = D.delta_by_nflip(delta, pos, nflip, edges=(0, 1))  # the paper's N_flip = 0 vs > 0 control
    assert two["labels"] == ["0", ">=1"]
    np.testing.assert_array_equal(two["entries"], [2, 4])


def test_bad_nflip_edges():
    with pytest.raises(ValueError, match="edges"):
        D.delta_by_nflip([0.1], [0], [0], edges=(1, 2))
