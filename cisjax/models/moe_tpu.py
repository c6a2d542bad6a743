"""The TPU MoE dispatch ("gmm"): SwiGLU experts on megablox's grouped matmuls (gmm forward, gmm + tgmm backward)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cisjax.models.padding import round_up

GMM_MAX_ROW_TILE = 512  # rows per kernel tile at most (MaxText's megablox default)


def gmm_tiling(rows: int, k: int, n: int, groups: int = 1) -> tuple[int, int, int]:
    """megablox (tm, tk, tn) for a [rows, k] x [k, n] grouped matmul of `groups` groups: tm the power of two at or
    above the mean group size, within [16 (bf16 sublanes), GMM_MAX_ROW_TILE], and no more than the rows rounded up
    to 16 (the rows are padded to a multiple of tm); tk, tn the largest of 512, 256, 128 dividing the dimension (TPU
    lanes), else the whole dimension (always a legal block).

    The kernel visits each row tile once per group it overlaps, computing all tm rows each time, so the tile follows
    the groups: a decode step's few rows per expert (Qwen1.5-MoE's 512 rows per chip over 60 experts: 8.5) in tiles
    of 16, not of 512 (61 visits of 512 rows: 60x the rows' work); training's thousands per expert in tiles of 512."""

    def lanes(dim: int) -> int:
        return next((t for t in (512, 256, 128) if dim % t == 0), dim)

    mean = -(-max(rows, 1) // max(groups, 1))
    tm = 16
    while tm < min(mean, GMM_MAX_ROW_TILE):
        tm *= 2
    return min(tm, round_up(max(rows, 1), 16)), lanes(k), lanes(n)


def megablox_swiglu(xs_RxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, sizes_E, interpret: bool):
    """SwiGLU experts on expert-sorted rows with megablox gmm (its custom VJP: gmm for the input gradient, tgmm for
    the weights'). The rows are padded to a multiple of the row tile; the padding is zeros counted into the last
    group (its outputs are zero and add nothing to any gradient), so the kernels see group sizes summing to the rows.
    interpret: Pallas's interpreter (CPU tests); on TPU the Mosaic kernels."""
    from jax.experimental.pallas.ops.tpu.megablox import gmm  # lazy: tpu

    r, d = xs_RxD.shape
    f = wg_ExDxF.shape[2]
    e = wg_ExDxF.shape[0]
    tiling_up = gmm_tiling(r, d, f, e)
    pad = -r % tiling_up[0]
    xs_PxD = jnp.pad(xs_RxD, ((0, pad), (0, 0)))
    sizes_E = sizes_E.at[-1].add(pad)
    dtype = xs_RxD.dtype
    # positional: gmm is a custom_vjp with static (nondiff) arguments 3, 4, 7, 8
    g_PxF = gmm(xs_PxD, wg_ExDxF, sizes_E, dtype, tiling_up, None, None, False, interpret)
    u_PxF = gmm(xs_PxD, wu_ExDxF, sizes_E, dtype, tiling_up, None, None, False, interpret)
    h_PxF = jax.nn.silu(g_PxF) * u_PxF
    y_PxD = gmm(h_PxF, wo_ExFxD, sizes_E, dtype, gmm_tiling(r, f, d, e), None, None, False, interpret)
    return y_PxD[:r]
