"""The CPU MoE dispatch ("tiled"): SwiGLU experts in loops of row tiles per expert, with a custom VJP."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from cisjax.models.routing import sort_by_expert

MIN_TILE = 16  # smallest tile: each expert group pads (computes and discards) fewer rows than this


def tile_sizes(tile: int) -> tuple[int, ...]:
    """Static tile heights: `tile`, then quarters (a half where a quarter would go below MIN_TILE)
    down to MIN_TILE, e.g. 256 -> (256, 64, 16), 512 -> (512, 128, 32, 16); (tile,) if tile < 32.
    Quarters, not halves: each height is another copy of the loop bodies to compile, and the
    matmuls run as fast either way."""
    sizes = [tile]
    while sizes[-1] % 2 == 0 and sizes[-1] // 2 >= MIN_TILE:
        t = sizes[-1]
        sizes.append(t // 4 if t % 4 == 0 and t // 4 >= MIN_TILE else t // 2)
    return tuple(sizes)


def choose_tile(rows: int, num_experts: int) -> int:
    """Largest tile: the power of two at or below the mean group size rows / E, within [16, 512].

    A group runs as many tiles of each height of tile_sizes as fit, largest first, then one masked
    tile: padding stays < MIN_TILE rows per expert whatever the tile, so the tile only trades
    matmul efficiency (bigger is better) against rows left to smaller tiles.
    """
    target = max(rows // max(num_experts, 1), 1)
    tile = 16
    while tile * 2 <= min(target, 512):
        tile *= 2
    return tile


def _cover_group(start, size, tiles: tuple[int, ...], body, carry):
    """carry = body(t, row0, n_valid, carry) over tiles covering rows [start, start + size) in order.

    For each height t of `tiles` (decreasing) a loop over as many full t-row tiles as the rest
    holds, then, if rows remain (< tiles[-1]), one tiles[-1]-row tile with n_valid = the rest
    (None for full tiles): only that last tile reads and writes past the group.
    """
    done = 0
    for t in tiles:
        n_t = (size - done) // t
        carry = jax.lax.fori_loop(0, n_t, lambda j, c, t=t, r0=start + done: body(t, r0 + j * t, None, c), carry)
        done = done + n_t * t
    rest = size - done
    return jax.lax.cond(rest > 0, lambda c: body(tiles[-1], start + done, rest, c), lambda c: c, carry)


def _bits(dtype) -> jnp.dtype:
    """Storage of loop-carried `dtype` buffers: 16-bit floats as their uint16 bit patterns (XLA:CPU
    upcasts a bf16 buffer whole, per iteration, around a dynamic-update-slice into it)."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.uint16) if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 2 else dtype


def _pack(x, dtype):
    x = x.astype(dtype)
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if _bits(dtype) != x.dtype else x


def _unpack(bits, dtype):
    return jax.lax.bitcast_convert_type(bits, dtype) if bits.dtype != jnp.dtype(dtype) else bits


def _dsilu(g):
    s = jax.nn.sigmoid(g)
    return s * (1 + g * (1 - s))


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _tiled_swiglu(x_NxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, w_S, token_S, start_E, sizes_E, tiles):
    """y[n] = sum_r w[r] * swiglu_{e(r)}(x[n]) over the sorted assignment rows r of token n.

    Rows are grouped by expert: group e = [start_e, start_e + size_e) of the sorted order, row r
    holding token token[r] with routing weight w[r]. A loop over experts (each expert's weights
    sliced once, gate and up fused into one D x 2F matmul) runs a loop over the group's tiles
    (_cover_group): gather the tile's token rows of x, SwiGLU, scatter-add w * out into y. So no
    sorted copy of x, of the outputs or of their cotangents is ever materialised (each would be a
    fresh N*k x D buffer per call). A group's last tile may run up to tiles[-1] - 1 rows into the
    next groups (or into the tail: S = N*k + tiles[-1]): those rows are masked out of y, dx and dW,
    and what it writes to their saved gate/up rows and dw is rewritten when their own group runs.
    Gate/up pre-activations (S x 2F) are the only residual: the backward recomputes no matmul.
    Math inside the loops is fp32; buffers written in the loops hold the input dtypes, 16-bit floats
    as uint16 bits (_bits): XLA:CPU would otherwise convert a whole bf16 buffer per iteration.
    """
    return _tiled_swiglu_fwd(x_NxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, w_S, token_S, start_E, sizes_E, tiles)[0]


def _expert_loop(sizes_E, expert, carry):
    """fori over experts; an expert with no rows skips its weight slices (and keeps a zero dW)."""
    return jax.lax.fori_loop(
        0, sizes_E.shape[0], lambda i, c: jax.lax.cond(sizes_E[i] > 0, expert, lambda _, c: c, i, c), carry
    )


def _tiled_swiglu_fwd(x_NxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, w_S, token_S, start_E, sizes_E, tiles):
    n, d = x_NxD.shape
    f = wg_ExDxF.shape[2]
    f32 = jnp.float32
    x32_NxD, w32_S = x_NxD.astype(f32), w_S.astype(f32)

    def expert(i, carry):
        wgu_Dx2F = jnp.concatenate([wg_ExDxF[i], wu_ExDxF[i]], axis=1).astype(f32)
        wo_FxD = wo_ExFxD[i].astype(f32)

        def tile_fn(t, r0, n_valid, carry):
            y_NxD, gu_Sx2F = carry
            tok_T = jax.lax.dynamic_slice_in_dim(token_S, r0, t)
            gu_Tx2F = x32_NxD[tok_T] @ wgu_Dx2F
            y_TxD = (jax.nn.silu(gu_Tx2F[:, :f]) * gu_Tx2F[:, f:]) @ wo_FxD
            wy_TxD = jax.lax.dynamic_slice_in_dim(w32_S, r0, t)[:, None] * y_TxD
            if n_valid is not None:  # rows of the next groups
                wy_TxD = jnp.where((jnp.arange(t) < n_valid)[:, None], wy_TxD, 0)
            return y_NxD.at[tok_T].add(wy_TxD), jax.lax.dynamic_update_slice_in_dim(
                gu_Sx2F, _pack(gu_Tx2F, x_NxD.dtype), r0, 0
            )

        return _cover_group(start_E[i], sizes_E[i], tiles, tile_fn, carry)

    init = (jnp.zeros((n, d), f32), jnp.zeros((token_S.shape[0], 2 * f), _bits(x_NxD.dtype)))
    y_NxD, gu_Sx2F = _expert_loop(sizes_E, expert, init)
    return y_NxD.astype(x_NxD.dtype), (x_NxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, w_S, token_S, start_E, sizes_E, gu_Sx2F)


def _tiled_swiglu_bwd(tiles, res, dy_NxD):
    x_NxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, w_S, token_S, start_E, sizes_E, gu_Sx2F = res
    f = wg_ExDxF.shape[2]
    f32 = jnp.float32
    x32_NxD, w32_S, dy32_NxD = x_NxD.astype(f32), w_S.astype(f32), dy_NxD.astype(f32)

    def expert(i, carry):
        dx_NxD, dw_S, dwg, dwu, dwo = carry
        wgu_Dx2F = jnp.concatenate([wg_ExDxF[i], wu_ExDxF[i]], axis=1).astype(f32)
        wo_FxD = wo_ExFxD[i].astype(f32)

        def tile_fn(t, r0, n_valid, c):
            dx_NxD, dw_S, dwgu_Dx2F, dwo_FxD = c
            tok_T = jax.lax.dynamic_slice_in_dim(token_S, r0, t)
            x_TxD, dy_TxD = x32_NxD[tok_T], dy32_NxD[tok_T]
            w_Tx1 = jax.lax.dynamic_slice_in_dim(w32_S, r0, t)[:, None]
            gu_Tx2F = _unpack(jax.lax.dynamic_slice_in_dim(gu_Sx2F, r0, t), x_NxD.dtype).astype(f32)
            g_TxF, u_TxF = gu_Tx2F[:, :f], gu_Tx2F[:, f:]
            sg_TxF = jax.nn.silu(g_TxF)
            h_TxF = sg_TxF * u_TxF
            dhw_TxF = jnp.einsum("td,fd->tf", dy_TxD, wo_FxD)  # d loss / d h, before the routing weight
            dw_T = jnp.sum(h_TxF * dhw_TxF, axis=-1)
            dh_TxF = dhw_TxF * w_Tx1
            wh_TxF = h_TxF * w_Tx1
            dgu_Tx2F = jnp.concatenate([dh_TxF * u_TxF * _dsilu(g_TxF), dh_TxF * sg_TxF], axis=1)
            if n_valid is not None:  # rows of the next groups: no contribution to this expert's dW or to dx
                valid_Tx1 = (jnp.arange(t) < n_valid)[:, None]
                wh_TxF = jnp.where(valid_Tx1, wh_TxF, 0)
                dgu_Tx2F = jnp.where(valid_Tx1, dgu_Tx2F, 0)
            dwo_FxD = dwo_FxD + jnp.einsum("tf,td->fd", wh_TxF, dy_TxD)
            dwgu_Dx2F = dwgu_Dx2F + jnp.einsum("td,tf->df", x_TxD, dgu_Tx2F)
            dx_TxD = jnp.einsum("tf,df->td", dgu_Tx2F, wgu_Dx2F)
            # dw of the masked rows is rewritten by their own group (or is a don't-care tail row)
            return (
                dx_NxD.at[tok_T].add(dx_TxD),
                jax.lax.dynamic_update_slice_in_dim(dw_S, dw_T, r0, 0),
                dwgu_Dx2F,
                dwo_FxD,
            )

        init = (dx_NxD, dw_S, jnp.zeros(wgu_Dx2F.shape, f32), jnp.zeros(wo_FxD.shape, f32))
        dx_NxD, dw_S, dwgu_Dx2F, dwo_FxD = _cover_group(start_E[i], sizes_E[i], tiles, tile_fn, init)
        dwg = jax.lax.dynamic_update_index_in_dim(dwg, _pack(dwgu_Dx2F[:, :f], wg_ExDxF.dtype), i, 0)
        dwu = jax.lax.dynamic_update_index_in_dim(dwu, _pack(dwgu_Dx2F[:, f:], wu_ExDxF.dtype), i, 0)
        dwo = jax.lax.dynamic_update_index_in_dim(dwo, _pack(dwo_FxD, wo_ExFxD.dtype), i, 0)
        return dx_NxD, dw_S, dwg, dwu, dwo

    init = (
        jnp.zeros(x_NxD.shape, f32),
        jnp.zeros(w_S.shape, f32),
        *(jnp.zeros(w.shape, _bits(w.dtype)) for w in (wg_ExDxF, wu_ExDxF, wo_ExFxD)),
    )
    dx_NxD, dw_S, dwg, dwu, dwo = _expert_loop(sizes_E, expert, init)
    return (
        dx_NxD.astype(x_NxD.dtype),
        _unpack(dwg, wg_ExDxF.dtype),
        _unpack(dwu, wu_ExDxF.dtype),
        _unpack(dwo, wo_ExFxD.dtype),
        dw_S.astype(w_S.dtype),
        None,
        None,
        None,
    )


_tiled_swiglu.defvjp(_tiled_swiglu_fwd, _tiled_swiglu_bwd)


def tiled_rows(xs_BxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, sizes_E, tile=None):
    """The tiled kernel on rows already sorted by expert (groups may end before the buffer: the rest stay zero): each
    row is its own "token" with weight 1 (the routing weights are applied by the caller), so the loops run over the
    groups' rows only, not over the static buffer."""
    b = xs_BxD.shape[0]
    e = sizes_E.shape[0]
    tiles = tile_sizes(max(min(tile or choose_tile(b, e), b), 1))
    tail = tiles[-1]
    token_S = jnp.concatenate([jnp.arange(b, dtype=jnp.int32), jnp.zeros(tail, jnp.int32)])
    w_S = jnp.ones(b + tail, xs_BxD.dtype)
    start_E = jnp.cumsum(sizes_E) - sizes_E
    return _tiled_swiglu(xs_BxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, w_S, token_S, start_E, sizes_E, tiles)


def tiled_ffn(x_NxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, ids_NxK, w_NxK, tile: int | None = None):
    """moe_ffn's "tiled" impl on one device: the assignments sorted by expert (never copied: _tiled_swiglu gathers
    each tile's token rows), `tile` the largest tile height (default choose_tile)."""
    n = x_NxD.shape[0]
    e = wg_ExDxF.shape[0]
    k = ids_NxK.shape[1]
    rows = n * k
    order_R, sizes_E = sort_by_expert(ids_NxK, e)

    # the sorted rows plus a tail of don't-care rows that a group's last tile may run into
    tiles = tile_sizes(max(min(tile or choose_tile(rows, e), rows), 1))  # a tile never exceeds the rows
    tail = tiles[-1]
    start_E = jnp.cumsum(sizes_E) - sizes_E
    token_S = jnp.concatenate([order_R // k, jnp.zeros(tail, jnp.int32)])
    w_S = jnp.concatenate([w_NxK.reshape(-1)[order_R], jnp.zeros(tail, w_NxK.dtype)])
    return _tiled_swiglu(x_NxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, w_S, token_S, start_E, sizes_E, tiles)
