"""Correction operators against hand-computed values and an independent numpy float64 reference."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from cisjax import config as config_lib
from cisjax.rl import corrections as C

# The paper's hyperparameters (Table 7), which the hand-computed values below assume; correction() has no defaults.
PAPER = dict(lam=2.3, kappa=5e-3, cap=2.0, threshold=2.0)

TOKEN_METHODS = ("none", "exact", "tis", "icepop", "kpop", "kpop_shipped", "gspo", "fp16", "cis", "cis_two_sided")
METRIC_KEYS = {
    "acted_frac",
    "acted_seq_frac",
    "abs_logk_mean",
    "abs_logk_max",
    "logk_mean",
    "k3",
    "chi2",
    "weight_mean",
    "weight_max",
    "tokens",
    "seqs",
    "nan_logprobs",
    "nonfinite_logk",
}
LOG_EPS = 1e-8  # KPop's clamp


def logs32(x):
    """fp32 log-probabilities of float64 probabilities (the engines hand us fp32 logprobs)."""
    with np.errstate(divide="ignore"):
        return np.log(np.asarray(x, np.float64)).astype(np.float32)


@functools.cache
def _jitted(variants):
    """One jit over several (method, hyperparameters) variants: one compile per input shape keeps the file fast."""
    return jax.jit(lambda lp, lq, mask: [C.correction(m, lp, lq, mask, **{**PAPER, **dict(kw)}) for m, kw in variants])


_RESULTS = {}


def run_many(variants, lp, lq, mask=None):
    """[(weights, acted, metrics)] as numpy for [(method, kwargs)], through jit (as the train step calls it)."""
    lp, lq = np.asarray(lp), np.asarray(lq)
    mask = np.ones(lp.shape, bool) if mask is None else np.asarray(mask, bool)
    variants = tuple((m, tuple(sorted(kw.items()))) for m, kw in variants)
    key = (variants, lp.dtype.str, lp.shape, lp.tobytes(), lq.tobytes(), mask.tobytes())
    if key not in _RESULTS:
        _RESULTS[key] = [
            (np.asarray(o.weights_BxT), np.asarray(o.acted_BxT), {k: float(v) for k, v in o.metrics.items()})
            for o in _jitted(variants)(lp, lq, mask)
        ]
    return _RESULTS[key]


def run(method, lp, lq, mask=None, methods=None, **kw):
    """(weights, acted, metrics) of one method; with default hyperparameters every method (or those in `methods`)
    is computed in the same jit and memoised per input."""
    if kw:
        return run_many([(method, kw)], lp, lq, mask)[0]
    methods = tuple(methods or C.METHODS)
    return run_many([(m, {}) for m in methods], lp, lq, mask)[methods.index(method)]


# ----------------------------------------------------------------------------- numpy float64 reference


def _kl64(a, b):
    return a * np.log(a / b) + (1 - a) * np.log((1 - a) / (1 - b))


def ref_kpop_metric(lp, lq):
    """KPop-dagger in float64: clamp p, q to [1e-8, 1 - 1e-8], max of both binary KLs, NaN -> 0."""
    p = np.clip(np.exp(np.asarray(lp, np.float64)), LOG_EPS, 1 - LOG_EPS)
    q = np.clip(np.exp(np.asarray(lq, np.float64)), LOG_EPS, 1 - LOG_EPS)
    with np.errstate(all="ignore"):
        m = np.maximum(_kl64(p, q), _kl64(q, p))
    return np.where(np.isnan(m), 0.0, m)


def ref_kpop_shipped_keep(lp, lq, phi):
    """The shipped operator literally, in numpy float32: NaN / inf metric fails the bounds check."""
    f = np.float32
    p = np.clip(np.exp(np.asarray(lp, f)), f(1e-8), f(1 - 1e-8))
    q = np.clip(np.exp(np.asarray(lq, f)), f(1e-8), f(1 - 1e-8))
    with np.errstate(all="ignore"):
        kl = lambda a, b: a * np.log(a / b) + (f(1) - a) * np.log((f(1) - a) / (f(1) - b))  # noqa: E731
        m = np.maximum(kl(p, q), kl(q, p))
    return m <= phi


def reference(method, lp, lq, mask, lam=2.3, kappa=5e-3, cap=2.0, low=None, high=None, threshold=2.0):
    """(weights, acted, metrics) in float64, written from operators.md independently of the code under test."""
    lp = np.asarray(lp).astype(np.float64)
    lq = np.asarray(lq).astype(np.float64)
    mask = np.asarray(mask, bool)
    nan = mask & (np.isnan(lp) | np.isnan(lq))
    with np.errstate(all="ignore"):
        raw = lp - lq
    logk = np.where(mask & np.isfinite(raw), raw, 0.0)
    k = np.exp(logk)
    p = np.exp(np.minimum(np.where(mask & ~nan, lp, 0.0), 0.0))
    has = mask.any(1)
    seq_acted = None
    if method in ("none", "gspo", "fp16"):
        w, acted = np.ones_like(k), np.zeros_like(mask)
    elif method == "exact":
        w, acted = np.clip(k, 1e-6, 1e6), (k < 1e-6) | (k > 1e6)
    elif method == "tis":
        w, acted = np.minimum(k, cap), k > cap
    elif method == "icepop":
        lo, hi = (0.5, 5.0) if low is None else (low, high)
        keep = (k >= lo) & (k <= hi)
        w, acted = np.where(keep, k, 0.0), ~keep
    elif method == "kpop":
        keep = ref_kpop_metric(lp, lq) <= threshold
        w, acted = np.where(keep, np.clip(k, 1e-6, 1e6), 0.0), ~keep
    elif method == "kpop_shipped":
        keep = ref_kpop_shipped_keep(lp, lq, threshold)
        w, acted = np.where(keep, np.clip(k, 1e-6, 1e6), 0.0), ~keep
    elif method in ("seq_tis", "seq_mis"):
        big_k = np.exp(np.clip(np.where(mask, logk, 0.0).sum(1), -20, 20))
        if method == "seq_tis":
            wb, ab = np.minimum(big_k, cap), big_k > cap
        else:
            lo, hi = (0.5, 2.0) if low is None else (low, high)
            keep = (big_k >= lo) & (big_k <= hi)
            wb, ab = np.where(keep, big_k, 0.0), ~keep
        seq_acted = ab & has
        w, acted = np.repeat(wb[:, None], k.shape[1], 1), np.repeat(seq_acted[:, None], k.shape[1], 1)
    elif method in ("cis", "cis_two_sided"):
        c = 1 + lam * np.maximum(1 - p, kappa)
        w, acted = np.minimum(k, c), k > c
        if method == "cis_two_sided":
            floor = (1 + p) / 2
            w, acted = np.maximum(w, floor), acted | (k < floor)
    else:
        raise AssertionError(method)
    valid = mask & ~nan
    w = np.where(valid, w, 0.0)
    acted = acted & valid
    if seq_acted is None:
        seq_acted = acted.any(1)
    n = max(mask.sum(), 1)
    metrics = dict(
        acted_frac=acted.sum() / n,
        acted_seq_frac=(seq_acted & has).sum() / max(has.sum(), 1),
        abs_logk_mean=np.abs(logk)[mask].sum() / n,
        abs_logk_max=np.abs(logk)[mask].max(initial=0.0),
        logk_mean=logk[mask].sum() / n,
        k3=(k - 1 - logk)[mask].sum() / n,
        chi2=(k**2)[mask].sum() / n - (1.0 if mask.any() else 0.0),
        weight_mean=w.sum() / n,
        weight_max=w.max(initial=0.0),
        tokens=float(mask.sum()),
        seqs=float(has.sum()),
        nan_logprobs=float(nan.sum()),
        nonfinite_logk=float((mask & ~np.isfinite(raw) & ~nan).sum()),
    )
    return w, acted, metrics


def random_batch(seed, b=8, t=24):
    """p log-uniform over [1e-6, 1] with some exact ones, heavy-tailed log-odds displacement, ragged masks, one
    all-masked row; returns fp32 logprobs."""
    rng = np.random.default_rng(seed)
    logit_p = rng.uniform(-14, 9, (b, t))
    eps = rng.standard_t(2, (b, t)) * 0.7
    lp = -np.logaddexp(0, -logit_p)  # log sigmoid
    lq = -np.logaddexp(0, -(logit_p - eps))
    lp[rng.random((b, t)) < 0.1] = 0.0
    lq[rng.random((b, t)) < 0.05] = 0.0
    lengths = rng.integers(1, t + 1, b)
    lengths[3] = 0
    mask = np.arange(t)[None] < lengths[:, None]
    return lp.astype(np.float32), lq.astype(np.float32), mask


# ----------------------------------------------------------------------------- hand-built batch

# Row 0: k = 1, 3, 0.4, 1.1.  Row 1: k = 19 (binary KL 2.65 > 2), p = q = 1, then two padding tokens.
P = [[0.5, 0.9, 0.2, 0.99], [0.95, 1.0, 0.3, 0.3]]
Q = [[0.5, 0.3, 0.5, 0.9], [0.05, 1.0, 0.3, 0.3]]
MASK = [[1, 1, 1, 1], [1, 1, 0, 0]]
# CIS caps 1 + 2.3 * max(1 - p, 5e-3): 2.15, 1.23, 2.84, 1.023 / 1.115, 1.0115; two-sided floors (1 + p) / 2:
# 0.75, 0.95, 0.6, 0.995 / 0.975, 1.
HAND = {
    "none": ([[1, 1, 1, 1], [1, 1, 0, 0]], [[0, 0, 0, 0], [0, 0, 0, 0]]),
    "gspo": ([[1, 1, 1, 1], [1, 1, 0, 0]], [[0, 0, 0, 0], [0, 0, 0, 0]]),
    "fp16": ([[1, 1, 1, 1], [1, 1, 0, 0]], [[0, 0, 0, 0], [0, 0, 0, 0]]),
    "exact": ([[1, 3, 0.4, 1.1], [19, 1, 0, 0]], [[0, 0, 0, 0], [0, 0, 0, 0]]),
    "tis": ([[1, 2, 0.4, 1.1], [2, 1, 0, 0]], [[0, 1, 0, 0], [1, 0, 0, 0]]),
    "icepop": ([[1, 3, 0, 1.1], [0, 1, 0, 0]], [[0, 0, 1, 0], [1, 0, 0, 0]]),
    # binary KLs: (0.9, 0.3) -> max 1.033, (0.2, 0.5) -> 0.223, (0.99, 0.9) -> 0.145, (0.95, 0.05) -> 2.650
    "kpop": ([[1, 3, 0.4, 1.1], [0, 1, 0, 0]], [[0, 0, 0, 0], [1, 0, 0, 0]]),
    "kpop_shipped": ([[1, 3, 0.4, 1.1], [0, 0, 0, 0]], [[0, 0, 0, 0], [1, 1, 0, 0]]),  # p = q = 1 -> NaN -> masked
    "seq_tis": ([[1.32] * 4, [2, 2, 0, 0]], [[0, 0, 0, 0], [1, 1, 0, 0]]),  # K = 1 * 3 * 0.4 * 1.1 = 1.32; 19
    "seq_mis": ([[1.32] * 4, [0, 0, 0, 0]], [[0, 0, 0, 0], [1, 1, 0, 0]]),
    "cis": ([[1, 1.23, 0.4, 1.023], [1.115, 1, 0, 0]], [[0, 1, 0, 1], [1, 0, 0, 0]]),
    "cis_two_sided": ([[1, 1.23, 0.6, 1.023], [1.115, 1, 0, 0]], [[0, 1, 1, 1], [1, 0, 0, 0]]),
}


def test_methods_listed():
    assert set(HAND) == set(C.METHODS) and len(C.METHODS) == 12


@pytest.mark.parametrize("method", C.METHODS)
def test_hand_batch(method):
    w, acted, m = run(method, logs32(P), logs32(Q), MASK)
    w_hand, acted_hand = HAND[method]
    assert w.dtype == np.float32
    np.testing.assert_allclose(w, np.array(w_hand, np.float64), rtol=1e-5, atol=0)
    np.testing.assert_array_equal(acted, np.array(acted_hand, bool))
    assert set(m) == METRIC_KEYS
    acted_hand = np.array(acted_hand, bool)
    assert m["acted_frac"] == pytest.approx(acted_hand.sum() / 6)
    assert m["acted_seq_frac"] == pytest.approx(acted_hand.any(1).sum() / 2)
    assert m["weight_mean"] == pytest.approx(np.sum(w_hand) / 6, rel=1e-5)
    assert m["weight_max"] == pytest.approx(np.max(w_hand), rel=1e-5)
    assert (m["tokens"], m["seqs"], m["nan_logprobs"], m["nonfinite_logk"]) == (6, 2, 0, 0)
    # log k over the 6 valid tokens: 0, ln 3, ln 0.4, ln 1.1, ln 19, 0
    logk = np.log([1, 3, 0.4, 1.1, 19, 1])
    k = np.exp(logk)
    assert m["logk_mean"] == pytest.approx(logk.mean(), rel=1e-5)
    assert m["abs_logk_mean"] == pytest.approx(np.abs(logk).mean(), rel=1e-5)
    assert m["abs_logk_max"] == pytest.approx(math.log(19), rel=1e-5)
    assert m["k3"] == pytest.approx(np.mean(k - 1 - logk), rel=1e-5)
    assert m["chi2"] == pytest.approx((1 + 9 + 0.16 + 1.21 + 361 + 1) / 6 - 1, rel=1e-5)


# ----------------------------------------------------------------------------- edge cases, by hand

E20 = math.exp(20)
HUGE_LQ = -103.0  # q = e^-103: k = 0.05 * e^103 overflows fp32; the KPop metric sees q clamped to 1e-8
# (name, log p, log q, {method: weight}); methods left out weigh what "exact" weighs with k = 1 (weight 1).
EDGES = [
    ("p=q=1", 0.0, 0.0, dict(kpop_shipped=0)),
    # k = 1/0.999; dagger KL(q||p) = 0.0105; shipped: NaN; cap 1 + 2.3 * 5e-3 = 1.0115 > k
    (
        "p=1",
        0.0,
        logs32(0.999),
        dict(
            exact=1 / 0.999,
            tis=1 / 0.999,
            icepop=1 / 0.999,
            kpop=1 / 0.999,
            kpop_shipped=0,
            seq_tis=1 / 0.999,
            seq_mis=1 / 0.999,
            cis=1 / 0.999,
            cis_two_sided=1 / 0.999,
        ),
    ),
    # k = 0.999; two-sided floor (1 + 0.999)/2 = 0.9995 lifts it
    (
        "q=1",
        logs32(0.999),
        0.0,
        dict(
            exact=0.999,
            tis=0.999,
            icepop=0.999,
            kpop=0.999,
            kpop_shipped=0,
            seq_tis=0.999,
            seq_mis=0.999,
            cis=0.999,
            cis_two_sided=0.9995,
        ),
    ),
    # k = 0.01; both clamp to 1e-8 in the KPop metric (KL 0); Seq-MIS rejects K = 0.01; floor 0.5
    (
        "p<<1",
        logs32(1e-12),
        logs32(1e-10),
        dict(
            exact=0.01,
            tis=0.01,
            icepop=0,
            kpop=0.01,
            kpop_shipped=0.01,
            seq_tis=0.01,
            seq_mis=0,
            cis=0.01,
            cis_two_sided=0.5,
        ),
    ),
    # k = 5e8: KL(p||q) = 0.5 ln(0.5/1e-8) + 0.5 ln(0.5/(1-1e-8)) = 8.52 > 2; K clipped to e^20
    (
        "k>>1e6",
        logs32(0.5),
        logs32(1e-9),
        dict(exact=1e6, tis=2, icepop=0, kpop=0, kpop_shipped=0, seq_tis=2, seq_mis=0, cis=2.15, cis_two_sided=2.15),
    ),
    # k = inf in fp32; KL = max(0.05 ln(0.05/1e-8) + 0.95 ln 0.95, ...) = 0.72: KPop keeps it at the 1e6 clamp
    (
        "k=inf kept",
        logs32(0.05),
        HUGE_LQ,
        dict(
            exact=1e6,
            tis=2,
            icepop=0,
            kpop=1e6,
            kpop_shipped=1e6,
            seq_tis=2,
            seq_mis=0,
            cis=1 + 2.3 * 0.95,
            cis_two_sided=1 + 2.3 * 0.95,
        ),
    ),
    # k = 2e-9: KL(q||p) = 8.52; K = e^-20 after the clip; floor (1 + 1e-9)/2
    (
        "k<<1e-6",
        logs32(1e-9),
        logs32(0.5),
        dict(
            exact=1e-6,
            tis=2e-9,
            icepop=0,
            kpop=0,
            kpop_shipped=0,
            seq_tis=1 / E20,
            seq_mis=0,
            cis=2e-9,
            cis_two_sided=0.5,
        ),
    ),
    # q = 0: log k = +inf -> treated as 0 (k = 1); KPop still masks on KL(p||1e-8) = 8.52
    ("q=0", logs32(0.5), -np.inf, dict(kpop=0, kpop_shipped=0)),
    # p = 0: log k = -inf -> k = 1; KL(q||1e-8) = 8.52
    ("p=0", -np.inf, logs32(0.5), dict(kpop=0, kpop_shipped=0)),
    ("p=q=0", -np.inf, -np.inf, dict(cis_two_sided=1)),
]
ACTED = {  # (name, method) pairs acted on
    ("p=q=1", "kpop_shipped"),
    ("p=1", "kpop_shipped"),
    ("q=1", "kpop_shipped"),
    ("q=1", "cis_two_sided"),
    ("p<<1", "icepop"),
    ("p<<1", "seq_mis"),
    ("p<<1", "cis_two_sided"),
    ("k>>1e6", "exact"),
    ("k>>1e6", "tis"),
    ("k>>1e6", "icepop"),
    ("k>>1e6", "kpop"),
    ("k>>1e6", "kpop_shipped"),
    ("k>>1e6", "seq_tis"),
    ("k>>1e6", "seq_mis"),
    ("k>>1e6", "cis"),
    ("k>>1e6", "cis_two_sided"),
    ("k=inf kept", "exact"),
    ("k=inf kept", "tis"),
    ("k=inf kept", "icepop"),
    ("k=inf kept", "seq_tis"),
    ("k=inf kept", "seq_mis"),
    ("k=inf kept", "cis"),
    ("k=inf kept", "cis_two_sided"),
    ("k<<1e-6", "exact"),
    ("k<<1e-6", "icepop"),
    ("k<<1e-6", "kpop"),
    ("k<<1e-6", "kpop_shipped"),
    ("k<<1e-6", "seq_mis"),
    ("k<<1e-6", "cis_two_sided"),
    ("q=0", "kpop"),
    ("q=0", "kpop_shipped"),
    ("p=0", "kpop"),
    ("p=0", "kpop_shipped"),
}


@pytest.mark.parametrize("method", C.METHODS)
def test_edge_cases(method):
    lp = np.array([[e[1]] for e in EDGES], np.float32)
    lq = np.array([[e[2]] for e in EDGES], np.float32)
    w, acted, m = run(method, lp, lq)
    for i, (name, _, _, expected) in enumerate(EDGES):
        want = expected.get(method, 1.0)
        assert np.isfinite(w[i, 0]), name
        assert w[i, 0] == pytest.approx(want, rel=2e-5, abs=0), name
        assert bool(acted[i, 0]) == ((name, method) in ACTED), name
    # k = 0.05 e^103 overflows fp32: the moments of k are inf (honestly), every other metric is finite
    assert m["k3"] == np.inf and m["chi2"] == np.inf
    assert all(np.isfinite(v) for k, v in m.items() if k not in ("k3", "chi2"))
    assert m["nonfinite_logk"] == 3 and m["nan_logprobs"] == 0
    assert not any(math.isnan(v) for v in m.values())


def test_bf16_rounded_probabilities():
    """A bf16 engine rounds p = 0.9999 to 1 and q = 0.998 to 1 - 2^-8: p == 1 exactly."""
    p_bf = np.asarray(jnp.asarray([0.9999, 0.5, 0.3], jnp.bfloat16)).astype(np.float64)
    q_bf = np.asarray(jnp.asarray([0.998, 0.51, 0.2], jnp.bfloat16)).astype(np.float64)
    assert p_bf[0] == 1.0 and q_bf[0] == 1 - 2**-8
    lp = jnp.asarray(np.log(p_bf)[None], jnp.bfloat16)  # bf16 logprobs, as a bf16 trainer stores them
    lq = jnp.asarray(np.log(q_bf)[None], jnp.bfloat16)
    k0 = math.exp(-float(lq[0, 0]))  # log p = 0 exactly
    w_cis, acted_cis, _ = run("cis", lp, lq)
    assert w_cis[0, 0] == pytest.approx(k0, rel=1e-6) and not acted_cis[0, 0]  # cap 1.0115 > k = 1.0039
    w0, acted0, _ = run("cis", lp, lq, kappa=0.0)  # without the floor the cap is 1: truncates rounding error
    assert w0[0, 0] == 1.0 and acted0[0, 0]
    assert run("kpop", lp, lq)[1][0].tolist() == [False, False, False]
    assert run("kpop_shipped", lp, lq)[1][0].tolist() == [True, False, False]
    mask = np.ones((1, 3), bool)
    for method in C.METHODS:
        w, acted, m = run(method, lp, lq)
        w_ref, acted_ref, m_ref = reference(method, np.asarray(lp), np.asarray(lq), mask)
        np.testing.assert_allclose(w, w_ref, rtol=1e-5, atol=0, err_msg=method)
        np.testing.assert_array_equal(acted, acted_ref, err_msg=method)


def test_kpop_shipped_intervention_rate():
    """The 21.9% effect: the shipped fp32 metric masks every token with p == 1 or q == 1; KPop-dagger only the
    tokens whose binary KL exceeds phi."""
    both_one, one_one, over, normal = 165, 28, 5, 802  # per 1000 tokens, as in the paper's KPop run
    lp = [0.0] * both_one + [0.0] * 14 + [logs32(0.995)] * 14 + [logs32(0.95)] * over + [logs32(0.6)] * normal
    lq = [0.0] * both_one + [logs32(0.999)] * 14 + [0.0] * 14 + [logs32(0.05)] * over + [logs32(0.5)] * normal
    lp, lq = np.array(lp, np.float32).reshape(10, 100), np.array(lq, np.float32).reshape(10, 100)
    kp = ("kpop", "kpop_shipped")
    _, _, shipped = run("kpop_shipped", lp, lq, methods=kp)
    _, _, dagger = run("kpop", lp, lq, methods=kp)
    assert shipped["acted_frac"] == pytest.approx((both_one + one_one + over) / 1000)
    assert dagger["acted_frac"] == pytest.approx(over / 1000)
    # rows of 100: the 198 shipped-masked tokens fill rows 0-1; the 5 over phi are tokens 193-197 (row 1)
    assert shipped["acted_seq_frac"] == pytest.approx(0.2) and dagger["acted_seq_frac"] == pytest.approx(0.1)
    # p = 1 in fp32 includes log p slightly below 0 (exp rounds to 1): still masked by the shipped metric
    lp_tiny = np.array([[-1e-9, -1e-9]], np.float32)
    lq_tiny = np.array([[0.0, logs32(0.9)]], np.float32)
    assert run("kpop_shipped", lp_tiny, lq_tiny, methods=kp)[1].tolist() == [[True, True]]
    assert run("kpop", lp_tiny, lq_tiny, methods=kp)[1].tolist() == [[False, False]]  # KL(1-1e-8 || 0.9) = 0.105


def test_kpop_metric_fp32_matches_float64():
    rng = np.random.default_rng(1)
    n = 20000
    lp = np.concatenate([rng.uniform(-30, 0, n), -(10.0 ** rng.uniform(-12, 0.5, n)), np.zeros(100)])
    lq = np.concatenate([rng.uniform(-30, 0, n), lp[n : 2 * n] + rng.normal(0, 3, n), rng.uniform(-25, 0, 100)])
    lq = np.minimum(lq, 0.0)
    lp, lq = lp.astype(np.float32)[None], lq.astype(np.float32)[None]
    ref = ref_kpop_metric(lp, lq)
    got = np.asarray(C.kpop_metric(lp, lq))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=2e-5)
    w, acted, _ = run("kpop", lp, lq, methods=("kpop",))
    far = np.abs(ref - 2.0) > 1e-4  # the decision equals float64's outside the fp32 rounding band around phi
    assert far.mean() > 0.999 and (ref <= 2).any() and (ref > 2).any()
    np.testing.assert_array_equal(acted[far], (ref > 2.0)[far])
    # the shipped metric is NaN or inf wherever p or q is exactly 1 in fp32
    shipped = np.asarray(C.kpop_metric(lp, lq, shipped=True))
    one = (lp == 0) | (lq == 0)
    assert one.any() and not np.isfinite(shipped[one]).any()


# ----------------------------------------------------------------------------- the paper's lemma


@pytest.mark.parametrize("lam", [2.3, 0.45])
def test_cis_weight_is_the_displacement_cap(lam):
    """min(k, 1 + lam * max(1 - p, kappa)) = p + (1 - p) min(e^eps, 1 + lam), eps = logit p - logit q, wherever
    1 - p >= kappa; below the floor the displacement cap loosens to 1 + lam * kappa / (1 - p)."""
    kappa = 5e-3
    rng = np.random.default_rng(2)
    n = 4000
    logit_p = np.concatenate([rng.uniform(-12, 5.2, n), rng.uniform(5.4, 16, n)])
    eps_true = rng.standard_t(2, 2 * n)
    lp = (-np.logaddexp(0, -logit_p)).astype(np.float32)
    lq = (-np.logaddexp(0, -(logit_p - eps_true))).astype(np.float32)
    lp64, lq64 = lp.astype(np.float64), lq.astype(np.float64)
    p = np.exp(lp64)
    eps = (lp64 - np.log(-np.expm1(lp64))) - (lq64 - np.log(-np.expm1(lq64)))  # from the fp32 inputs, in float64
    w, _, _ = run("cis", lp[None], lq[None], methods=("cis",), **({} if lam == 2.3 else dict(lam=lam)))
    above = 1 - p >= kappa
    assert above.sum() > 3000 and (~above).sum() > 3000
    expected = p + (1 - p) * np.minimum(np.exp(eps), 1 + lam)
    np.testing.assert_allclose(w[0][above], expected[above], rtol=2e-5)
    loose = p + (1 - p) * np.minimum(np.exp(eps), 1 + lam * kappa / (1 - p))
    np.testing.assert_allclose(w[0][~above], loose[~above], rtol=2e-5)


# ----------------------------------------------------------------------------- against the float64 reference


@pytest.mark.parametrize("method", C.METHODS)
def test_random_batch_against_reference(method):
    lp, lq, mask = random_batch(0)
    w, acted, m = run(method, lp, lq, mask)
    w_ref, acted_ref, m_ref = reference(method, lp, lq, mask)
    np.testing.assert_allclose(w, w_ref, rtol=2e-5, atol=0)
    np.testing.assert_array_equal(acted, acted_ref)
    assert set(m) == set(m_ref)
    for key in m:
        assert m[key] == pytest.approx(m_ref[key], rel=2e-5, abs=1e-7), key
    assert 0 < m["acted_frac"] < 1 or method in ("none", "gspo", "fp16", "exact")


def test_hparams():
    lp, lq, mask = random_batch(3)
    variants = [
        ("icepop", dict(low=0.7, high=1.5)),
        ("seq_mis", dict(low=0.3, high=30.0)),
        ("tis", dict(cap=1.13)),
        ("seq_tis", dict(cap=200.0)),
        ("cis", dict(lam=0.89, kappa=1e-2)),
        ("cis_two_sided", dict(lam=0.0)),
        ("kpop", dict(threshold=0.5)),
        ("kpop_shipped", dict(threshold=0.5)),
        ("icepop", dict(low=0.5, high=5.0)),
        ("seq_mis", dict(low=0.5, high=2.0)),
    ]
    results = run_many(variants, lp, lq, mask)
    for (method, kw), (w, acted, _) in zip(variants, results):
        w_ref, acted_ref, _ = reference(method, lp, lq, mask, **kw)
        np.testing.assert_allclose(w, w_ref, rtol=2e-5, atol=0, err_msg=f"{method} {kw}")
        np.testing.assert_array_equal(acted, acted_ref, err_msg=f"{method} {kw}")
        assert 0 < acted[mask].mean() < 1 or method == "seq_mis" and kw["high"] == 2.0, (method, kw)  # acts on some
    # low/high None are the method's defaults
    np.testing.assert_array_equal(run("icepop", lp, lq, mask)[0], results[-2][0])
    np.testing.assert_array_equal(run("seq_mis", lp, lq, mask)[0], results[-1][0])


# ----------------------------------------------------------------------------- masks, NaN, gradients


@pytest.mark.parametrize("method", C.METHODS)
def test_padding_is_ignored(method):
    lp, lq, mask = random_batch(4)
    clean_lp, clean_lq = np.where(mask, lp, 0.0), np.where(mask, lq, 0.0)
    junk = np.array([np.nan, np.inf, -np.inf, 5.0, -1e30], np.float32)
    idx = np.arange(lp.size).reshape(lp.shape) % junk.size
    dirty_lp = np.where(mask, lp, junk[idx])
    dirty_lq = np.where(mask, lq, junk[(idx + 2) % junk.size])
    w1, a1, m1 = run(method, clean_lp, clean_lq, mask)
    w2, a2, m2 = run(method, dirty_lp, dirty_lq, mask)
    np.testing.assert_array_equal(w1, w2)
    np.testing.assert_array_equal(a1, a2)
    assert m1 == m2
    assert (w1[~mask] == 0).all() and not a1[~mask].any()
    assert (w1[3] == 0).all() and m1["seqs"] == 7  # the all-masked row


@pytest.mark.parametrize("method", C.METHODS)
def test_all_masked(method):
    lp, lq, _ = random_batch(5)
    w, acted, m = run(method, lp, lq, np.zeros(lp.shape, bool))
    assert (w == 0).all() and not acted.any()
    assert m == {key: 0.0 for key in METRIC_KEYS}


def test_nan_logprobs_are_reported():
    lp = np.array([[logs32(0.5), np.nan, logs32(0.3)], [0.0, logs32(0.9), np.nan]], np.float32)
    lq = np.array([[logs32(0.4), logs32(0.2), np.nan], [0.0, logs32(0.8), 0.0]], np.float32)
    mask = np.array([[1, 1, 1], [1, 1, 0]], bool)  # the last NaN is padding
    for method in C.METHODS:
        w, acted, m = run(method, lp, lq, mask)
        assert m["nan_logprobs"] == 2 and m["nonfinite_logk"] == 0, method
        assert w[0, 1] == 0 and w[0, 2] == 0 and not acted[0, 1:].any(), method
        assert not any(math.isnan(v) for v in m.values()), method
        assert np.isfinite(w).all(), method
    checked = checkify.checkify(
        jax.jit(functools.partial(C.correction_weights, "cis", **PAPER)), errors=checkify.user_checks
    )
    err, _ = checked(lp, lq, mask)
    with pytest.raises(checkify.JaxRuntimeError, match="2 valid tokens have a NaN logprob"):
        err.throw()
    err, _ = checked(np.where(np.isnan(lp), 0.0, lp), np.where(np.isnan(lq), 0.0, lq), mask)
    err.throw()  # no NaN: no error


@pytest.mark.parametrize("method", C.METHODS)
def test_stop_gradient(method):
    lp, lq, mask = logs32(P), logs32(Q), np.array(MASK, bool)

    def f(lp, lq):
        w, m = C.correction_weights(method, lp, lq, mask, **PAPER)
        return jnp.sum(w) + sum(m.values())

    g_lp, g_lq = jax.grad(f, argnums=(0, 1))(jnp.asarray(lp), jnp.asarray(lq))
    assert not np.asarray(g_lp).any() and not np.asarray(g_lq).any()


def test_eager_equals_jit():
    lp, lq, mask = random_batch(6)
    for method in ("cis", "seq_mis", "kpop"):
        w, m = C.correction_weights(method, lp, lq, mask, **PAPER)
        w_j, _, m_j = run(method, lp, lq, mask)
        np.testing.assert_allclose(np.asarray(w), w_j, rtol=1e-6)
        assert {k: float(v) for k, v in m.items()} == pytest.approx(m_j, rel=1e-6)


# ----------------------------------------------------------------------------- combining micro-batches


@pytest.mark.parametrize("method", ["cis", "tis", "icepop", "kpop", "seq_tis", "seq_mis", "exact", "none"])
def test_combine_metrics_equals_whole_batch(method):
    lp, lq, mask = random_batch(7, b=8)
    _, _, whole = run(method, lp, lq, mask)
    empty = np.zeros_like(mask[:4])
    parts = [
        run(method, lp[:4], lq[:4], mask[:4])[2],
        run(method, lp[4:], lq[4:], empty)[2],
        run(method, lp[4:], lq[4:], mask[4:])[2],
    ]
    assert parts[1]["tokens"] == 0
    combined = {k: float(v) for k, v in C.combine_metrics(parts).items()}
    assert combined == pytest.approx(whole, rel=1e-5, abs=1e-7)
    # the stacked form (lax.scan's output)
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *parts)
    assert {k: float(v) for k, v in C.combine_metrics(stacked).items()} == pytest.approx(whole, rel=1e-5, abs=1e-7)


def test_combine_metrics_rules_by_hand():
    a = dict(
        tokens=2.0, seqs=1.0, acted_frac=0.5, acted_seq_frac=1.0, seq_ratio_mean=2.0, abs_logk_max=3.0, nan_logprobs=1.0
    )
    b = dict(
        tokens=6.0, seqs=3.0, acted_frac=0.0, acted_seq_frac=0.0, seq_ratio_mean=1.0, abs_logk_max=1.0, nan_logprobs=0.0
    )
    out = {k: float(v) for k, v in C.combine_metrics([a, b]).items()}
    assert out == pytest.approx(
        dict(
            tokens=8,
            seqs=4,
            acted_frac=1 / 8,
            acted_seq_frac=1 / 4,
            seq_ratio_mean=5 / 4,
            abs_logk_max=3,
            nan_logprobs=1,
        )
    )
    with pytest.raises(ValueError, match="differ in keys"):
        C.combine_metrics([a, dict(b, extra=1.0)])
    with pytest.raises(ValueError, match="'seqs'"):
        C.combine_metrics([dict(tokens=1.0, x=1.0)])


# ----------------------------------------------------------------------------- validation


def test_validation():
    lp, lq, mask = logs32(P), logs32(Q), np.array(MASK, bool)
    with pytest.raises(ValueError, match="unknown correction method 'cis2'.*none, exact, tis"):
        C.correction_weights("cis2", lp, lq, mask, **PAPER)
    bad = [
        ("icepop", dict(low=3.0, high=2.0), "low=3.0 > high=2.0"),
        ("seq_mis", dict(low=-1.0), "low"),
        ("icepop", dict(high=0.0), "high"),
        ("cis", dict(lam=-1.0), "lam"),
        ("cis", dict(kappa=1.5), "kappa"),
        ("tis", dict(cap=0.0), "cap"),
        ("kpop", dict(threshold=-1.0), "threshold"),
    ]
    for method, kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            C.correction_weights(method, lp, lq, mask, **{**PAPER, **kw})
    with pytest.raises(ValueError, match="same"):
        C.correction_weights("cis", lp, lq[:, :3], mask, **PAPER)
    # bounds are ignored by the methods that have none (the step passes None or the config's values)
    C.correction_weights("cis", lp, lq, mask, **PAPER, low=3.0, high=2.0)


def test_paper_hyperparameters_are_the_base_config():
    """configs/base.py is the one source of the operators' numbers; the tests' PAPER values are the same."""
    c = config_lib.load(None).correction
    assert dict(lam=c.lam, kappa=c.kappa, cap=c.cap, threshold=c.threshold) == PAPER
