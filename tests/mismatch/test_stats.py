"""Mismatch statistics against hand-computed values (the arithmetic is in the comments)."""

import functools
import math
import subprocess
import sys

import numpy as np
import pytest

from cisjax.mismatch import stats as S

LN = math.log


def logq_from_eps(logp, eps):
    """Input construction only: log q with logit q = logit p - eps, in closed form."""
    logp, eps = np.asarray(logp, np.float64), np.asarray(eps, np.float64)
    z = logp - np.log(-np.expm1(logp)) - eps
    return -np.logaddexp(0.0, -z)


def tokens(p, values):
    """(logp, [p] * len(values)) for one probability and several eps / log k values."""
    return np.full(len(values), np.log(p)), np.asarray(values, np.float64)


def test_the_statistics_are_numpy_alone():
    """The statistics import neither JAX nor a config: the operators' parameters are their arguments."""
    code = "import sys, cisjax.mismatch.stats, cisjax.mismatch.deltas; print(sorted({'jax', 'cisjax.config'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.split() == ["[]"], (out.stdout, out.stderr)


def test_importing_the_report_reads_no_config():
    """Importing the report runs no config file: base.py is read on use (analysis.operator_defaults), not at import."""
    code = (
        "from cisjax import config; calls = []; load_file = config.load_file; "
        "config.load_file = lambda *a: calls.append(a) or load_file(*a); "
        "import cisjax.mismatch.report; print(len(calls))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.split() == ["0"], out.stderr


# ----------------------------------------------------------------------------- eps and the identity


def test_eps_closed_forms():
    logp = np.array([math.log1p(-1e-12), LN(0.5), -800.0, -50.0, LN(0.5), LN(0.2)])
    logq = np.array([LN(0.5), -1e-30, LN(0.5), LN(0.5), LN(0.2), LN(0.2)])
    eps = S.eps_from_logprobs(logp, logq)
    # p = 1 - 1e-12, q = 1/2: logit p = log((1 - 1e-12) / 1e-12) = 12 ln 10 + log1p(-1e-12); a naive 1 - exp(logp)
    # carries an absolute error ~1e-16 on 1e-12, i.e. ~1e-4 on eps
    assert eps[0] == pytest.approx(12 * LN(10) - 1e-12, abs=1e-11)
    # q = exp(-1e-30) (1 - q = 1e-30, 1 - exp(logq) rounds to 0): eps = -logit q = -(30 ln 10 - 1e-30)
    assert eps[1] == pytest.approx(-30 * LN(10), abs=1e-11)
    # p = e^-800 underflows to 0, but logit p = -800 - log1p(-e^-800) = -800
    assert eps[2] == -800.0
    assert eps[3] == pytest.approx(-50.0, abs=1e-12)  # -50 + e^-50
    assert eps[4] == pytest.approx(LN(4), abs=1e-15)  # logit(1/2) - logit(1/5) = 0 - log(1/4)
    assert eps[5] == 0.0


def test_eps_float32_near_one():
    x = np.float32(-1e-12)  # fp32 holds log p = -1e-12 (p itself rounds to 1 in fp32)
    eps = S.eps_from_logprobs(np.array([x]), np.array([np.float32(LN(0.5))]))
    # logit p = x - log(1 - e^x) = -log(-x) + O(x); logit q = log 0.5 - log 0.5 = 0 up to the fp32 rounding of log 0.5
    q32 = float(np.float32(LN(0.5)))
    logit_q = q32 - math.log(-math.expm1(q32))
    assert eps[0] == pytest.approx(-math.log(-float(x)) - logit_q, abs=1e-9)


def test_eps_nan_where_a_probability_rounds_to_one_or_zero():
    logp = np.array([0.0, LN(0.5), 0.0, -np.inf, LN(0.5)])
    logq = np.array([LN(0.5), 0.0, 0.0, LN(0.5), -np.inf])
    eps = S.eps_from_logprobs(logp, logq)
    assert np.isnan(eps).all()


def test_identity_holds_on_finite_tokens():
    logp = np.array([math.log1p(-1e-12), LN(0.5), -800.0, LN(0.9), LN(0.01), -1e-7, 0.0, LN(0.3)])
    logq = np.array([LN(0.5), -1e-30, LN(0.5), LN(0.2), LN(0.99), -3e-7, LN(0.5), LN(0.3)])
    eps = S.eps_from_logprobs(logp, logq)
    assert np.isnan(eps[6]) and np.isfinite(np.delete(eps, 6)).all()
    assert S.identity_max_error(logp, logq, eps) < 1e-12
    assert (
        S.identity_max_error(
            logp.astype(np.float32),
            logq.astype(np.float32),
            S.eps_from_logprobs(logp.astype(np.float32), logq.astype(np.float32)),
        )
        < 1e-12
    )


def test_identity_error_hand_values():
    # p = q = 1/2 (k = 1) with eps = log 3: p + (1 - p) e^eps = 2, error |log 1 - log 2| = log 2
    assert S.identity_max_error([LN(0.5)], [LN(0.5)], [LN(3)]) == pytest.approx(LN(2), abs=1e-15)
    # p = 0.2, q = 0.5 (k = 0.4) with eps = 0: rhs = 1, error |log 0.4| = log 2.5; the NaN token is skipped
    err = S.identity_max_error([LN(0.2), LN(0.5), 0.0], [LN(0.5), LN(0.5), LN(0.5)], [0.0, 0.0, np.nan])
    assert err == pytest.approx(LN(2.5), abs=1e-15)
    assert math.isnan(S.identity_max_error([0.0], [LN(0.5)], [np.nan]))


# ----------------------------------------------------------------------------- eps statistics


def test_eps_stats_hand_values():
    logp, eps = tokens(0.5, [-3.0, -0.5, 0.0, 0.5, 1.5])
    logp, logq = np.append(logp, 0.0), np.append(logq_from_eps(logp, eps), LN(0.5))  # + a token with p = 1
    out = S.eps_stats(logp, logq)
    assert (out["tokens"], out["finite"]) == (6, 5)
    assert out["finite_frac"] == pytest.approx(5 / 6)
    assert out["mean"] == pytest.approx(-0.3, abs=1e-12)  # -1.5 / 5
    # deviations -2.7, -0.2, 0.3, 0.8, 1.8: squares 7.29 + .04 + .09 + .64 + 3.24 = 11.3, variance 2.26
    assert out["sd"] == pytest.approx(math.sqrt(2.26), abs=1e-12)
    # |eps| sorted 0, .5, .5, 1.5, 3: positions 3.8, 3.96, 3.996 between 1.5 and 3
    assert out["q95_abs"] == pytest.approx(2.7, abs=1e-12)
    assert out["q99_abs"] == pytest.approx(2.94, abs=1e-12)
    assert out["q99.9_abs"] == pytest.approx(2.994, abs=1e-12)
    assert out["frac_abs_gt_1"] == pytest.approx(0.4)  # 3, 1.5
    assert out["frac_abs_gt_2"] == pytest.approx(0.2)  # 3
    assert out["max_abs"] == pytest.approx(3.0, abs=1e-12)


def test_eps_by_confidence_eps_columns_and_edges():
    lp0, e0 = tokens(0.3, [-1.0, 0.0, 0.5, 2.0, 10.0])  # p < 0.5
    lp1, e1 = tokens(0.5, [0.25])  # log p = log 0.5 exactly: the edge belongs to "0.5<=p<0.9"
    lp4, e4 = tokens(0.999, [-0.2, 0.2])  # log p = log 0.999 exactly: "p>=0.999"
    logp = np.concatenate([lp0, lp1, lp4, [0.0]])  # + p = 1: eps not finite, counted nowhere
    logq = np.concatenate([logq_from_eps(lp0, e0), logq_from_eps(lp1, e1), logq_from_eps(lp4, e4), [LN(0.9)]])
    out = S.eps_by_confidence(logp, logq)
    assert out["labels"] == ["p<0.5", "0.5<=p<0.9", "0.9<=p<0.99", "0.99<=p<0.999", "p>=0.999"]
    np.testing.assert_array_equal(out["tokens"], [5, 1, 0, 0, 2])
    nan = np.nan
    # bin 0: median 0.5; |eps - 0.5| = 1.5, .5, 0, 1.5, 9.5 -> MAD 1.5; q05 at position 0.2: -1 + 0.2 * 1 = -0.8;
    # q95 at position 3.8: 2 + 0.8 * 8 = 8.4. bin 4: median 0, MAD 0.2, q05 = -0.2 + 0.05 * 0.4 = -0.18
    np.testing.assert_allclose(out["median_eps"], [0.5, 0.25, nan, nan, 0.0], atol=1e-12)
    np.testing.assert_allclose(out["mad_eps"], [1.5, 0.0, nan, nan, 0.2], atol=1e-12)
    np.testing.assert_allclose(out["q05_eps"], [-0.8, 0.25, nan, nan, -0.18], atol=1e-12)
    np.testing.assert_allclose(out["q95_eps"], [8.4, 0.25, nan, nan, 0.18], atol=1e-12)


def test_eps_by_confidence_mad_logk():
    logp, logk = tokens(0.3, [-0.3, -0.1, 0.0, 0.2, 0.25])
    out = S.eps_by_confidence(logp, logp - logk)
    # median 0; |log k| sorted 0, .1, .2, .25, .3 -> MAD 0.2
    assert out["mad_logk"][0] == pytest.approx(0.2, abs=1e-12)


def test_uncertainty_bins_eps():
    edges = [1e-3, 1e-2, 1e-1, 1.0]
    groups = [(1 - 5e-3, [-1.0, 0.0, 1.0]), (0.95, [-0.2, 0.0, 0.2, 0.6]), (0.5, [0.3]), (1 - 1e-4, [7.0])]
    logp = np.concatenate([np.full(len(e), math.log1p(-(1 - p))) for p, e in groups])
    logq = logq_from_eps(logp, np.concatenate([e for _, e in groups]))
    out = S.uncertainty_bins(logp, logq, edges)  # 1 - p = 1e-4 lies below edges[0]: dropped
    np.testing.assert_array_equal(out["tokens"], [3, 4, 1])
    np.testing.assert_allclose(out["centers"], [10**-2.5, 10**-1.5, 10**-0.5], rtol=1e-12)
    # bin 1: median 0.1, |eps - 0.1| = .3, .1, .1, .5 -> MAD 0.2
    np.testing.assert_allclose(out["median_eps"], [0.0, 0.1, 0.3], atol=1e-12)
    np.testing.assert_allclose(out["mad_eps"], [1.0, 0.2, 0.0], atol=1e-12)
    assert out["mad_eps_ratio"] == math.inf  # the one-token bin has MAD 0
    assert out["max_abs_median_eps"] == pytest.approx(0.3, abs=1e-12)
    out = S.uncertainty_bins(logp, logq, edges, min_tokens=2)  # the one-token bin no longer counts
    assert out["mad_eps_ratio"] == pytest.approx(5.0, rel=1e-12)  # 1 / 0.2
    assert out["max_abs_median_eps"] == pytest.approx(0.1, abs=1e-12)


def test_uncertainty_bins_mad_logk():
    lp_a, k_a = tokens(0.95, [0.0, 0.01, -0.01, 0.05])  # 1 - p = 0.05: median 0.005, |dev| .005 .005 .015 .045
    lp_b, k_b = tokens(0.5, [-0.1, 0.0, 0.3])  # 1 - p = 0.5: median 0, MAD 0.1
    logp, logk = np.concatenate([lp_a, lp_b]), np.concatenate([k_a, k_b])
    out = S.uncertainty_bins(logp, logp - logk, [1e-2, 1e-1, 1.0])
    np.testing.assert_allclose(out["mad_logk"], [0.01, 0.1], atol=1e-12)
    assert out["mad_logk_ratio"] == pytest.approx(10.0, rel=1e-9)


def test_uncertainty_edges():
    e = S.UNCERTAINTY_EDGES  # 18 bins of a third of a decade, 1e-6 ... 1
    assert e.size == 19 and e[0] == pytest.approx(1e-6) and e[-1] == 1.0
    centers = np.sqrt(e[:-1] * e[1:])
    assert centers[0] == pytest.approx(1.47e-6, rel=1e-2) and centers[-1] == pytest.approx(0.681, rel=1e-3)
    f = S.floor_uncertainty_edges(5e-3)
    assert f.size == 19 and f[0] == 5e-3 and f[-1] == 1.0
    np.testing.assert_allclose(f[1:] / f[:-1], (1 / 5e-3) ** (1 / 18))
    with pytest.raises(ValueError):
        S.floor_uncertainty_edges(0.0)


# ----------------------------------------------------------------------------- Spearman


def test_average_ranks_ties():
    np.testing.assert_array_equal(S.average_ranks(np.array([10.0, 20.0, 20.0, 5.0])), [2.0, 3.5, 3.5, 1.0])


def test_spearman_hand_values():
    x = np.array([0.3, -1.0, 2.0, 0.0, 5.0, 1.5])
    assert S.spearman(x, np.exp(x)) == pytest.approx(1.0)  # monotone transform
    assert S.spearman(x, -(x**3)) == pytest.approx(-1.0)  # reversed
    # x ranks 1, 2.5, 2.5, 4 vs y ranks 1, 3, 2, 4: dot of deviations 4.5, sums of squares 4.5 and 5 -> 3 / sqrt(10)
    assert S.spearman([1.0, 2.0, 2.0, 3.0], [1.0, 3.0, 2.0, 4.0]) == pytest.approx(3 / math.sqrt(10))
    # x ranks 1.5, 1.5, 3.5, 3.5: dot 4, sums of squares 4 and 5 -> 2 / sqrt(5)
    assert S.spearman([1.0, 1.0, 2.0, 2.0], [1.0, 2.0, 3.0, 4.0]) == pytest.approx(2 / math.sqrt(5))
    assert math.isnan(S.spearman([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match="values"):
        S.spearman([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="finite"):
        S.spearman([1.0, np.nan], [1.0, 2.0])


def test_confidence_invariance_regions_and_correlations():
    u = np.array([1e-8, 2e-5, 2e-4, 2e-2, 0.2, 0.5])  # 1 - p; 1e-8 is below the 1e-7 retention
    eps = np.array([5.0, 0.5, 0.4, 0.3, 0.2, -0.25])
    logp = np.log1p(-u)
    out = S.confidence_invariance(logp, logq_from_eps(logp, eps), kappa=5e-3)
    a, f = out["all"], out["floor"]
    assert a["tokens_in_region"] == 5 and a["tokens"].sum() == 5
    assert f["tokens_in_region"] == 3 and f["tokens"].sum() == 3  # 1 - p >= 5e-3
    assert a["spearman_eps"] == pytest.approx(-1.0)  # eps falls as 1 - p grows
    # |eps| = .5 .4 .3 .2 .25: ranks 5 4 3 1 2 vs 1..5: dot -9, squares 10 and 10 -> -0.9
    assert a["spearman_abs_eps"] == pytest.approx(-0.9)
    assert f["spearman_eps"] == pytest.approx(-1.0)
    # |eps| = .3 .2 .25: ranks 3 1 2 vs 1 2 3: dot -1, squares 2 and 2 -> -0.5
    assert f["spearman_abs_eps"] == pytest.approx(-0.5)
    np.testing.assert_allclose(f["edges"], S.floor_uncertainty_edges(5e-3))
    same = S.confidence_invariance(logp, logq_from_eps(logp, eps), kappa=5e-3, max_tokens=5)
    assert same["all"]["spearman_abs_eps"] == pytest.approx(-0.9)


# ----------------------------------------------------------------------------- moments, variance, bias


def test_displacement_moments_hand_values():
    logp, eps = tokens(0.5, [0.0, LN(2)])
    logp, logq = np.append(logp, 0.0), np.append(logq_from_eps(logp, eps), LN(0.5))  # + p = 1: not counted
    out = S.displacement_moments(logp, logq, alphas=[0.0, 0.5, 1.0, 2.0])
    assert out["tokens"] == 2
    # e^{alpha eps} = 1 and 2^alpha; ((1 - p) e^eps)^alpha = 0.5^alpha and 1
    np.testing.assert_allclose(out["raw"], [1.0, (1 + math.sqrt(2)) / 2, 1.5, 2.5], rtol=1e-12)
    np.testing.assert_allclose(out["weighted"], [1.0, (math.sqrt(0.5) + 1) / 2, 0.75, 0.625], rtol=1e-12)


def test_variance_share_by_side_hand_values():
    k = np.array([2.0, 0.5, 1.0, 1.5])
    logp = np.full(5, LN(0.25))
    logq = np.append(logp[:4] - np.log(k), -np.inf)  # + q = 0: log k not finite, not counted
    out = S.variance_share_by_side(logp, logq)
    # (k - 1)^2 = 1, .25, 0, .25: sum 1.5; k > 1: 1.25, k < 1: .25
    assert out["tokens"] == 4 and out["center"] == 1.0
    assert out["var"] == pytest.approx(0.375)
    assert out["share_upper"] == pytest.approx(5 / 6)
    assert out["share_lower"] == pytest.approx(1 / 6)
    assert out["share_at_one"] == pytest.approx(0.0, abs=1e-12)
    out = S.variance_share_by_side(logp, logq, center=None)
    # mean 1.25: (k - 1.25)^2 = .5625, .5625, .0625, .0625: sum 1.25
    assert out["center"] == pytest.approx(1.25)
    assert out["var"] == pytest.approx(0.3125)
    assert out["share_upper"] == pytest.approx(0.5)
    assert out["share_lower"] == pytest.approx(0.45)
    assert out["share_at_one"] == pytest.approx(0.05)


def test_truncation_bias_hand_values():
    p = np.array([0.5, 0.999, 0.2, 0.2, 0.95])
    k = np.array([3.0, 1.5, 0.5, 4.0, 1.05])
    logp = np.log(p)
    out = S.truncation_bias(logp, logp - np.log(k), lam=2.3, kappa=5e-3, cap=2.0)
    # CIS caps 1 + 2.3 max(1 - p, 5e-3): 2.15, 1.0115 (the floor), 2.84, 2.84, 1.115 -> excess .85, .4885, 0, 1.16, 0
    # TIS cap 2 -> excess 1, 0, 0, 2, 0. Bins: p<0.5 {0.2, 0.2}, [0.5, 0.9) {0.5}, [0.9, 0.99) {0.95}, p>=0.999
    np.testing.assert_array_equal(out["tokens"], [2, 1, 1, 0, 1])
    np.testing.assert_allclose(out["cis_excess_sum"], [1.16, 0.85, 0.0, 0.0, 0.4885], atol=1e-12)
    np.testing.assert_allclose(out["cis_bias"], [0.58, 0.85, 0.0, np.nan, 0.4885], atol=1e-12)
    np.testing.assert_array_equal(out["cis_acted"], [1, 1, 0, 0, 1])
    np.testing.assert_allclose(out["tis_bias"], [1.0, 1.0, 0.0, np.nan, 0.0], atol=1e-12)
    np.testing.assert_array_equal(out["tis_acted"], [1, 1, 0, 0, 0])
    assert out["cis_bias_total"] == pytest.approx(2.4985 / 5)
    assert out["tis_bias_total"] == pytest.approx(0.6)


# ----------------------------------------------------------------------------- bad inputs

OPERATORS = dict(lam=2.3, kappa=5e-3, cap=2.0)
LOGPROB_FUNCS = [
    S.eps_from_logprobs,
    S.eps_stats,
    S.eps_by_confidence,
    S.uncertainty_bins,
    functools.partial(S.confidence_invariance, kappa=5e-3),
    S.displacement_moments,
    S.variance_share_by_side,
    functools.partial(S.truncation_bias, **OPERATORS),
]


@pytest.mark.parametrize("fn", LOGPROB_FUNCS, ids=lambda f: getattr(f, "func", f).__name__)
def test_bad_logprobs_raise(fn):
    with pytest.raises(ValueError, match="logp has 3 tokens but logq has 2"):
        fn(np.log([0.5, 0.5, 0.5]), np.log([0.5, 0.5]))
    with pytest.raises(ValueError, match="positive"):
        fn(np.array([-0.1, 0.2]), np.array([-0.1, -0.1]))
    with pytest.raises(ValueError, match="NaN"):
        fn(np.array([-0.1, -0.2]), np.array([np.nan, -0.1]))
    with pytest.raises(ValueError, match="flat"):
        fn(np.full((2, 2), -0.1), np.full((2, 2), -0.1))


def test_identity_max_error_bad_eps():
    with pytest.raises(ValueError, match="eps has 1 tokens"):
        S.identity_max_error([-0.1, -0.2], [-0.1, -0.2], [0.0])


def test_bad_bin_edges():
    with pytest.raises(ValueError, match="p_edges"):
        S.eps_by_confidence([-0.1], [-0.1], p_edges=(0.9, 0.5))
    with pytest.raises(ValueError, match="edges"):
        S.uncertainty_bins([-0.1], [-0.1], edges=[0.0, 0.5, 1.0])
