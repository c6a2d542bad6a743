"""Grouped matmuls for NVIDIA GPUs in Pallas's Triton backend: gmm (x @ W[group]) and tgmm (dW per group)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from cisjax.models import stacked
from cisjax.models.padding import pad_axes, round_up

MIN_BLOCK = 16  # Triton's tl.dot needs every block dimension >= 16
# Every tl.dot at HIGHEST: fp32 blocks multiply in full fp32 (Triton's default, like XLA's on GPU, is TF32: 3e-4
# relative error measured on an H200, so an fp32 run would not be fp32); bf16 blocks are unaffected (no TF32 there).
_PRECISION = jax.lax.Precision.HIGHEST


def _block(dim: int, pref: int) -> int:
    """Largest power of two <= pref dividing dim (dim a multiple of MIN_BLOCK)."""
    b = pref
    while dim % b:
        b //= 2
    return b


def row_block(rows: int, groups: int) -> int:
    """Rows per tile: the power of two at or below half the mean group size, within [16, 128]. Each group computes up
    to one partial tile of padding (half a tile on average): at most 1.5x the rows at the mean, ~1.25x expected, for
    groups of that size; bigger tiles run the matmul faster (Hopper's wgmma is 64 rows high)."""
    bm = MIN_BLOCK
    while bm * 2 <= min(rows // max(2 * groups, 1), 128):
        bm *= 2
    return bm


def _tiles(sizes_G, bm: int, max_tiles: int):
    """Per row tile t: (group, first row, group end). Group g gets ceil(size_g / bm) tiles starting at its first row;
    the tiles past the last group's are empty (first row = end = 0). max_tiles = ceil(rows / bm) + groups bounds the
    count statically."""
    ends_G = jnp.cumsum(sizes_G)
    starts_G = ends_G - sizes_G
    ntiles_G = (sizes_G + bm - 1) // bm
    tile_end_G = jnp.cumsum(ntiles_G)
    t_T = jnp.arange(max_tiles, dtype=jnp.int32)
    g_T = jnp.minimum(jnp.searchsorted(tile_end_G, t_T, side="right"), sizes_G.shape[0] - 1).astype(jnp.int32)
    valid_T = t_T < tile_end_G[-1]
    row0_T = starts_G[g_T] + (t_T - (tile_end_G - ntiles_G)[g_T]) * bm
    return g_T, jnp.where(valid_T, row0_T, 0).astype(jnp.int32), jnp.where(valid_T, ends_G[g_T], 0).astype(jnp.int32)


def _gmm_kernel(layer_ref, g_ref, row0_ref, end_ref, x_ref, w_ref, out_ref, *, bm, bk, bn, k_dim, trans_w):
    t, j = pl.program_id(0), pl.program_id(1)
    g, row0, end = g_ref[t], row0_ref[t], end_ref[t]
    layer = layer_ref[0]  # W's layer in its stack [n, G, ...] (n = 1: W alone)

    @pl.when(row0 < end)
    def _():
        mask_Mx1 = (row0 + jnp.arange(bm) < end)[:, None]  # rows of the next group: not read, not written
        n0 = j * bn

        def body(i, acc_MxN):
            k0 = i * bk
            a_MxK = plgpu.load(x_ref.at[pl.ds(row0, bm), pl.ds(k0, bk)], mask=mask_Mx1, other=0)
            if trans_w:  # W[g] stored [N, K]: the transposed weight of the input gradient, never materialised
                b = plgpu.load(w_ref.at[layer, g, pl.ds(n0, bn), pl.ds(k0, bk)]).astype(a_MxK.dtype)
                return acc_MxN + plgpu.dot(a_MxK, b, trans_b=True, precision=_PRECISION).astype(jnp.float32)
            b = plgpu.load(w_ref.at[layer, g, pl.ds(k0, bk), pl.ds(n0, bn)]).astype(a_MxK.dtype)
            return acc_MxN + plgpu.dot(a_MxK, b, precision=_PRECISION).astype(jnp.float32)

        acc_MxN = jax.lax.fori_loop(0, k_dim // bk, body, jnp.zeros((bm, bn), jnp.float32))
        plgpu.store(out_ref.at[pl.ds(row0, bm), pl.ds(n0, bn)], acc_MxN.astype(out_ref.dtype), mask=mask_Mx1)


def _gmm(x_RxK, w_GxKxN, sizes_G, *, trans_w: bool, interpret: bool):
    """out[r] = x[r] @ W[group(r)] (trans_w: W given as [G, N, K]). Rows are padded by one tile so that every tile's
    window lies inside the arrays (Pallas's interpreter clamps windows that do not); K and N to multiples of 16.
    W may be a stacked.LayerOf: the kernel reads its layer in the stack (in place, cast to x's dtype on its loads),
    unless W must be padded (then the layer is sliced out)."""
    r, k = x_RxK.shape
    g = w_GxKxN.shape[0]
    n = w_GxKxN.shape[1 if trans_w else 2]
    kp, np_ = round_up(k, MIN_BLOCK), round_up(n, MIN_BLOCK)
    bm, bk, bn = row_block(r, g), _block(kp, 64), _block(np_, 128)
    x_PxK = pad_axes(x_RxK, {0: r + bm, 1: kp})
    if isinstance(w_GxKxN, stacked.LayerOf) and (kp, np_) == (k, n):
        w, layer = w_GxKxN.stack, w_GxKxN.layer
    else:
        w_GxKxN = stacked.array(w_GxKxN)
        w = pad_axes(w_GxKxN, {1: np_ if trans_w else kp, 2: kp if trans_w else np_})[None]
        layer = 0
    max_tiles = -(-r // bm) + g
    tiles = _tiles(sizes_G, bm, max_tiles)
    kernel = functools.partial(_gmm_kernel, bm=bm, bk=bk, bn=bn, k_dim=kp, trans_w=trans_w)
    # at most: every tile full (a group's last tile computes up to bm - 1 rows of the next); each reads its row block
    # of x and W[group]'s K x bn slice once per N block
    tile_rows = max_tiles * bm
    size = x_RxK.dtype.itemsize
    cost = pl.CostEstimate(
        flops=2 * tile_rows * kp * np_,
        transcendentals=0,
        bytes_accessed=size * (tile_rows * kp * (np_ // bn) + max_tiles * kp * np_ + tile_rows * np_),
    )
    out_PxN = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((r + bm, np_), x_RxK.dtype),
        grid=(max_tiles, np_ // bn),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
        cost_estimate=cost,
        name="cisjax_gmm",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), *tiles, x_PxK, w)
    return out_PxN[:r, :n]


def _tgmm_kernel(start_ref, end_ref, x_ref, dy_ref, out_ref, *, bm, bk, bn):
    g, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, end = start_ref[g], end_ref[g]
    k0, n0 = i * bk, j * bn

    def body(step, acc_KxN):
        row0 = start + step * bm
        mask_Mx1 = (row0 + jnp.arange(bm) < end)[:, None]  # other groups' rows add nothing
        x_MxK = plgpu.load(x_ref.at[pl.ds(row0, bm), pl.ds(k0, bk)], mask=mask_Mx1, other=0)
        dy_MxN = plgpu.load(dy_ref.at[pl.ds(row0, bm), pl.ds(n0, bn)], mask=mask_Mx1, other=0)
        return acc_KxN + plgpu.dot(x_MxK, dy_MxN, trans_a=True, precision=_PRECISION).astype(jnp.float32)

    # an empty group runs no step and writes zeros
    acc_KxN = jax.lax.fori_loop(0, (end - start + bm - 1) // bm, body, jnp.zeros((bk, bn), jnp.float32))
    plgpu.store(out_ref.at[g, pl.ds(k0, bk), pl.ds(n0, bn)], acc_KxN.astype(out_ref.dtype))


def _tgmm(x_RxK, dy_RxN, sizes_G, out_dtype, *, interpret: bool):
    """dW[g] = x[rows of g]^T @ dy[rows of g]: one program per (group, K block, N block) over its group's rows only."""
    r, k = x_RxK.shape
    n = dy_RxN.shape[1]
    g = sizes_G.shape[0]
    kp, np_ = round_up(k, MIN_BLOCK), round_up(n, MIN_BLOCK)
    bm, bk, bn = row_block(r, g), _block(kp, 64), _block(np_, 64)
    x_PxK = pad_axes(x_RxK, {0: r + bm, 1: kp})
    dy_PxN = pad_axes(dy_RxN, {0: r + bm, 1: np_})
    ends_G = jnp.cumsum(sizes_G).astype(jnp.int32)
    kernel = functools.partial(_tgmm_kernel, bm=bm, bk=bk, bn=bn)
    # at most: every group's rows in full bm steps (R + G * bm rows), read once per (K block, N block)
    step_rows = r + g * bm
    size = x_RxK.dtype.itemsize
    cost = pl.CostEstimate(
        flops=2 * step_rows * kp * np_,
        transcendentals=0,
        bytes_accessed=size * step_rows * (kp * (np_ // bn) + np_ * (kp // bk))
        + g * kp * np_ * jnp.dtype(out_dtype).itemsize,
    )
    out_GxKxN = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((g, kp, np_), out_dtype),
        grid=(g, kp // bk, np_ // bn),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
        cost_estimate=cost,
        name="cisjax_tgmm",
    )(ends_G - sizes_G, ends_G, x_PxK, dy_PxN)
    return out_GxKxN[:, :k, :n]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def gmm(x_RxK, w_GxKxN, sizes_G, interpret: bool = False):
    """Grouped matmul on rows sorted by group: out[r] = x[r] @ W[group(r)], sum(sizes) = rows. Backward: the input
    gradient is gmm with W transposed in the kernel, the weight gradient tgmm; both visit only each group's rows.
    interpret: Pallas's interpreter (CPU tests); on GPU the Triton kernels."""
    return _gmm(x_RxK, w_GxKxN, sizes_G, trans_w=False, interpret=interpret)


def _gmm_fwd(x_RxK, w_GxKxN, sizes_G, interpret):
    return gmm(x_RxK, w_GxKxN, sizes_G, interpret), (x_RxK, w_GxKxN, sizes_G)


def _gmm_bwd(interpret, res, dout_RxN):
    x_RxK, w_GxKxN, sizes_G = res
    if isinstance(w_GxKxN, stacked.LayerOf):
        raise NotImplementedError("gmm's gradient of a stacked.LayerOf: a decode's weights only")
    dx_RxK = _gmm(dout_RxN, w_GxKxN, sizes_G, trans_w=True, interpret=interpret)
    dw_GxKxN = _tgmm(x_RxK, dout_RxN, sizes_G, w_GxKxN.dtype, interpret=interpret)
    return dx_RxK.astype(x_RxK.dtype), dw_GxKxN, None


gmm.defvjp(_gmm_fwd, _gmm_bwd)


def triton_swiglu(xs_RxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, sizes_E, interpret: bool):
    """SwiGLU experts on expert-sorted rows with the Triton grouped matmuls (moe_ffn's "triton" impl)."""
    h_RxF = jax.nn.silu(gmm(xs_RxD, wg_ExDxF, sizes_E, interpret)) * gmm(xs_RxD, wu_ExDxF, sizes_E, interpret)
    return gmm(h_RxF, wo_ExFxD, sizes_E, interpret)
