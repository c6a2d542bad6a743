"""Batch-invariant ("exact") forward and KV-cache decode: a token's values do not depend on the other tokens, rows,
batch shape or sequence length, so the sampler's q and the trainer's p agree to the last bit (issue 49, prototype).

Why: on XLA:CPU a row's result depends on the shape of the op it is computed in. A [M, K] x [K, N] dot takes other
kernels (YNNPACK's tilings, Eigen, strength-reduced multiply-reduce at M = 1) by shape, and a reduction over the
minor axis is emitted differently for few rows and for many (measured: NOTES_issue49.md). The decode (R rows, one
query each, over a cache) and the train step ([B, T] rows, T queries each) therefore compute every op in another
order, and so do two train batches of other shapes.

How: every per-token computation runs in ROW tiles of a fixed shape (`tiled`: a lax.map over [TILE, ...] tiles, one
loop body compiled the same in every program; its inputs and outputs behind optimization barriers, so that XLA
fuses nothing of the surrounding program into it). A tile's rows are independent: a row's result is the same
whatever the other rows of its tile are (measured on XLA:CPU: position in the tile and neighbours do not matter).
Attention is per query: each query attends over its row's keys laid out slot = position, over a fixed number of
slots `slots` (masked slots contribute exact zeros: exp(finfo.min - max) = 0), so the decode's cache and the
training forward's keys give the same reduction. The logprob is the trainer's formula, z_t - logsumexp(z).

Scope of the prototype: the dense families built from qwen2_moe.Attention (Qwen2; Qwen2-MoE's attention, without
its MoE) and a dense MLP; fp32 and bf16 compute; temperature sampling (no top-k / top-p). Not wired into the train
step or the engine yet (exact_forward is what a train step in exact mode would call instead of model.__call__)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from cisjax.models.attention import cache_attention
from cisjax.models.layers import apply_rope, dense
from cisjax.models.transformer import CausalLM, layer_of, layer_runs

TILE = 16  # rows per tile: every per-token op runs on [TILE, ...] tiles (the CPU decode's width step)


def tiled(fn, *args, tile: int = TILE):
    """fn over fixed-shape row tiles: args [N, ...] (the same N) -> fn's outputs [N, ...], N padded to a multiple
    of `tile` with zero rows (their results dropped). One loop body of [tile, ...] shapes in every program."""
    n = args[0].shape[0]
    pad = -(-n // tile) * tile - n

    def chunks(a):
        a = jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1))
        return a.reshape(-1, tile, *a.shape[1:])

    def body(xs):
        xs = lax.optimization_barrier(xs)  # nothing of the surrounding program fuses into the body
        return lax.optimization_barrier(fn(*xs))

    out = lax.map(body, tuple(chunks(a) for a in args))
    return jax.tree.map(lambda o: o.reshape(-1, *o.shape[2:])[:n], out)


def _layers(model: CausalLM):
    return [layer_of(model.stacks[r], j) for r, run in enumerate(layer_runs(model.cfg)) for j in range(len(run))]


def _qkv(layer, x_TxD, pos_T):
    """A tile's queries (rotary applied) [T, N, H], keys [T, K, H] and values [T, K, H]."""
    attn = layer.attn
    h_Tx1xD = layer.attn_norm(x_TxD[:, None])
    q = attn.query(h_Tx1xD)
    k, v = attn.kv(h_Tx1xD, pos_T[:, None])
    cos, sin = attn._rope(pos_T[:, None])
    q = apply_rope(q, cos, sin)
    return q[:, 0], k[:, 0], v[:, 0]


def _attend(layer, q_TxNxH, k_TxKxSxH, v_TxKxSxH, mask_TxS):
    """Each of a tile's queries over its own row's keys: [T, N*H] (before the output projection)."""
    cfg = layer.attn.cfg
    o = cache_attention(q_TxNxH[:, None], k_TxKxSxH, v_TxKxSxH, mask_TxS[:, None], cfg.head_dim**-0.5)
    return o.reshape(o.shape[0], -1)


def _post(layer, x_TxD, o_TxQ):
    """The output projection, the residual, the MLP block and its residual, on a tile."""
    x = x_TxD + dense(o_TxQ, layer.attn.wo_QxD, layer.attn.cfg.dtype)
    y, _ = layer.mlp_block(x[:, None])
    return x + y[:, 0]


def _head(model, x_TxD, t_T, temperature: float):
    """(logprob of target t under softmax(z / temperature), z / temperature [T, V]) of a tile: the final norm, the
    unembedding (compute dtype, fp32 accumulation) and the trainer's z_t - logsumexp(z) (logprobs._stats_from_logits)."""
    dt = jnp.dtype(model.cfg.dtype)
    h = model.norm(x_TxD)
    z = jnp.einsum("cd,dv->cv", h.astype(dt), model.unembedding_DxV().astype(dt), preferred_element_type=jnp.float32)
    z = z / temperature
    lse = jax.nn.logsumexp(z, axis=-1)
    zt = jnp.take_along_axis(z, jnp.clip(t_T, 0, z.shape[1] - 1)[:, None], axis=-1)[:, 0]
    return zt - lse, z, lse


def _gather_rows(kv_BxKxSxH, row_T):
    return jnp.take(kv_BxKxSxH, row_T, axis=0)


def exact_forward(model: CausalLM, tokens_BxT, positions_BxT, targets_BxT, *, slots: int, temperature: float = 1.0):
    """The trainer's side: logprobs [B, T] of targets, rows left-aligned (position = slot), each query attending over
    its row's slots up to its own (one segment per row). `slots` >= T: the fixed key length of the decode's cache."""
    b, t = tokens_BxT.shape
    if slots < t:
        raise ValueError(f"slots={slots} < T={t}")
    x = jnp.take(model.embed_VxD[...], tokens_BxT, axis=0).astype(model.cfg.dtype).reshape(b * t, -1)
    pos = positions_BxT.reshape(-1).astype(jnp.int32)
    row = jnp.repeat(jnp.arange(b, dtype=jnp.int32), t)
    slot_S = jnp.arange(slots)
    mask = slot_S[None] <= pos[:, None]  # [B T, S]
    for layer in _layers(model):
        q, k, v = tiled(functools.partial(_qkv, layer), x, pos)
        kh, vh = (jnp.pad(a.reshape(b, t, *a.shape[1:]), ((0, 0), (0, slots - t), (0, 0), (0, 0))) for a in (k, v))
        kh, vh = (jnp.moveaxis(a, 1, 2) for a in (kh, vh))  # [B, K, S, H]
        o = tiled(
            lambda q, r, m, layer=layer, kh=kh, vh=vh: _attend(layer, q, *(_gather_rows(a, r) for a in (kh, vh)), m),
            q,
            row,
            mask,
        )
        x = tiled(functools.partial(_post, layer), x, o)
    lp, _, _ = tiled(lambda x, tt: _head(model, x, tt, temperature), x, targets_BxT.reshape(-1))
    return lp.reshape(b, t)


def init_cache(model: CausalLM, rows: int, slots: int):
    """Per layer (keys, values) [R, K, S, H] in the compute dtype: slot = position."""
    cfg = model.cfg
    shape = (rows, cfg.num_key_value_heads, slots, cfg.head_dim)
    return [(jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype)) for _ in range(cfg.num_hidden_layers)]


def exact_step(model: CausalLM, cache, tok_R, pos_R, *, temperature: float = 1.0):
    """One token per row at its position pos_R (its slot) through the cache -> (z / temperature [R, V] of the next
    token, its logprobs z - logsumexp(z) [R, V] (the trainer's formula: the sampled token's is z_t - lse, the same
    subtraction of the same two values as exact_forward's), the cache)."""
    r = tok_R.shape[0]
    slots = cache[0][0].shape[2]
    x = jnp.take(model.embed_VxD[...], tok_R, axis=0).astype(model.cfg.dtype)
    rows = jnp.arange(r, dtype=jnp.int32)
    mask = jnp.arange(slots)[None] <= pos_R[:, None]
    new = []
    for layer, (kc, vc) in zip(_layers(model), cache):
        q, k, v = tiled(functools.partial(_qkv, layer), x, pos_R)
        kc = kc.at[rows, :, pos_R].set(k.astype(kc.dtype))
        vc = vc.at[rows, :, pos_R].set(v.astype(vc.dtype))
        new.append((kc, vc))
        o = tiled(
            lambda q, rr, m, layer=layer, kc=kc, vc=vc: _attend(layer, q, *(_gather_rows(a, rr) for a in (kc, vc)), m),
            q,
            rows,
            mask,
        )
        x = tiled(functools.partial(_post, layer), x, o)
    _, z, lse = tiled(lambda x, tt: _head(model, x, tt, temperature), x, jnp.zeros((r,), jnp.int32))
    return z, z - lse[:, None], new


def sample(model: CausalLM, prompts: list, max_new: int, key, *, slots: int, temperature: float = 1.0):
    """Sample max_new tokens per prompt with the exact decode (rows = prompts; prompts fed one position per step, so
    a row's prompt and response go through the same program). Returns (tokens [R, max_new], q [R, max_new]): q the
    logprob of each sampled token by the trainer's formula, computed from the same logits row that was sampled."""
    r = len(prompts)
    plen = [len(p) for p in prompts]
    total = max(plen) + max_new
    if total > slots:
        raise ValueError(f"{total} positions > slots={slots}")
    feed = jnp.zeros((r, total), jnp.int32)
    for i, p in enumerate(prompts):
        feed = feed.at[i, : len(p)].set(jnp.asarray(p, jnp.int32))
    plen_R = jnp.asarray(plen, jnp.int32)
    step = jax.jit(functools.partial(exact_step, temperature=temperature))
    cache = init_cache(model, r, slots)
    out_tok = jnp.zeros((r, max_new), jnp.int32)
    out_q = jnp.zeros((r, max_new), jnp.float32)
    # row i feeds its prompt then its samples: at step s its position is s; it samples at positions >= plen - 1
    for s in range(total - 1):
        z, lp, cache = step(model, cache, feed[:, s], jnp.full((r,), s, jnp.int32))
        key, sub = jax.random.split(key)
        drawn = jax.random.categorical(sub, lp, axis=-1).astype(jnp.int32)
        j = s + 1 - plen_R  # the response index this step samples (< 0: still in the prompt)
        sampling = (j >= 0) & (j < max_new)
        nxt = jnp.where(sampling, drawn, feed[:, s + 1])
        feed = feed.at[:, s + 1].set(nxt)
        qv = jnp.take_along_axis(lp, drawn[:, None], axis=-1)[:, 0]
        jj = jnp.clip(j, 0, max_new - 1)
        out_tok = out_tok.at[jnp.arange(r), jj].set(jnp.where(sampling, drawn, out_tok[jnp.arange(r), jj]))
        out_q = out_q.at[jnp.arange(r), jj].set(jnp.where(sampling, qv, out_q[jnp.arange(r), jj]))
    return out_tok, out_q
