"""cisjax.logprobs: chunked token statistics against numpy float64, the unchunked version, and finite differences."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from cisjax.logprobs import TokenStats, naive_token_logprobs, token_logprobs


def _inputs(n: int, d: int, v: int, seed: int = 0, scale: float = 1.0):
    rng = np.random.default_rng(seed)
    h_NxD = rng.normal(size=(n, d)).astype(np.float32)
    w_DxV = (rng.normal(size=(d, v)) * scale / np.sqrt(d)).astype(np.float32) * 3.0  # logits of a few units
    t_N = rng.integers(0, v, size=n).astype(np.int32)
    return h_NxD, w_DxV, t_N


def _np_stats(h_NxD, w_DxV, t_N, temperature: float, k: int):
    """Reference in float64: log-softmax of (h @ w) / temperature, its entropy, target logprob, top-k."""
    z = (np.asarray(h_NxD, np.float64) @ np.asarray(w_DxV, np.float64)) / temperature
    m = z.max(axis=-1, keepdims=True)
    logp = z - (m + np.log(np.exp(z - m).sum(axis=-1, keepdims=True)))
    lp = logp[np.arange(len(t_N)), t_N]
    ent = -(np.exp(logp) * logp).sum(axis=-1)
    ids = np.argsort(-z, axis=-1, kind="stable")[:, :k]
    return lp, ent, ids, np.take_along_axis(logp, ids, axis=-1)


def _np_objective(h_NxD, w_DxV, t_N, temperature, k, ct_lp, ct_ent, ct_topk):
    lp, ent, _, topk = _np_stats(h_NxD, w_DxV, t_N, temperature, k)
    return (lp * ct_lp).sum() + (ent * ct_ent).sum() + (topk * ct_topk).sum()


def _objective(fn, t_N, temperature, k, ct_lp, ct_ent, ct_topk, **kw):
    def f(h_NxD, w_DxV):
        s = fn(h_NxD, w_DxV, t_N, temperature=temperature, top_k=k, **kw)
        out = jnp.sum(s.logprobs_N * ct_lp) + jnp.sum(s.entropy_N * ct_ent)
        return out + (jnp.sum(s.topk_logprobs_NxK * ct_topk) if k else 0.0)

    return f


@pytest.mark.parametrize("n,chunk", [(1, 4), (37, 8), (100, 32), (65, 64), (64, 64), (10, 1000)])
def test_values_match_numpy_float64(n, chunk):
    d, v, k, temp = 16, 301, 5, 0.7
    h, w, t = _inputs(n, d, v, seed=n)
    s = jax.jit(lambda h, w, t: token_logprobs(h, w, t, temperature=temp, chunk_size=chunk, top_k=k))(h, w, t)
    lp, ent, ids, topk = _np_stats(h, w, t, temp, k)
    assert s.logprobs_N.dtype == jnp.float32 and s.entropy_N.dtype == jnp.float32
    assert s.topk_ids_NxK.dtype == jnp.int32 and s.topk_logprobs_NxK.shape == (n, k)
    np.testing.assert_allclose(s.logprobs_N, lp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s.entropy_N, ent, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(s.topk_ids_NxK, ids)
    np.testing.assert_allclose(s.topk_logprobs_NxK, topk, rtol=1e-5, atol=1e-5)


def test_no_topk_gives_none_and_leading_dims_kept():
    b, l, d, v = 3, 7, 8, 50
    h, w, t = _inputs(b * l, d, v, seed=1)
    s = jax.jit(lambda h, t: token_logprobs(h, w, t, chunk_size=4))(h.reshape(b, l, d), t.reshape(b, l))
    assert isinstance(s, TokenStats) and s.topk_ids_NxK is None and s.topk_logprobs_NxK is None
    assert s.logprobs_N.shape == (b, l) and s.entropy_N.shape == (b, l)
    lp, ent, _, _ = _np_stats(h, w, t, 1.0, 0)
    np.testing.assert_allclose(s.logprobs_N.reshape(-1), lp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s.entropy_N.reshape(-1), ent, rtol=1e-5, atol=1e-5)
    k3 = token_logprobs(h.reshape(b, l, d), w, t.reshape(b, l), chunk_size=4, top_k=3)
    assert k3.topk_ids_NxK.shape == (b, l, 3) and k3.topk_logprobs_NxK.shape == (b, l, 3)


def test_bf16_compute_matches_numpy_on_rounded_inputs():
    n, d, v, k, temp = 45, 32, 257, 4, 1.3
    h, w, t = _inputs(n, d, v, seed=2)
    h_bf, w_bf = h.astype(ml_dtypes.bfloat16), w.astype(ml_dtypes.bfloat16)
    # bf16 storage and compute; and fp32 storage with compute_dtype=bf16 — the same rounded operands either way.
    s1 = token_logprobs(jnp.asarray(h_bf), jnp.asarray(w_bf), t, temperature=temp, chunk_size=16, top_k=k)
    s2 = token_logprobs(h, w, t, temperature=temp, chunk_size=16, top_k=k, compute_dtype=jnp.bfloat16)
    lp, ent, ids, topk = _np_stats(h_bf.astype(np.float64), w_bf.astype(np.float64), t, temp, k)
    for s in (s1, s2):
        assert s.logprobs_N.dtype == jnp.float32
        np.testing.assert_allclose(s.logprobs_N, lp, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(s.entropy_N, ent, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(s.topk_logprobs_NxK, topk, rtol=1e-4, atol=1e-4)
    # and visibly different from the unrounded fp32 answer (the compute dtype is really bf16)
    assert np.max(np.abs(np.asarray(s2.logprobs_N) - _np_stats(h, w, t, temp, k)[0])) > 1e-3


@pytest.mark.parametrize("n,chunk,k", [(37, 8, 0), (50, 16, 3), (20, 64, 2)])
def test_chunked_equals_naive_fp32_values_and_gradients(n, chunk, k):
    d, v, temp = 24, 211, 0.8
    h, w, t = _inputs(n, d, v, seed=3 + n)
    rng = np.random.default_rng(n)
    cts = (
        rng.normal(size=n).astype(np.float32),
        rng.normal(size=n).astype(np.float32),
        rng.normal(size=(n, k)).astype(np.float32),
    )
    a = token_logprobs(h, w, t, temperature=temp, chunk_size=chunk, top_k=k)
    b = naive_token_logprobs(h, w, t, temperature=temp, top_k=k)
    for x, y in zip(a, b):
        if x is not None:
            np.testing.assert_allclose(x, y, rtol=1e-6, atol=2e-6)
    ga = jax.jit(jax.grad(_objective(token_logprobs, t, temp, k, *cts, chunk_size=chunk), argnums=(0, 1)))(h, w)
    gb = jax.jit(jax.grad(_objective(naive_token_logprobs, t, temp, k, *cts), argnums=(0, 1)))(h, w)
    for x, y in zip(ga, gb):
        assert x.dtype == jnp.float32
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(y))))


def test_gradients_match_float64_finite_differences():
    """Directional derivatives of logprobs + entropy + top-k logprobs (random weights) vs central differences in f64."""
    n, d, v, k, temp, chunk = 13, 8, 40, 3, 1.7, 4
    h, w, t = _inputs(n, d, v, seed=5)
    rng = np.random.default_rng(5)
    cts = rng.normal(size=n), rng.normal(size=n), rng.normal(size=(n, k))
    g_h, g_w = jax.jit(
        jax.grad(
            _objective(token_logprobs, t, temp, k, *(c.astype(np.float32) for c in cts), chunk_size=chunk),
            argnums=(0, 1),
        )
    )(h, w)
    eps = 1e-5
    for _ in range(4):
        dh, dw = rng.normal(size=h.shape), rng.normal(size=w.shape)
        h64, w64 = h.astype(np.float64), w.astype(np.float64)
        fd = (
            _np_objective(h64 + eps * dh, w64 + eps * dw, t, temp, k, *cts)
            - _np_objective(h64 - eps * dh, w64 - eps * dw, t, temp, k, *cts)
        ) / (2 * eps)
        ad = float(np.sum(np.asarray(g_h, np.float64) * dh) + np.sum(np.asarray(g_w, np.float64) * dw))
        assert ad == pytest.approx(fd, rel=2e-4, abs=1e-4)


def test_bf16_gradients_close_to_naive():
    n, d, v, k, temp, chunk = 40, 32, 300, 2, 0.9, 16
    h, w, t = _inputs(n, d, v, seed=6)
    h_bf, w_bf = jnp.asarray(h, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    rng = np.random.default_rng(6)
    cts = (
        rng.normal(size=n).astype(np.float32),
        rng.normal(size=n).astype(np.float32),
        rng.normal(size=(n, k)).astype(np.float32),
    )
    ga = jax.jit(jax.grad(_objective(token_logprobs, t, temp, k, *cts, chunk_size=chunk), argnums=(0, 1)))(h_bf, w_bf)
    gb = jax.jit(jax.grad(_objective(naive_token_logprobs, t, temp, k, *cts), argnums=(0, 1)))(h_bf, w_bf)
    for x, y in zip(ga, gb):
        assert x.dtype == jnp.bfloat16
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        assert np.max(np.abs(x - y)) <= 2e-2 * np.max(np.abs(y))


def test_bad_target_is_nan_and_masking_keeps_gradients_finite():
    n, d, v = 9, 8, 30
    h, w, t = _inputs(n, d, v, seed=7)
    t = t.copy()
    t[2], t[5] = v, -1
    s = token_logprobs(h, w, t, chunk_size=4)
    assert np.isnan(s.logprobs_N[2]) and np.isnan(s.logprobs_N[5])
    ok = np.ones(n, bool)
    ok[[2, 5]] = False
    np.testing.assert_allclose(
        np.asarray(s.logprobs_N)[ok], _np_stats(h, w, np.where(ok, t, 0), 1.0, 0)[0][ok], rtol=1e-5, atol=1e-5
    )

    def masked(h_NxD):
        lp = token_logprobs(h_NxD, w, t, chunk_size=4).logprobs_N
        return jnp.sum(jnp.where(ok, lp, 0.0))

    g = jax.jit(jax.grad(masked))(h)
    assert np.all(np.isfinite(g)) and np.all(np.asarray(g)[~ok] == 0)


def test_traced_temperature_under_jit():
    n, d, v = 11, 8, 40
    h, w, t = _inputs(n, d, v, seed=8)
    f = jax.jit(lambda temp: token_logprobs(h, w, t, temperature=temp, chunk_size=4).entropy_N)
    np.testing.assert_allclose(f(jnp.float32(2.5)), _np_stats(h, w, t, 2.5, 0)[1], rtol=1e-5, atol=1e-5)


def _fwd_bwd(fn, chunk):
    def run(h_NxD, w_DxV, t_N):
        def g(h_NxD, w_DxV):
            s = fn(h_NxD, w_DxV, t_N, chunk_size=chunk)
            return s.logprobs_N, s.entropy_N

        out, vjp = jax.vjp(g, h_NxD, w_DxV)
        return out, vjp(tuple(jnp.ones_like(o) for o in out))

    return run


def test_chunked_temp_memory_far_below_naive():
    """XLA's own buffer plan for values + gradients: the chunked version never holds a [N, V] fp32 matrix."""
    n, d, v, chunk = 1024, 64, 32768, 128
    args = (
        jax.ShapeDtypeStruct((n, d), jnp.float32),
        jax.ShapeDtypeStruct((d, v), jnp.float32),
        jax.ShapeDtypeStruct((n,), jnp.int32),
    )
    temp = {
        name: jax.jit(_fwd_bwd(fn, chunk)).lower(*args).compile().memory_analysis().temp_size_in_bytes
        for name, fn in (("chunked", token_logprobs), ("naive", naive_token_logprobs))
    }
    full_logits = n * v * 4
    assert temp["naive"] >= full_logits  # the baseline does materialise the logits
    assert temp["chunked"] < full_logits / 2
    assert temp["chunked"] < 0.25 * temp["naive"]


def test_batch_sharded_input_stays_sharded():
    """With the tokens sharded over devices, every chunk spans all devices: no all-gather, and d/dhidden stays sharded."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = jax.devices()
    if len(devices) < 2:
        pytest.skip("needs several devices (tests/conftest.py asks for 8 CPU devices)")
    mesh = Mesh(np.array(devices), ("data",))
    s = len(devices)
    b, l, d, v, k = 2 * s, 24, 16, 512, 2
    h, w, t = _inputs(b * l, d, v, seed=9)
    shard = NamedSharding(mesh, PartitionSpec("data"))
    h_BxLxD = jax.device_put(h.reshape(b, l, d), shard)
    t_BxL = jax.device_put(t.reshape(b, l), shard)
    w_DxV = jax.device_put(w, NamedSharding(mesh, PartitionSpec()))

    def loss(h_BxLxD, w_DxV):
        st = token_logprobs(h_BxLxD, w_DxV, t_BxL, chunk_size=16, top_k=k)
        return jnp.sum(st.logprobs_N) + jnp.sum(st.entropy_N) + jnp.sum(st.topk_logprobs_NxK), st

    fn = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))
    compiled = fn.lower(h_BxLxD, w_DxV).compile()
    assert "all-gather" not in compiled.as_text()
    (g_h, g_w), st = compiled(h_BxLxD, w_DxV)
    assert g_h.sharding.spec[0] == "data"
    lp, ent, ids, _ = _np_stats(h, w, t, 1.0, k)
    np.testing.assert_allclose(np.asarray(st.logprobs_N).reshape(-1), lp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(st.entropy_N).reshape(-1), ent, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(st.topk_ids_NxK).reshape(-1, k), ids)
    g_ref = jax.jit(jax.grad(lambda h, w: _plain_loss(h, w, t, k), argnums=(0, 1)))(h, w)
    np.testing.assert_allclose(np.asarray(g_h).reshape(b * l, d), g_ref[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(g_w, g_ref[1], rtol=1e-5, atol=1e-4)


def _plain_loss(h_NxD, w_DxV, t_N, k):
    st = naive_token_logprobs(h_NxD, w_DxV, t_N, top_k=k)
    return jnp.sum(st.logprobs_N) + jnp.sum(st.entropy_N) + jnp.sum(st.topk_logprobs_NxK)


# The sampling support (mask replay): a vocabulary of four tokens with p = (0.5, 0.3, 0.15, 0.05), logits = hidden
# (unembed = identity), temperature 1.
_P4 = np.array([0.5, 0.3, 0.15, 0.05])


def _support_case():
    h = np.log(np.tile(_P4, (4, 1))).astype(np.float32)
    w = np.eye(4, dtype=np.float32)
    t = np.array([1, 2, 3, 0], np.int32)
    s = np.array(
        [
            [0, 1, -1],  # top-k 2: {0, 1}, mass 0.8
            [0, 1, 2],  # top-p 0.9: 0.5 + 0.3 < 0.9, so 0.15 joins; mass 0.95
            [-1, -1, -1],  # nothing truncated: the whole vocabulary
            [1, -1, 0],  # order and padding anywhere; mass 0.8
        ],
        np.int32,
    )
    return h, w, t, s


@pytest.mark.parametrize("fn", [token_logprobs, naive_token_logprobs])
def test_support_renormalises_by_hand(fn):
    h, w, t, s = _support_case()
    got = fn(h, w, t, support=s, chunk_size=3)
    np.testing.assert_allclose(got.support_logmass_N, np.log([0.8, 0.95, 1.0, 0.8]), rtol=0, atol=1e-6)
    renorm = np.asarray(got.logprobs_N) - np.asarray(got.support_logmass_N)
    np.testing.assert_allclose(renorm, np.log([0.3 / 0.8, 0.15 / 0.95, 0.05, 0.5 / 0.8]), rtol=0, atol=1e-6)
    assert fn(h, w, t).support_logmass_N is None


@pytest.mark.parametrize("fn", [token_logprobs, naive_token_logprobs])
def test_support_gradient_by_hand(fn):
    """d(log p(t) - log mass(S)) / dz = onehot(t) - q_S, q_S = p renormalised on S (0 off S); logits = hidden."""
    h, w, t, s = _support_case()

    def renormalised_sum(h_NxD):
        out = fn(h_NxD, w, t, support=s, chunk_size=3)
        return jnp.sum(out.logprobs_N - out.support_logmass_N)

    got = np.asarray(jax.grad(renormalised_sum)(h))
    want = np.array(
        [
            [-0.5 / 0.8, 1 - 0.3 / 0.8, 0, 0],
            [-0.5 / 0.95, -0.3 / 0.95, 1 - 0.15 / 0.95, 0],
            [-0.5, -0.3, -0.15, 1 - 0.05],  # no support: d log p(t)/dz = onehot - p
            [1 - 0.5 / 0.8, -0.3 / 0.8, 0, 0],
        ]
    )
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("n,chunk,k", [(37, 8, 0), (50, 16, 3)])
def test_support_chunked_equals_naive_values_and_gradients(n, chunk, k):
    d, v, temp, width = 24, 211, 0.8, 9
    h, w, t = _inputs(n, d, v, seed=7 + n)
    rng = np.random.default_rng(n)
    s = np.stack([rng.permutation(v)[:width] for _ in range(n)]).astype(np.int32)
    s[rng.random((n, width)) < 0.3] = -1  # padding, and some rows empty
    s[::5] = -1
    cts = rng.normal(size=(3, n)).astype(np.float32)

    def objective(fn, **kw):
        def f(h_NxD, w_DxV):
            o = fn(h_NxD, w_DxV, t, temperature=temp, top_k=k, support=s, **kw)
            out = jnp.sum(o.logprobs_N * cts[0]) + jnp.sum(o.entropy_N * cts[1])
            return out + jnp.sum(o.support_logmass_N * cts[2]) + (jnp.sum(o.topk_logprobs_NxK) if k else 0.0)

        return f

    a = token_logprobs(h, w, t, temperature=temp, chunk_size=chunk, top_k=k, support=s)
    b = naive_token_logprobs(h, w, t, temperature=temp, top_k=k, support=s)
    np.testing.assert_allclose(a.support_logmass_N, b.support_logmass_N, rtol=1e-6, atol=2e-6)
    assert np.all(np.asarray(a.support_logmass_N)[::5] == 0) and np.all(np.asarray(a.support_logmass_N) <= 0)
    ga = jax.jit(jax.grad(objective(token_logprobs, chunk_size=chunk), argnums=(0, 1)))(h, w)
    gb = jax.jit(jax.grad(objective(naive_token_logprobs), argnums=(0, 1)))(h, w)
    for x, y in zip(ga, gb, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(y))))


def test_support_of_another_shape_is_refused():
    h, w, t, s = _support_case()
    with pytest.raises(ValueError, match=r"support shape \(3, 3\) != targets shape \(4,\) \+ \(S,\)"):
        token_logprobs(h, w, t, support=s[:3])
    with pytest.raises(TypeError, match="support must be integer ids"):
        token_logprobs(h, w, t, support=s.astype(np.float32))
