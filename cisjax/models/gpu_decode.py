"""Decode attention for NVIDIA GPUs in Pallas's Triton backend, reading a layer of a stacked KV cache in place."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MIN_ROWS = 16  # Triton's tl.dot needs every block dimension >= 16: a kv head's query heads pad to it
# fp32 blocks multiply in full fp32 (Triton's default is TF32: gpu_grouped._PRECISION); bf16 blocks are unaffected
_PRECISION = jax.lax.Precision.HIGHEST


def _body(layer_ref, start_ref, end_ref, q_ref, k_ref, v_ref, o_ref, l_ref, m_ref, *, scale, part, block):
    """Program (row r, kv head k, part j): the row's slots of part j from its first valid one to its last, in blocks
    of `block` slots (an online softmax in fp32), -> the part's unnormalised output, sum and max."""
    r, kh, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    base = j * part
    lo, hi = jnp.maximum(start_ref[r], base), jnp.minimum(end_ref[r], base + part)
    q_GxH = plgpu.load(q_ref.at[r, kh])
    g = q_GxH.shape[0]

    def step(i, carry):
        o_GxH, m_G, l_G = carry
        s0 = base + i * block
        k_TxH = plgpu.load(k_ref.at[layer, r, kh, pl.ds(s0, block), :])
        s_GxT = plgpu.dot(q_GxH, k_TxH, trans_b=True, precision=_PRECISION).astype(jnp.float32) * scale
        slot_T = s0 + jnp.arange(block)
        s_GxT = jnp.where(((slot_T >= lo) & (slot_T < hi))[None, :], s_GxT, jnp.finfo(jnp.float32).min)
        m_next = jnp.maximum(m_G, jnp.max(s_GxT, axis=1))
        alpha = jnp.exp(m_G - m_next)
        p_GxT = jnp.exp(s_GxT - m_next[:, None])
        v_TxH = plgpu.load(v_ref.at[layer, r, kh, pl.ds(s0, block), :])
        pv_GxH = plgpu.dot(p_GxT.astype(v_TxH.dtype), v_TxH, precision=_PRECISION).astype(jnp.float32)
        return alpha[:, None] * o_GxH + pv_GxH, m_next, alpha * l_G + jnp.sum(p_GxT, axis=1)

    h = q_GxH.shape[1]
    init = (jnp.zeros((g, h), jnp.float32), jnp.full((g,), jnp.finfo(jnp.float32).min), jnp.zeros((g,), jnp.float32))
    # the blocks holding lo .. hi - 1 (none where the row has no slot in this part)
    o_GxH, m_G, l_G = jax.lax.fori_loop((lo - base) // block, (hi - base + block - 1) // block, step, init)
    plgpu.store(o_ref.at[r, kh, j], o_GxH)
    plgpu.store(l_ref.at[r, kh, j], l_G)
    plgpu.store(m_ref.at[r, kh, j], m_G)


def attend(q_BxLxNxH, k_nxBxKxSxH, v_nxBxKxSxH, layer, start_B, end_B, *, scale, part, block, slots, interpret):
    """One query per row over layer `layer` of stacked heads-major keys and values [n, B, K, S', H] (read in place:
    each program loads its blocks of the layer), each row's slots start_B .. end_B - 1 -> [B, 1, N, H] (fp32).
    The first `slots` slots of each row are split in parts of `part` (a program each per kv head: flash decoding),
    walked in blocks of `block`; the parts' outputs are combined outside the kernel."""
    b, _, n, h = q_BxLxNxH.shape
    kv, s = k_nxBxKxSxH.shape[2], slots
    g = n // kv
    gp = max(MIN_ROWS, 1 << (g - 1).bit_length())
    parts = s // part
    q_BxKxGxH = jnp.pad(q_BxLxNxH.reshape(b, kv, g, h), ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    size = k_nxBxKxSxH.dtype.itemsize
    cost = pl.CostEstimate(  # at most: every slot of every row
        flops=4 * b * kv * gp * s * h, transcendentals=b * kv * gp * s, bytes_accessed=2 * b * kv * s * h * size
    )
    o, l, m = pl.pallas_call(
        functools.partial(_body, scale=scale, part=part, block=block),
        out_shape=(
            jax.ShapeDtypeStruct((b, kv, parts, gp, h), jnp.float32),
            jax.ShapeDtypeStruct((b, kv, parts, gp), jnp.float32),
            jax.ShapeDtypeStruct((b, kv, parts, gp), jnp.float32),
        ),
        grid=(b, kv, parts),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        cost_estimate=cost,
        name="cisjax_decode_attention",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), start_B, end_B, q_BxKxGxH, k_nxBxKxSxH, v_nxBxKxSxH)
    m_BxKxG = jnp.max(m, axis=2)
    w_BxKxPxG = jnp.exp(m - m_BxKxG[:, :, None])
    l_BxKxG = jnp.sum(l * w_BxKxPxG, axis=2)
    o_BxKxGxH = jnp.sum(o * w_BxKxPxG[..., None], axis=2) / l_BxKxG[..., None]
    return o_BxKxGxH[:, :, :g].reshape(b, 1, n, h)
