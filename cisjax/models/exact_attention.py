"""The exact path's attention pieces per family (GQA: Qwen2, Qwen2-MoE, Qwen3-MoE; MLA: DeepSeek-V2) on row tiles.

A tile is [T] tokens, one query each. `project` gives a tile's queries (rotary applied) and its cache entries (what a
KV cache keeps per token: attn.cache_shapes() without the slot axis); `attend` runs each query over its own row's
cache arrays [T, ...per-row, slots at slot_axis] under a [T, S] mask; `out` is the output projection. MLA attends in
the latent space (absorbed_attention: the decode's form), in the trainer's forward too, so that both reduce the same
[S] latents in the same order."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from cisjax.models import cpu_bits
from cisjax.models.attention import cache_attention
from cisjax.models.deepseek_v2 import MLAttention, absorbed_attention
from cisjax.models.exact_head import MIN_TRIPS, isolated
from cisjax.models.layers import apply_rope, dense
from cisjax.models.transformer import slot_axis


def is_mla(attn) -> bool:
    return isinstance(attn, MLAttention)


def slot_axes(attn) -> tuple[int, ...]:
    """Per cache array, the axis of its slots in the per-row shape (attn.cache_shapes()'s None)."""
    return tuple(slot_axis(shape) for shape in attn.cache_shapes())


def project(layer, x_TxD, pos_T):
    """(queries [T, N, H] with rotary applied, cache entries: a tuple of [T, ...] in the compute dtype) of a tile."""
    attn = layer.attn
    dt = attn.cfg.dtype
    h_Tx1xD = layer.attn_norm(x_TxD[:, None])
    q_Tx1xNxH = attn.query(h_Tx1xD)
    entries = attn.kv(h_Tx1xD, pos_T[:, None])
    cos, sin = attn._rope(pos_T[:, None])
    if is_mla(attn):  # the rotary half only, in fp32 and interleaved (MLAttention.attend)
        nope = attn.cfg.qk_nope_head_dim
        q_pe = apply_rope(q_Tx1xNxH[..., nope:].astype(jnp.float32), cos, sin, interleaved=True).astype(dt)
        q_Tx1xNxH = jnp.concatenate([q_Tx1xNxH[..., :nope], q_pe], axis=-1)
    else:
        q_Tx1xNxH = apply_rope(q_Tx1xNxH, cos, sin)
    return q_Tx1xNxH[:, 0], tuple(e[:, 0].astype(dt) for e in entries)


def attend(layer, q_TxNxH, rows, mask_TxS):
    """Each query over its own row's cache arrays `rows` (a tuple of [T, ...per-row]) -> [T, N * V] (before the
    output projection)."""
    attn = layer.attn
    cfg, dt = attn.cfg, attn.cfg.dtype
    t, n = q_TxNxH.shape[:2]
    if is_mla(attn):
        nope, c = cfg.qk_nope_head_dim, cfg.kv_lora_rank
        latent_TxSxC, k_pe_TxSx1xP = rows
        w_CxNxW = attn.wkv_b_CxK[...].reshape(c, n, nope + cfg.v_head_dim).astype(dt)
        o = absorbed_attention(
            q_TxNxH[:, None, :, :nope],
            q_TxNxH[:, None, :, nope:],
            latent_TxSxC,
            k_pe_TxSx1xP[:, :, 0],
            w_CxNxW[..., :nope],
            w_CxNxW[..., nope:],
            mask_TxS[:, None],
            cfg.softmax_scale(),
        )
    else:
        k_TxKxSxH, v_TxKxSxH = rows
        o = cache_attention(q_TxNxH[:, None], k_TxKxSxH, v_TxKxSxH, mask_TxS[:, None], cfg.head_dim**-0.5)
    return o.reshape(t, -1)


def out(layer, o_TxQ):
    """The attention's output projection (and its bias, where the family has one) -> [T, D]."""
    attn = layer.attn
    cfg, dt = attn.cfg, attn.cfg.dtype
    if is_mla(attn):
        return dense(o_TxQ, attn.wo_VxD, dt, attn.bo_D if cfg.attention_bias else None)
    y_TxD = dense(o_TxQ, attn.wo_QxD, dt)
    if getattr(attn, "bo_D", None) is not None:  # Qwen3-MoE with attention_bias
        y_TxD = y_TxD + attn.bo_D[...].astype(dt)
    return y_TxD


# ----------------------------------------------------------------------------- blocked (online softmax) attention


def _block_rows(a, row_T, start, size: int, axis: int, shared: bool):
    """Rows row_T of a layer's arrays [B, ...per-row], slots start .. start + size only -> [T, ...per-row with size
    slots]. shared: every query of the tile is in row row_T[0]; its block is sliced once and broadcast to the tile
    (the same array as the per-query gather's, at a fraction of its cost)."""
    if shared:
        blk = lax.dynamic_slice_in_dim(lax.dynamic_index_in_dim(a, row_T[0], keepdims=False), start, size, axis)
        return jnp.broadcast_to(blk, (row_T.shape[0], *blk.shape))
    at = (row_T[:, None],) + (slice(None),) * axis + ((start + jnp.arange(size))[None, :],)
    return jnp.moveaxis(a[at], 1, 1 + axis)


def _queries(layer, q_TxNxH):
    """What a block's scores take of the tile's queries: GQA's [T, K, G, H]; MLA's absorbed [T, N, C] and rotary
    [T, N, P]."""
    attn = layer.attn
    cfg, dt = attn.cfg, attn.cfg.dtype
    if is_mla(attn):
        nope, c = cfg.qk_nope_head_dim, cfg.kv_lora_rank
        n = q_TxNxH.shape[1]
        w_uk_CxNxE = attn.wkv_b_CxK[...].reshape(c, n, nope + cfg.v_head_dim)[..., :nope].astype(dt)
        return jnp.einsum("tne,cne->tnc", q_TxNxH[..., :nope], w_uk_CxNxE), q_TxNxH[..., nope:]
    t, n, h = q_TxNxH.shape
    kv = cfg.num_key_value_heads
    return (q_TxNxH.reshape(t, kv, n // kv, h),)


def _scores(layer, qs, blk):
    """A block's scaled scores [T, ..., S'] fp32 (GQA [T, K, G, S'], MLA [T, N, S'])."""
    attn = layer.attn
    if is_mla(attn):
        (q_TxNxC, q_pe_TxNxP), (latent_TxSxC, k_pe_TxSx1xP) = qs, blk
        s = jnp.einsum("tnc,tsc->tns", q_TxNxC, latent_TxSxC, preferred_element_type=jnp.float32)
        s += jnp.einsum("tnp,tsp->tns", q_pe_TxNxP, k_pe_TxSx1xP[:, :, 0], preferred_element_type=jnp.float32)
        return s * attn.cfg.softmax_scale()
    (q_TxKxGxH,), (k_TxKxSxH, _) = qs, blk
    s = jnp.einsum("tkgh,tksh->tkgs", q_TxKxGxH, k_TxKxSxH, preferred_element_type=jnp.float32)
    return s * attn.cfg.head_dim**-0.5


def _values(layer, p, blk):
    """A block's probabilities (in the values' dtype) times its values, fp32: GQA [T, K, G, V], MLA [T, N, C]."""
    if is_mla(layer.attn):
        latent_TxSxC = blk[0]
        return jnp.einsum(
            "tns,tsc->tnc", p.astype(latent_TxSxC.dtype), latent_TxSxC, preferred_element_type=jnp.float32
        )
    v_TxKxSxV = blk[1]
    return jnp.einsum("tksv,tkgs->tkgv", v_TxKxSxV, p.astype(v_TxKxSxV.dtype), preferred_element_type=jnp.float32)


def _block_update(layer, qs, blk, valid_TxS, m, l, acc):
    """One key block of the online softmax: (running max, running sum, running output), all fp32. A block where no
    query of the tile has a key leaves them as they are, bit for bit (m unchanged: exp(0) = 1, every p = 0)."""
    s = _scores(layer, qs, blk)
    valid = valid_TxS.reshape(valid_TxS.shape[:1] + (1,) * (s.ndim - 2) + valid_TxS.shape[1:])
    s = jnp.where(valid, s, jnp.finfo(jnp.float32).min)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[..., None])
    return m_new, l * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + _values(layer, p, blk)


def attend_blocked(layer, arrays, q_TxNxH, row_T, pos_T, *, block: int, shared: bool = False):
    """Each query over its row's slots up to its position, in key blocks of `block` slots aligned at slot 0 (a flash
    online softmax), each block's update isolated (the same compiled body in the decode and the trainer's forward);
    blocks past the tile's last position skipped (lax.cond: exactly what running them would leave) -> [T, N * V].
    arrays: the layer's per-row arrays [B, ...per-row] (the cache, or the trainer's layout of its keys); a query's
    row in them is row_T. shared: all the tile's queries are in one row (the trainer's tiles of a row's consecutive
    positions): each block is read once and broadcast to the tile instead of gathered per query."""
    attn = layer.attn
    cfg, dt = attn.cfg, attn.cfg.dtype
    axes = slot_axes(attn)
    slots = arrays[0].shape[1 + axes[0]]
    if slots % block:
        raise ValueError(f"slots={slots} is not a multiple of the key block {block}")
    qs = _queries(layer, q_TxNxH)
    live = jnp.max(pos_T) // block + 1  # the tile's blocks holding a key
    x_shape = qs[0].shape[:-1]
    width = cfg.kv_lora_rank if is_mla(attn) else arrays[1].shape[-1]
    # sliced as bits (XLA:CPU's bf16 cost); arrays held as bits already (the sampler's cache) go in as they are
    kinds, bits = (jnp.dtype(dt),) * len(arrays), cpu_bits.to_bits(arrays)

    def body(carry, j):
        def run(carry):
            slot_S = j * block + jnp.arange(block)
            blk = tuple(_block_rows(a, row_T, j * block, block, ax, shared) for a, ax in zip(bits, axes))
            blk = cpu_bits.from_bits(blk, kinds)
            valid_TxS = slot_S[None] <= pos_T[:, None]
            return isolated(lambda *a: _block_update(layer, *a), qs, blk, valid_TxS, *carry)

        return lax.cond(j < live, run, lambda c: c, carry), None

    init = (jnp.full(x_shape, -jnp.inf), jnp.zeros(x_shape), jnp.zeros((*x_shape, width)))
    # at least MIN_TRIPS blocks (those past the slots are never live): a loop of one trip would be inlined
    (_, l, acc), _ = lax.scan(body, init, jnp.arange(max(slots // block, MIN_TRIPS)))
    o = (acc / l[..., None]).astype(dt)
    t = q_TxNxH.shape[0]
    if is_mla(attn):
        n, nope = q_TxNxH.shape[1], cfg.qk_nope_head_dim
        w_uv_CxNxV = attn.wkv_b_CxK[...].reshape(cfg.kv_lora_rank, n, nope + cfg.v_head_dim)[..., nope:].astype(dt)
        o = jnp.einsum("tnc,cnv->tnv", o, w_uv_CxNxV)
    return o.reshape(t, -1)
