"""The exact path's attention pieces per family (GQA: Qwen2, Qwen2-MoE, Qwen3-MoE; MLA: DeepSeek-V2) on row tiles.

A tile is [T] tokens, one query each. `project` gives a tile's queries (rotary applied) and its cache entries (what a
KV cache keeps per token: attn.cache_shapes() without the slot axis); `attend` runs each query over its own row's
cache arrays [T, ...per-row, slots at slot_axis] under a [T, S] mask; `out` is the output projection. MLA attends in
the latent space (absorbed_attention: the decode's form), in the trainer's forward too, so that both reduce the same
[S] latents in the same order."""

from __future__ import annotations

import jax.numpy as jnp

from cisjax.models.attention import cache_attention
from cisjax.models.deepseek_v2 import MLAttention, absorbed_attention
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
