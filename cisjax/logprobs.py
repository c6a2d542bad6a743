"""Chunked token statistics (logprobs, entropy, top-k) from hidden states without a [tokens, vocab] logits matrix."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from cisjax import errors


class TokenStats(NamedTuple):
    logprobs_N: jax.Array  # fp32 log p(target) under the temperature-scaled distribution
    entropy_N: jax.Array  # fp32 entropy of the temperature-scaled distribution (nats)
    topk_ids_NxK: jax.Array | None  # int32 ids of the k most likely tokens, most likely first (None when top_k=0)
    topk_logprobs_NxK: jax.Array | None  # fp32 their logprobs (None when top_k=0)
    # fp32 log of the probability mass of each token's sampling support (the ids given as `support`): log sum_{v in S}
    # p(v) <= 0, 0 where the support is empty (no truncation); log p(target) - this is log p renormalised over S.
    # None without `support`
    support_logmass_N: jax.Array | None = None


_EXACT_RECALL = float(1.0 - 2.0**-24)  # see _stats_from_logits


def _scaled_logits(h_CxD, w_DxV, temperature, compute_dtype):
    """hidden @ unembed in compute_dtype with fp32 accumulation, divided by the temperature: [C, V] fp32."""
    dt = jnp.dtype(compute_dtype)
    # An explicit fp32 request means fp32: keep TPU/GPU from lowering the matmul to bf16 passes.
    precision = lax.Precision.HIGHEST if dt == jnp.float32 else None
    logits_CxV = jnp.einsum(
        "cd,dv->cv", h_CxD.astype(dt), w_DxV.astype(dt), precision=precision, preferred_element_type=jnp.float32
    )
    return logits_CxV / temperature


def _support_logsumexp(z_CxV, s_CxS):
    """(logsumexp of z over each row's support ids, whether the row has any): ids < 0 are padding."""
    valid_CxS = s_CxS >= 0
    z_CxS = jnp.take_along_axis(z_CxV, jnp.clip(s_CxS, 0, z_CxV.shape[1] - 1), axis=-1)
    z_CxS = jnp.where(valid_CxS, z_CxS, -jnp.inf)
    has_C = jnp.any(valid_CxS, axis=-1)
    return jax.nn.logsumexp(jnp.where(has_C[:, None], z_CxS, 0.0), axis=-1), has_C, z_CxS


def _stats_from_logits(z_CxV, t_C, top_k: int, s_CxS=None):
    """(logprobs, entropy, lse[, topk ids, topk logprobs][, support logmass]) of softmax(z) in fp32; gathers, no
    one-hot [C, V] masks."""
    lse_C = jax.nn.logsumexp(z_CxV, axis=-1)
    logp_CxV = z_CxV - lse_C[:, None]
    entropy_C = -jnp.sum(jnp.exp(logp_CxV) * logp_CxV, axis=-1)
    t_C = t_C.astype(jnp.int32)
    z_t_C = jnp.take_along_axis(z_CxV, jnp.clip(t_C, 0, z_CxV.shape[1] - 1)[:, None], axis=-1)[:, 0]
    logprobs_C = jnp.where(
        (t_C >= 0) & (t_C < z_CxV.shape[1]), z_t_C - lse_C, jnp.nan
    )  # a bad id gives NaN, never a number
    out = (logprobs_C, entropy_C, lse_C)
    if top_k:
        # approx_max_k, not lax.top_k: XLA's SPMD partitioner splits its rows over devices, where it gathers all of a
        # TopK op's [C, V] operand onto every device. A recall target within 2^-24 of 1 makes XLA keep every
        # candidate (its window count, (k - 1) / -log(recall), exceeds any vocabulary below ~16M): the exact top-k.
        topk_z_CxK, topk_ids_CxK = lax.approx_max_k(z_CxV, top_k, recall_target=_EXACT_RECALL)
        out += (topk_ids_CxK.astype(jnp.int32), topk_z_CxK - lse_C[:, None])
    if s_CxS is not None:
        lse_s_C, has_C, _ = _support_logsumexp(z_CxV, s_CxS)
        out += (jnp.where(has_C, lse_s_C - lse_C, 0.0),)
    return out


def chunk_layout(n: int, chunk_size: int) -> tuple[int, int]:
    """(chunks M, rows per chunk C) with M * C >= N and C <= chunk_size; M * C == N (no padding) when N has a divisor
    giving chunks of at least half chunk_size, as batch x length shapes do."""
    c = max(1, min(chunk_size, n))
    m = -(-n // c)
    for mm in range(m, 2 * m + 1):
        if n % mm == 0 and 2 * (n // mm) >= c:
            return mm, n // mm
    return m, -(-n // m)


def _to_chunks(x, m: int, c: int):
    """[N, ...] -> [M, C, ...], chunk j holding tokens j, j + M, j + 2M, ... (zero rows appended up to M * C).

    Strided, not contiguous, so that the C axis inherits a (contiguous, e.g. batch) sharding of N: each step of the
    loop over M then works on every device's own tokens instead of gathering one device's block everywhere.
    """
    x = jnp.pad(x, ((0, m * c - x.shape[0]),) + ((0, 0),) * (x.ndim - 1))
    return jnp.swapaxes(x.reshape(c, m, *x.shape[1:]), 0, 1)


def _from_chunks(x, n: int):
    """[M, C, ...] -> [N, ...], inverting _to_chunks."""
    m, c = x.shape[:2]
    return jnp.swapaxes(x, 0, 1).reshape(m * c, *x.shape[2:])[:n]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _chunked(h_NxD, w_DxV, t_N, temperature, s_NxS, c: int, top_k: int, compute_dtype):
    return _chunked_fwd(h_NxD, w_DxV, t_N, temperature, s_NxS, c, top_k, compute_dtype)[0]


def _chunked_fwd(h_NxD, w_DxV, t_N, temperature, s_NxS, c, top_k, compute_dtype):
    n = h_NxD.shape[0]
    m, c = chunk_layout(n, c)
    w_cd_DxV = w_DxV.astype(compute_dtype)  # cast once, not per chunk

    def block(xs):
        h_CxD, t_C, s_CxS = xs
        return _stats_from_logits(_scaled_logits(h_CxD, w_cd_DxV, temperature, compute_dtype), t_C, top_k, s_CxS)

    s_chunks = None if s_NxS is None else _to_chunks(s_NxS, m, c)
    stats = lax.map(block, (_to_chunks(h_NxD, m, c), _to_chunks(t_N, m, c), s_chunks))
    stats = tuple(_from_chunks(s, n) for s in stats)
    out = (stats[0], stats[1]) + stats[3:]  # lse is a residual, not an output
    topk_ids = stats[3] if top_k else None
    return out, (h_NxD, w_DxV, t_N, temperature, s_NxS, stats[2], stats[1], topk_ids)


def _chunked_bwd(c, top_k, compute_dtype, res, cts):
    """Recompute each chunk's logits and form d(stats)/d(logits) in closed form; the unembed gradient sums in fp32.

    With logp = z - lse, p = exp(logp), H = -sum p logp:  d logp_t/dz = onehot_t - p,  dH/dz = -p (logp + H),
    for the support's log mass M = logsumexp_S(z) - lse:  dM/dz = q_S - p (q_S = softmax of z over S, 0 off S),
    and z = (h @ w) / temperature.
    """
    h_NxD, w_DxV, t_N, temperature, s_NxS, lse_N, entropy_N, topk_ids_NxK = res
    g_lp_N, g_ent_N = cts[0], cts[1]
    n, d = h_NxD.shape
    v = w_DxV.shape[1]
    m, c = chunk_layout(n, c)
    dt = jnp.dtype(compute_dtype)
    precision = lax.Precision.HIGHEST if dt == jnp.float32 else None
    t_N = t_N.astype(jnp.int32)
    # Bad target ids have NaN logprobs; their (masked-out) cotangent must not reach the gradient through index clipping.
    g_lp_N = jnp.where((t_N >= 0) & (t_N < v), g_lp_N.astype(jnp.float32), 0.0)
    xs = dict(
        h=h_NxD, t=jnp.clip(t_N, 0, v - 1), lse=lse_N, ent=entropy_N, g_lp=g_lp_N, g_ent=g_ent_N.astype(jnp.float32)
    )
    if top_k:
        xs.update(ids=topk_ids_NxK, g_topk=cts[3].astype(jnp.float32))
    if s_NxS is not None:
        xs.update(s=s_NxS, g_mass=cts[-1].astype(jnp.float32))
    xs = {k: _to_chunks(x, m, c) for k, x in xs.items()}
    w_cd_DxV = w_DxV.astype(dt)

    def body(dw_DxV, x):
        z_CxV = _scaled_logits(x["h"], w_cd_DxV, temperature, dt)
        logp_CxV = z_CxV - x["lse"][:, None]
        p_CxV = jnp.exp(logp_CxV)
        # Every logprob output contributes -g p; the entropy contributes -g_ent p (logp + H).
        g_total_C = x["g_lp"] + (jnp.sum(x["g_topk"], axis=-1) if top_k else 0.0)
        if s_NxS is not None:  # the support's log mass: -g p on every token, + g q_S on the support's
            lse_s_C, has_C, z_CxS = _support_logsumexp(z_CxV, x["s"])
            g_mass_C = jnp.where(has_C, x["g_mass"], 0.0)
            g_total_C = g_total_C + g_mass_C
            g_s_CxS = jnp.where(x["s"] >= 0, g_mass_C[:, None] * jnp.exp(z_CxS - lse_s_C[:, None]), 0.0)
        dz_CxV = -p_CxV * (g_total_C[:, None] + x["g_ent"][:, None] * (logp_CxV + x["ent"][:, None]))
        # The one-hot terms, as in-place scatters; row-batched (vmap) so that a sharded C axis stays sharded.
        dz_CxV = jax.vmap(lambda row_V, i, g: row_V.at[i].add(g))(dz_CxV, x["t"], x["g_lp"])
        if top_k:
            dz_CxV = jax.vmap(lambda row_V, i_K, g_K: row_V.at[i_K].add(g_K))(dz_CxV, x["ids"], x["g_topk"])
        if s_NxS is not None:
            s_CxS = jnp.clip(x["s"], 0, v - 1)  # padding ids add 0
            dz_CxV = jax.vmap(lambda row_V, i_S, g_S: row_V.at[i_S].add(g_S))(dz_CxV, s_CxS, g_s_CxS)
        dlogits_CxV = (dz_CxV / temperature).astype(dt)
        dh_CxD = jnp.einsum("cv,dv->cd", dlogits_CxV, w_cd_DxV, precision=precision, preferred_element_type=jnp.float32)
        dw_DxV = dw_DxV + jnp.einsum(
            "cd,cv->dv", x["h"].astype(dt), dlogits_CxV, precision=precision, preferred_element_type=jnp.float32
        )
        return dw_DxV, dh_CxD.astype(h_NxD.dtype)

    dw_DxV, dh_MxCxD = lax.scan(body, jnp.zeros((d, v), jnp.float32), xs)
    dh_NxD = _from_chunks(dh_MxCxD, n)
    # No gradient flows to the targets and support ids (integers) or the temperature.
    ds = None if s_NxS is None else np.zeros(s_NxS.shape, jax.dtypes.float0)
    return (
        dh_NxD,
        dw_DxV.astype(w_DxV.dtype),
        np.zeros(t_N.shape, jax.dtypes.float0),
        jnp.zeros_like(temperature),
        ds,
    )


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def token_logprobs_backward(
    hidden_NxD,
    unembed_DxV,
    targets_N,
    lse_N,
    entropy_N,
    g_logprobs_N,
    *,
    temperature=1.0,
    chunk_size: int = 1024,
    compute_dtype=None,
):
    """token_logprobs' backward pass on its own, from the per-token logsumexp and entropy its forward saved:
    (d hidden [N, D], d unembed [D, V]) for the cotangent `g_logprobs_N` of the logprobs (none on the entropy).
    It is the step's backward over the head, recompute included; `cisjax plan` compiles it alone to cost it."""
    h_NxD, t_N, temperature, compute_dtype, _ = _prepare(
        hidden_NxD, unembed_DxV, targets_N, temperature, 0, compute_dtype
    )
    res = (h_NxD, unembed_DxV, t_N, temperature, None, lse_N.reshape(-1), entropy_N.reshape(-1), None)
    dh, dw = _chunked_bwd(
        chunk_size, 0, compute_dtype, res, (g_logprobs_N.reshape(-1), jnp.zeros_like(entropy_N.reshape(-1)))
    )[:2]
    return dh.reshape(hidden_NxD.shape), dw


def _prepare(hidden, unembed_DxV, targets, temperature, top_k: int, compute_dtype):
    d, v = unembed_DxV.shape
    if hidden.shape[-1] != d:
        raise ValueError(f"hidden width {hidden.shape[-1]} != unembedding rows {d}")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden leading shape {hidden.shape[:-1]} != targets shape {targets.shape}")
    if not 0 <= top_k <= v:
        raise errors.UserError(f"top_k={top_k} must lie in [0, vocab={v}]")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise TypeError(f"targets must be integer ids, got {targets.dtype}")
    compute_dtype = jnp.dtype(hidden.dtype if compute_dtype is None else compute_dtype)
    temperature = jnp.asarray(temperature, jnp.float32)
    return hidden.reshape(-1, d), targets.reshape(-1), temperature, compute_dtype, hidden.shape[:-1]


def _prepare_support(support, lead: tuple, v: int):
    """The support ids [N, S] int32 (None stays None); its leading shape must be the targets'."""
    if support is None:
        return None
    if support.shape[:-1] != lead or support.ndim != len(lead) + 1:
        raise ValueError(f"support shape {support.shape} != targets shape {lead} + (S,)")
    if not jnp.issubdtype(support.dtype, jnp.integer):
        raise TypeError(f"support must be integer ids, got {support.dtype}")
    return support.reshape(-1, support.shape[-1]).astype(jnp.int32)


def _result(stats, lead: tuple, top_k: int, support: bool) -> TokenStats:
    lp, ent = stats[0].reshape(lead), stats[1].reshape(lead)
    topk = (stats[2].reshape(*lead, top_k), stats[3].reshape(*lead, top_k)) if top_k else (None, None)
    return TokenStats(lp, ent, *topk, stats[-1].reshape(lead) if support else None)


def token_logprobs(
    hidden_NxD,
    unembed_DxV,
    targets_N,
    *,
    temperature=1.0,
    chunk_size: int = 1024,
    top_k: int = 0,
    compute_dtype=None,
    support=None,
) -> TokenStats:
    """log p(target), entropy and optional top-k of softmax(hidden @ unembed / temperature), `chunk_size` tokens at a time.

    hidden [..., D] and targets [...] (ids in [0, V); an id outside gives a NaN logprob, so give masked positions any
    valid id); outputs keep the leading shape. The matmul runs in `compute_dtype` (default: hidden's dtype) with fp32
    accumulation; everything after it is fp32.

    Memory: lax.map over token chunks, so the forward holds one chunk's [chunk_size, V] logits at a time; the
    backward is a custom VJP doing what jax.checkpoint of each chunk would, with the derivative written out: it
    recomputes each chunk's logits, using the saved per-token logsumexp and entropy, so it never holds more than a
    chunk either (autodiff of a checkpointed chunk kept ~3 [chunk, V] fp32 buffers and a [D, V] sum in unembed's
    dtype on XLA:CPU). Chunks take every M-th token, so a batch sharding of the tokens carries over to each chunk.

    support [..., S] (int32 ids, < 0 = padding; distinct ids per token): each token's sampling support, the tokens an
    engine's top-k / top-p kept when it sampled there (mask replay); support_logmass is then log sum_{v in S} p(v), 0
    where a row has no id (nothing truncated), and logprobs - support_logmass is log p renormalised over S.

    Gradients flow to hidden and unembed from the logprobs, the entropy, the top-k logprobs and the support's log
    mass (none to the temperature); the backward matmuls take d(logits) in compute_dtype and the unembed gradient
    sums over chunks in fp32.
    """
    if chunk_size < 1:
        raise errors.UserError(f"chunk_size={chunk_size} must be positive")
    h_NxD, t_N, temperature, compute_dtype, lead = _prepare(
        hidden_NxD, unembed_DxV, targets_N, temperature, top_k, compute_dtype
    )
    s_NxS = _prepare_support(support, lead, unembed_DxV.shape[1])
    stats = _chunked(h_NxD, unembed_DxV, t_N, temperature, s_NxS, chunk_size, top_k, compute_dtype)
    return _result(stats, lead, top_k, s_NxS is not None)


def naive_token_logprobs(
    hidden_NxD,
    unembed_DxV,
    targets_N,
    *,
    temperature=1.0,
    chunk_size: int = 1024,
    top_k: int = 0,
    compute_dtype=None,
    support=None,
) -> TokenStats:
    """token_logprobs on the full [N, V] logits at once, differentiated by plain autodiff (chunk_size is ignored):
    the memory/time baseline and the test oracle."""
    del chunk_size
    h_NxD, t_N, temperature, compute_dtype, lead = _prepare(
        hidden_NxD, unembed_DxV, targets_N, temperature, top_k, compute_dtype
    )
    s_NxS = _prepare_support(support, lead, unembed_DxV.shape[1])
    stats = _stats_from_logits(_scaled_logits(h_NxD, unembed_DxV, temperature, compute_dtype), t_N, top_k, s_NxS)
    return _result((stats[0], stats[1]) + stats[3:], lead, top_k, s_NxS is not None)
