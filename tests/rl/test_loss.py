"""cisjax.rl.loss against hand values, numpy float64 and float64 finite differences through the logits."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cisjax.rl.loss import loss_denominator, policy_loss
from configs.base import get_config

CL, CH = 0.2, 0.28


# ---- independent float64 references ---------------------------------------------------------------


def _np_ppo_term(rho, adv, clip_low=CL, clip_high=CH):
    """max(-A rho, -A clip(rho)) per token, float64."""
    return np.maximum(-adv * rho, -adv * np.clip(rho, 1 - clip_low, 1 + clip_high))


def _np_aggregate(term, mask, aggregation, denom):
    term = np.where(mask, term, 0.0)
    if aggregation == "token_mean":
        return term.sum() / denom
    n = mask.sum(-1)
    return (term.sum(-1) / np.maximum(n, 1)).sum() / denom


def _np_loss(logp, prox, w, adv, mask, aggregation, denom):
    rho = np.exp(np.where(mask, logp - prox, 0.0))
    return _np_aggregate(w * _np_ppo_term(rho, adv), mask, aggregation, denom)


def _np_log_softmax(z):
    m = z.max(-1, keepdims=True)
    return z - (m + np.log(np.exp(z - m).sum(-1, keepdims=True)))


def _combine(metric_list):
    """The documented convention: *_max by max, tokens/seqs add, seq_* by seqs, the rest by tokens."""
    tokens = np.array([float(m["tokens"]) for m in metric_list])
    seqs = np.array([float(m["seqs"]) for m in metric_list])
    out = {}
    for k in metric_list[0]:
        vals = np.array([float(m[k]) for m in metric_list])
        if k.endswith("_max"):
            out[k] = vals.max()
        elif k in ("tokens", "seqs"):
            out[k] = vals.sum()
        elif k.startswith("seq_"):
            out[k] = (vals * seqs).sum() / seqs.sum()
        else:
            out[k] = (vals * tokens).sum() / tokens.sum()
    return out


# ---- hand cases -------------------------------------------------------------------------------------

# (A, rho) covering both signs of A and rho below / inside / above [0.8, 1.28]:
#   A=+1 rho=1.1 inside      -> max(-1.1, -1.1)  = -1.1
#   A=+1 rho=1.5 above       -> max(-1.5, -1.28) = -1.28  (clipped)
#   A=+1 rho=0.5 below       -> max(-0.5, -0.8)  = -0.5
#   A=-1 rho=1.5 above       -> max(1.5, 1.28)   =  1.5
#   A=-1 rho=0.5 below       -> max(0.5, 0.8)    =  0.8   (clipped)
#   A=-2 rho=0.9 inside      -> max(1.8, 1.8)    =  1.8
#   A=0  rho=1.0             -> 0
HAND_A = np.array([1.0, 1.0, 1.0, -1.0, -1.0, -2.0, 0.0])
HAND_RHO = np.array([1.1, 1.5, 0.5, 1.5, 0.5, 0.9, 1.0])
HAND_TERM = np.array([-1.1, -1.28, -0.5, 1.5, 0.8, 1.8, 0.0])
HAND_W = np.array([1.0, 2.0, 1.0, 0.5, 1.0, 1.0, 1.0])


def _hand_rows():
    """The 7 cases in two rows: row 0 holds cases 0-2 (+1 padding), row 1 cases 3-6."""
    prox = np.log(np.array([[0.3, 0.5, 0.2, 0.7], [0.1, 0.6, 0.4, 0.9]]))
    rho = np.array([[1.1, 1.5, 0.5, 1.0], [1.5, 0.5, 0.9, 1.0]])
    adv = np.array([[1.0, 1.0, 1.0, 0.0], [-1.0, -1.0, -2.0, 0.0]])
    w = np.array([[1.0, 2.0, 1.0, 0.0], [0.5, 1.0, 1.0, 1.0]])
    mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], bool)
    logp = np.log(rho) + prox
    return [x.astype(np.float32) if x.dtype != bool else x for x in (logp, prox, w, adv, mask)]


def test_loss_denominator_hand():
    mask = np.array([[1, 1, 0], [0, 0, 0], [1, 0, 0]], bool)
    assert float(loss_denominator(mask, "token_mean")) == 3.0
    assert float(loss_denominator(mask, "seq_mean_token_mean")) == 2.0
    mask_MxBxT = np.stack([mask, np.ones_like(mask)])  # a step of two micro-batches
    assert float(loss_denominator(mask_MxBxT, "token_mean")) == 12.0
    assert float(loss_denominator(mask_MxBxT, "seq_mean_token_mean")) == 5.0
    assert float(loss_denominator(np.zeros((2, 3), bool))) == 1.0  # empty step: loss 0, not NaN
    with pytest.raises(ValueError):
        loss_denominator(mask, "sum")


def test_hand_cases_token_terms_and_metrics():
    # One row per case: loss_t alone, token_mean with denominator 1.
    for a, rho, term in zip(HAND_A, HAND_RHO, HAND_TERM):
        prox = np.log(np.float32(0.3))
        logp = np.array([[np.log(rho) + prox]], np.float32)
        loss, _ = policy_loss(
            logp, np.array([[prox]]), np.ones((1, 1)), np.array([[a]]), np.ones((1, 1), bool), denominator=1.0
        )
        np.testing.assert_allclose(float(loss), term, rtol=1e-6, atol=1e-7)
    # All seven in one row with weights: sum(w * term) = -1.1 - 2.56 - 0.5 + 0.75 + 0.8 + 1.8 + 0 = -0.81.
    prox = np.full((1, 7), np.log(0.4), np.float32)
    logp = (np.log(HAND_RHO) + prox).astype(np.float32)
    loss, m = policy_loss(logp, prox, HAND_W[None], HAND_A[None], np.ones((1, 7), bool), denominator=7.0)
    np.testing.assert_allclose(float(loss), -0.81 / 7, rtol=1e-6)
    np.testing.assert_allclose(float(m["pg_loss"]), -0.81 / 7, rtol=1e-6)
    np.testing.assert_allclose(float(m["clip_frac"]), 2 / 7, rtol=1e-6)  # cases 1 and 4
    np.testing.assert_allclose(float(m["ratio_mean"]), 7.0 / 7, rtol=1e-6)
    np.testing.assert_allclose(float(m["ratio_max"]), 1.5, rtol=1e-6)
    assert float(m["tokens"]) == 7.0 and float(m["seqs"]) == 1.0 and "kl" not in m


def test_hand_cases_aggregation_modes():
    logp, prox, w, adv, mask = _hand_rows()
    # token_mean: -0.81 / 7. seq_mean_token_mean: row 0 (-1.1 - 2.56 - 0.5) / 3, row 1 (0.75 + 0.8 + 1.8 + 0) / 4, over 2.
    loss, m = policy_loss(logp, prox, w, adv, mask, denominator=loss_denominator(mask, "token_mean"))
    np.testing.assert_allclose(float(loss), -0.81 / 7, rtol=1e-6)
    seq_expected = (-4.16 / 3 + 3.35 / 4) / 2
    loss, m2 = policy_loss(
        logp,
        prox,
        w,
        adv,
        mask,
        denominator=loss_denominator(mask, "seq_mean_token_mean"),
        aggregation="seq_mean_token_mean",
    )
    np.testing.assert_allclose(float(loss), seq_expected, rtol=1e-6)
    for mm in (m, m2):  # the metrics do not depend on the aggregation
        np.testing.assert_allclose(float(mm["pg_loss"]), -0.81 / 7, rtol=1e-6)
        np.testing.assert_allclose(float(mm["seq_pg_loss"]), seq_expected, rtol=1e-6)
        assert float(mm["tokens"]) == 7.0 and float(mm["seqs"]) == 2.0
    with pytest.raises(ValueError):
        policy_loss(logp, prox, w, adv, mask, denominator=1.0, aggregation="token_sum")


def test_masked_tokens_leave_numerator_only():
    logp, prox, w, adv, mask = _hand_rows()
    # Weight 0 on the clipped token (w=2, term -1.28): numerator -0.81 + 2.56, denominator still 7.
    w0 = w.copy()
    w0[0, 1] = 0.0
    loss, _ = policy_loss(logp, prox, w0, adv, mask, denominator=loss_denominator(mask))
    np.testing.assert_allclose(float(loss), 1.75 / 7, rtol=1e-6)
    # seq mode: the zero-weight token still counts in its row's n_i = 3.
    loss, _ = policy_loss(logp, prox, w0, adv, mask, denominator=2.0, aggregation="seq_mean_token_mean")
    np.testing.assert_allclose(float(loss), ((-1.1 - 0.5) / 3 + 3.35 / 4) / 2, rtol=1e-6)
    # A whole response rejected (Seq-MIS): its row contributes 0 but stays in both denominators.
    w1 = w.copy()
    w1[1] = 0.0
    loss, _ = policy_loss(logp, prox, w1, adv, mask, denominator=2.0, aggregation="seq_mean_token_mean")
    np.testing.assert_allclose(float(loss), (-4.16 / 3) / 2, rtol=1e-6)


def test_padding_garbage_is_inert():
    logp, prox, w, adv, mask = _hand_rows()
    g_logp, g_w, g_adv, g_prox = logp.copy(), w.copy(), adv.copy(), prox.copy()
    g_logp[0, 3], g_prox[0, 3], g_w[0, 3], g_adv[0, 3] = (
        500.0,
        -500.0,
        np.nan,
        np.nan,
    )  # exp(1000) = inf if not kept out

    def f(lp, ww, aa, pp):
        return policy_loss(lp, pp, ww, aa, mask, denominator=7.0)

    (loss, m), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(g_logp), g_w, g_adv, g_prox)
    np.testing.assert_allclose(float(loss), -0.81 / 7, rtol=1e-6)
    assert all(np.isfinite(float(v)) for v in m.values())
    assert np.all(np.isfinite(np.asarray(grad))) and float(grad[0, 3]) == 0.0


# ---- micro-batches ------------------------------------------------------------------------------------


def _random_batch(seed, b=6, t=8):
    rng = np.random.default_rng(seed)
    lengths = np.array([8, 3, 0, 5, 1, 6])[:b]
    mask = np.arange(t)[None] < lengths[:, None]
    prox = np.log(rng.uniform(0.05, 0.95, size=(b, t)))
    logp = prox + rng.uniform(-0.5, 0.5, size=(b, t))
    w = rng.uniform(0.0, 2.0, size=(b, t)) * (rng.random((b, t)) > 0.2)
    adv = np.repeat(rng.normal(size=(b, 1)), t, axis=1)
    ref = prox + rng.normal(size=(b, t)) * 0.3
    return [x.astype(np.float32) for x in (logp, prox, w, adv)] + [mask, ref.astype(np.float32)]


@pytest.mark.parametrize("gspo", [False, True])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_micro_batch_split_equals_whole_batch(aggregation, gspo):
    logp, prox, w, adv, mask, ref = _random_batch(0)
    if gspo:  # bring the sequence ratios near 1 so that both clip branches occur
        logp = (prox + (logp - prox) * 2e-3).astype(np.float32)
    kw = dict(aggregation=aggregation, gspo=gspo, ref_logprobs_BxT=None, kl_coef=0.0)
    denom = loss_denominator(mask, aggregation)  # the step's global normaliser
    whole, m_whole = policy_loss(logp, prox, w, adv, mask, denominator=denom, **kw)
    parts, m_parts = [], []
    for s in (slice(0, 2), slice(2, 4), slice(4, 6)):
        loss, m = policy_loss(logp[s], prox[s], w[s], adv[s], mask[s], denominator=denom, **kw)
        parts.append(float(loss))
        m_parts.append(m)
    np.testing.assert_allclose(sum(parts), float(whole), rtol=1e-5, atol=1e-7)
    if not gspo:
        ref_val = _np_loss(logp.astype(np.float64), prox.astype(np.float64), w, adv, mask, aggregation, float(denom))
        np.testing.assert_allclose(float(whole), ref_val, rtol=1e-5)
    combined = _combine(m_parts)
    for k, v in m_whole.items():
        np.testing.assert_allclose(combined[k], float(v), rtol=1e-5, atol=1e-7, err_msg=k)
    # The pg metric matching the aggregation is the step's loss.
    key = "pg_loss" if aggregation == "token_mean" else "seq_pg_loss"
    np.testing.assert_allclose(combined[key], float(whole), rtol=1e-5)


def test_micro_batch_split_gradients_add_up():
    logp, prox, w, adv, mask, ref = _random_batch(1)
    denom = loss_denominator(mask, "seq_mean_token_mean")

    def f(lp, s):
        return policy_loss(
            lp,
            prox[s],
            w[s],
            adv[s],
            mask[s],
            denominator=denom,
            aggregation="seq_mean_token_mean",
            ref_logprobs_BxT=ref[s],
            kl_coef=0.05,
        )[0]

    g_whole = jax.grad(f)(jnp.asarray(logp), slice(0, 6))
    g_parts = np.concatenate([np.asarray(jax.grad(f)(jnp.asarray(logp[s]), s)) for s in (slice(0, 3), slice(3, 6))])
    np.testing.assert_allclose(g_parts, np.asarray(g_whole), rtol=1e-5, atol=1e-8)


def test_jit_and_config_fields():
    logp, prox, w, adv, mask, ref = _random_batch(2)
    cfg = get_config().loss
    kw = dict(
        aggregation=cfg.aggregation,
        clip_low=cfg.clip_low,
        clip_high=cfg.clip_high,
        gspo_clip_low=cfg.gspo_clip_low,
        gspo_clip_high=cfg.gspo_clip_high,
        kl_coef=cfg.kl_coef,
    )
    f = jax.jit(functools.partial(policy_loss, **kw))
    loss, m = f(logp, prox, w, adv, mask, denominator=loss_denominator(mask, cfg.aggregation))
    eager, _ = policy_loss(logp, prox, w, adv, mask, denominator=loss_denominator(mask, cfg.aggregation), **kw)
    np.testing.assert_allclose(float(loss), float(eager), rtol=1e-6)
    assert (cfg.clip_low, cfg.clip_high, cfg.aggregation) == (0.2, 0.28, "token_mean")


# ---- GSPO ---------------------------------------------------------------------------------------------


def _gspo_rows():
    """Four responses; log ratios and advantages chosen by hand (see the test)."""
    log_ratio = np.array([[0.001, -0.0004, 0, 0], [0.002, 0.0, 0, 0], [-0.002, -0.001, -0.003, 0], [0.0, 0.0, 0, 0]])
    adv = np.array([[1.0, 1.0, 0, 0], [2.0, 2.0, 0, 0], [-1.0, -1.0, -1.0, 0], [1.0, 3.0, 0, 0]])
    mask = np.array([[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 0]], bool)
    prox = np.log(np.array([[0.5, 0.2, 0.3, 0.3], [0.9, 0.6, 0.3, 0.3], [0.4, 0.7, 0.1, 0.3], [0.8, 0.05, 0.3, 0.3]]))
    return log_ratio, adv, mask, prox


def test_gspo_hand_values():
    log_ratio, adv, mask, prox = _gspo_rows()
    # s_1 = exp(0.0003) inside [1 - 3e-4, 1 + 4e-4], A=1:   l_1 = -exp(0.0003)
    # s_2 = exp(0.001) above, A=2:                         l_2 = max(-2 s_2, -2 * 1.0004) = -2.0008  (clipped)
    # s_3 = exp(-0.002) below, A=-1:                       l_3 = max(s_3, 0.9997) = 0.9997            (clipped)
    # s_4 = 1, Abar = mean(1, 3) = 2:                      l_4 = -2
    l = np.array([-np.exp(0.0003), -2.0008, 0.9997, -2.0])
    n = np.array([2, 2, 3, 2])
    logp = (prox + log_ratio).astype(np.float32)
    w = np.ones_like(logp)
    args = (logp, prox.astype(np.float32), w, adv.astype(np.float32), mask)
    loss, m = policy_loss(*args, denominator=4.0, aggregation="seq_mean_token_mean", gspo=True)
    np.testing.assert_allclose(float(loss), l.sum() / 4, rtol=1e-5)
    loss_t, m_t = policy_loss(*args, denominator=9.0, aggregation="token_mean", gspo=True)
    np.testing.assert_allclose(float(loss_t), (n * l).sum() / 9, rtol=1e-5)
    np.testing.assert_allclose(float(m["seq_clip_frac"]), 2 / 4, rtol=1e-6)
    np.testing.assert_allclose(float(m["clip_frac"]), (2 + 3) / 9, rtol=1e-6)
    s = np.exp([0.0003, 0.001, -0.002, 0.0])
    np.testing.assert_allclose(float(m["seq_ratio_mean"]), s.mean(), rtol=1e-6)
    np.testing.assert_allclose(float(m["seq_ratio_max"]), s.max(), rtol=1e-6)
    np.testing.assert_allclose(float(m["seq_pg_loss"]), l.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(m["pg_loss"]), (n * l).sum() / 9, rtol=1e-5)
    # Gradient w.r.t. logp, float64 by hand: d l_i / d logp_t = -Abar_i s_i / n_i when unclipped, else 0.
    g = jax.grad(
        lambda lp: policy_loss(lp, *args[1:], denominator=4.0, aggregation="seq_mean_token_mean", gspo=True)[0]
    )(jnp.asarray(logp))
    expected = np.zeros_like(log_ratio)
    expected[0, :2] = -1.0 * s[0] / 2 / 4
    expected[3, :2] = -2.0 * s[3] / 2 / 4
    np.testing.assert_allclose(np.asarray(g), expected, rtol=1e-5, atol=1e-9)


# ---- KL -----------------------------------------------------------------------------------------------


def test_k3_kl_hand_and_not_weighted():
    # d = ref - logp = [0.5, -1]: k3 = e^0.5 - 1.5 = 0.1487212707, e^-1 + 1 - 1 = 0.3678794412.
    logp = np.log(np.array([[0.3, 0.6]], np.float32))
    ref = logp + np.array([[0.5, -1.0]], np.float32)
    mask = np.ones((1, 2), bool)
    zeros = np.zeros((1, 2), np.float32)
    k3 = np.array([np.exp(0.5) - 1.5, np.exp(-1.0)])
    # Weight 0 and advantage 0: only the KL is left, and it is not multiplied by the weight.
    loss, m = policy_loss(logp, logp, zeros, zeros, mask, denominator=2.0, ref_logprobs_BxT=ref, kl_coef=0.1)
    np.testing.assert_allclose(float(loss), 0.1 * k3.sum() / 2, rtol=1e-6)
    np.testing.assert_allclose(float(m["kl"]), k3.mean(), rtol=1e-6)
    # d k3 / d logp = -(e^d - 1).
    g = jax.grad(
        lambda lp: policy_loss(lp, logp, zeros, zeros, mask, denominator=2.0, ref_logprobs_BxT=ref, kl_coef=0.1)[0]
    )(jnp.asarray(logp))
    np.testing.assert_allclose(np.asarray(g)[0], 0.1 * -(np.exp([0.5, -1.0]) - 1) / 2, rtol=1e-5)
    # kl_coef = 0 (the recipe) or no reference: no KL term, no metric.
    loss, m = policy_loss(logp, logp, zeros, zeros, mask, denominator=2.0, ref_logprobs_BxT=ref, kl_coef=0.0)
    assert float(loss) == 0.0 and "kl" not in m


# ---- THE KEY TEST: the correction weight carries no gradient ------------------------------------------


def _np_ppo_grad_fd(logits, targets, prox, adv, h=1e-6):
    """d/dlogits of the unweighted clipped PPO term of each token, by float64 central differences."""
    logits = logits.astype(np.float64)

    def term(z):
        lp = np.take_along_axis(_np_log_softmax(z), targets[..., None], -1)[..., 0]
        return _np_ppo_term(np.exp(lp - prox), adv)

    grad = np.zeros_like(logits)
    for v in range(logits.shape[-1]):  # tokens are independent: perturb entry v of every token at once
        zp, zm = logits.copy(), logits.copy()
        zp[..., v] += h
        zm[..., v] -= h
        grad[..., v] = (term(zp) - term(zm)) / (2 * h)
    return grad


@pytest.mark.parametrize("traced_prox", [False, True])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_weight_is_detached_gradient_through_logits(aggregation, traced_prox):
    rng = np.random.default_rng(3)
    b, t, v = 3, 6, 11
    logits = (rng.normal(size=(b, t, v)) * 2.0).astype(np.float32)
    targets = rng.integers(0, v, size=(b, t))
    mask = np.arange(t)[None] < np.array([6, 4, 2])[:, None]
    adv = np.repeat(rng.choice([-1.5, -0.7, 0.8, 1.3], size=(b, 1)), t, axis=1)
    # rho = exp(delta) with delta far from the clip edges log 0.8 = -0.223 and log 1.28 = 0.247.
    delta = rng.choice([-0.6, -0.4, -0.1, 0.0, 0.1, 0.4, 0.6], size=(b, t))
    logp64 = np.take_along_axis(_np_log_softmax(logits.astype(np.float64)), targets[..., None], -1)[..., 0]
    prox64 = logp64 - delta
    logq = (logp64 + rng.normal(size=(b, t)) * 0.8).astype(np.float32)  # inference-side logprobs
    denom = float(loss_denominator(mask, aggregation))

    def cis_like_weight(logp):
        # min(k, 1 + lam * max(1 - p, kappa)) computed from the traced logp: both branches depend on logp.
        return jnp.minimum(jnp.exp(logp - logq), 1.0 + 2.3 * jnp.maximum(1.0 - jnp.exp(logp), 5e-3))

    def loss_fn(z):
        logp = jnp.take_along_axis(jax.nn.log_softmax(z), jnp.asarray(targets)[..., None], -1)[..., 0]
        prox = logp - delta.astype(np.float32) if traced_prox else prox64.astype(np.float32)
        # The weight is handed over WITHOUT stop_gradient: policy_loss must detach it (and prox).
        return policy_loss(
            logp, prox, cis_like_weight(logp), adv.astype(np.float32), mask, denominator=denom, aggregation=aggregation
        )[0]

    grad = np.asarray(jax.grad(loss_fn)(jnp.asarray(logits)))

    # Expected, token by token: (mask * w_t / normaliser_t) * d(PPO term_t)/d logits, w_t a constant.
    w64 = np.minimum(np.exp(logp64 - logq), 1.0 + 2.3 * np.maximum(1.0 - np.exp(logp64), 5e-3))
    norm = denom if aggregation == "token_mean" else denom * np.maximum(mask.sum(-1, keepdims=True), 1)
    scale = np.where(mask, w64 / norm, 0.0)
    expected = scale[..., None] * _np_ppo_grad_fd(logits, targets, prox64, adv)
    assert np.abs(expected).max() > 1e-2  # the test is not vacuous
    assert np.any(np.where(mask, np.abs(delta) > 0.3, False))  # some tokens sit in the clipped region
    np.testing.assert_allclose(grad, expected, rtol=1e-4, atol=2e-6)

    # The same loss with the weight left attached differs visibly: the check above has teeth.
    def attached(z):
        logp = jnp.take_along_axis(jax.nn.log_softmax(z), jnp.asarray(targets)[..., None], -1)[..., 0]
        rho = jnp.exp(logp - prox64.astype(np.float32))
        term = jnp.maximum(-adv * rho, -adv * jnp.clip(rho, 1 - CL, 1 + CH))
        return jnp.sum(jnp.where(mask, cis_like_weight(logp) * term, 0.0) / norm)

    assert np.abs(np.asarray(jax.grad(attached)(jnp.asarray(logits))) - expected).max() > 1e-2
