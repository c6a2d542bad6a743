"""Mixture-of-Experts: fp32 router (softmax top-k, group-limited), dropless exact dispatch, experts.

One piece for now, though over 500 lines: the routing, the dispatch kernels and expert parallelism are to move into a
`models/moe/` package with the GPU kernels' rework (grouped matmuls per platform), which changes them all at once."""

from __future__ import annotations

import functools
import math

import flax.nnx as nnx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from cisjax import errors, sharding
from cisjax.models.gpu_grouped import triton_swiglu
from cisjax.models.layers import param

IMPLS = ("auto", "tiled", "gmm", "triton", "ragged", "dense")


# ----------------------------------------------------------------------------- routing (pure)


def route(
    logits_NxE: jax.Array,
    *,
    k: int,
    method: str = "greedy",
    n_group: int | None = None,
    topk_group: int | None = None,
    norm_topk_prob: bool = False,
    scaling: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """Softmax router -> (weights [N, k] fp32, expert ids [N, k] int32), as the HF reference.

    method: "greedy" (top-k of all experts) or "group_limited_greedy" (DeepSeek-V2: keep the
    `topk_group` groups with the highest max-score, zero the others, then top-k).
    """
    probs_NxE = jax.nn.softmax(logits_NxE.astype(jnp.float32), axis=-1)
    scores_NxE = probs_NxE
    if method == "group_limited_greedy":
        n, e = probs_NxE.shape
        if not n_group or not topk_group or e % n_group:
            raise ValueError(
                f"group_limited_greedy needs n_group dividing {e} experts and topk_group; got {n_group}, {topk_group}"
            )
        group_NxG = probs_NxE.reshape(n, n_group, e // n_group).max(axis=-1)
        _, gidx_NxT = jax.lax.top_k(group_NxG, topk_group)
        keep_NxG = jnp.zeros_like(group_NxG, dtype=bool).at[jnp.arange(n)[:, None], gidx_NxT].set(True)
        keep_NxE = jnp.repeat(keep_NxG, e // n_group, axis=-1)
        scores_NxE = jnp.where(keep_NxE, probs_NxE, 0.0)
    elif method != "greedy":
        raise ValueError(f"unknown topk method {method!r} (greedy, group_limited_greedy)")
    w_NxK, ids_NxK = jax.lax.top_k(scores_NxE, k)
    if norm_topk_prob:
        w_NxK = w_NxK / jnp.sum(w_NxK, axis=-1, keepdims=True)
    return w_NxK * scaling, ids_NxK.astype(jnp.int32)


def replay_weights(
    logits_NxE: jax.Array, ids_NxK: jax.Array, *, norm_topk_prob: bool = False, scaling: float = 1.0
) -> jax.Array:
    """Gate weights [N, k] fp32 of given (replayed) expert ids: the router's fp32 softmax over all experts gathered
    at `ids`, renormalised over the k when `norm_topk_prob`, times `scaling` -- what `route` gives its own top-k ids,
    now at ids chosen elsewhere (the rollout engine's). Group limiting does not apply: it only chooses ids. The
    weights stay a function of the router's logits, so the router still gets a gradient."""
    probs_NxE = jax.nn.softmax(logits_NxE.astype(jnp.float32), axis=-1)
    w_NxK = jnp.take_along_axis(probs_NxE, ids_NxK.astype(jnp.int32), axis=-1)
    if norm_topk_prob:
        w_NxK = w_NxK / jnp.sum(w_NxK, axis=-1, keepdims=True)
    return w_NxK * scaling


# ----------------------------------------------------------------------------- grouped SwiGLU (tiled)

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


def default_impl(platform: str | None = None) -> str:
    """The dispatch for `platform` (default: the platform of the program being traced, see
    sharding.current_platform, so a CPU host compiling for a TPU mesh gets the TPU path).

    TPU: "gmm", megablox's grouped-matmul kernels, forward and both gradients (XLA's ragged_dot lowers its weight
    gradient to masked dense work over every expert, E times the FLOPs). GPU: "triton", cisjax's grouped matmuls in
    Pallas's Triton backend (gpu_grouped.py). CPU: "tiled" (ragged_dot lowers to E-fold masked dense work there)."""
    platform = platform or sharding.current_platform()
    return {"cpu": "tiled", "tpu": "gmm", "gpu": "triton", "cuda": "triton"}.get(platform, "ragged")


# ----------------------------------------------------------------------------- grouped SwiGLU (megablox gmm)

GMM_MAX_ROW_TILE = 512  # rows per kernel tile at most (MaxText's megablox default)


def gmm_tiling(rows: int, k: int, n: int) -> tuple[int, int, int]:
    """megablox (tm, tk, tn) for a [rows, k] x [k, n] grouped matmul: tm the rows rounded up to 16 (bf16 sublanes)
    up to GMM_MAX_ROW_TILE (the rows are padded to a multiple of tm); tk, tn the largest of 512, 256, 128 dividing
    the dimension (TPU lanes), else the whole dimension (always a legal block)."""

    def lanes(dim: int) -> int:
        return next((t for t in (512, 256, 128) if dim % t == 0), dim)

    return min(GMM_MAX_ROW_TILE, -(-max(rows, 1) // 16) * 16), lanes(k), lanes(n)


def _gmm_swiglu(xs_RxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, sizes_E, interpret: bool):
    """SwiGLU experts on expert-sorted rows with megablox gmm (its custom VJP: gmm for the input gradient, tgmm for
    the weights'). The rows are padded to a multiple of the row tile; the padding is zeros counted into the last
    group (its outputs are zero and add nothing to any gradient), so the kernels see group sizes summing to the rows.
    interpret: Pallas's interpreter (CPU tests); on TPU the Mosaic kernels."""
    from jax.experimental.pallas.ops.tpu.megablox import gmm  # lazy: tpu

    r, d = xs_RxD.shape
    f = wg_ExDxF.shape[2]
    tiling_up = gmm_tiling(r, d, f)
    pad = -r % tiling_up[0]
    xs_PxD = jnp.pad(xs_RxD, ((0, pad), (0, 0)))
    sizes_E = sizes_E.at[-1].add(pad)
    dtype = xs_RxD.dtype
    # positional: gmm is a custom_vjp with static (nondiff) arguments 3, 4, 7, 8
    g_PxF = gmm(xs_PxD, wg_ExDxF, sizes_E, dtype, tiling_up, None, None, False, interpret)
    u_PxF = gmm(xs_PxD, wu_ExDxF, sizes_E, dtype, tiling_up, None, None, False, interpret)
    h_PxF = jax.nn.silu(g_PxF) * u_PxF
    y_PxD = gmm(h_PxF, wo_ExFxD, sizes_E, dtype, gmm_tiling(r, f, d), None, None, False, interpret)
    return y_PxD[:r]


# ----------------------------------------------------------------------------- dispatch


def _ragged_swiglu(xs_RxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, sizes_E):
    """SwiGLU experts on expert-sorted rows with XLA's ragged_dot."""
    h_RxF = jax.nn.silu(jax.lax.ragged_dot(xs_RxD, wg_ExDxF, sizes_E)) * jax.lax.ragged_dot(xs_RxD, wu_ExDxF, sizes_E)
    return jax.lax.ragged_dot(h_RxF, wo_ExFxD, sizes_E)


def _sort_by_expert(ids_NxK, num_experts: int):
    """(order_R, sizes_E): the R = N*K (token, slot) assignments sorted by expert (stable: token order within a
    group), and each expert's group size."""
    flat_ids_R = ids_NxK.reshape(-1)
    order_R = jnp.argsort(flat_ids_R, stable=True).astype(jnp.int32)
    return order_R, jnp.bincount(flat_ids_R, length=num_experts).astype(jnp.int32)


def _sorted_ffn(swiglu, x_NxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, ids_NxK, w_NxK):
    """Sort the assignments by expert (_sort_by_expert), run swiglu(rows, wg, wu, wo, group sizes) on the sorted
    rows, un-sort and sum each token's k outputs, weighted."""
    n, d = x_NxD.shape
    k = ids_NxK.shape[1]
    order_R, sizes_E = _sort_by_expert(ids_NxK, wg_ExDxF.shape[0])
    ys_RxD = swiglu(x_NxD[order_R // k], wg_ExDxF, wu_ExDxF, wo_ExFxD, sizes_E)
    y_RxD = jnp.zeros_like(ys_RxD).at[order_R].set(ys_RxD)  # un-sort
    return jnp.einsum("nkd,nk->nd", y_RxD.reshape(n, k, d), w_NxK)


def _on_each_device(ffn, x_NxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, ids_NxK, w_NxK):
    """ffn on each device's own rows (shard_map over the active mesh; plain ffn without one): GSPMD does not
    partition a Pallas kernel. Rows split as "batch"; the expert weights are gathered except along the mesh axes of
    "expert_mlp", over which each device holds a slice of F and the outputs are summed (SwiGLU is elementwise in F).
    Used where the rules put E on no mesh axis; where they do, moe_ffn runs _expert_parallel instead."""
    ctx = sharding.active()
    if ctx is None:
        return ffn(x_NxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, ids_NxK, w_NxK)
    mesh, rules = ctx
    rows = sharding.logical_to_spec(("batch", None), rules, mesh, x_NxD.shape)
    row_axes = {a for a in jax.tree.leaves(tuple(rows)) if a is not None}
    (f_axes,) = sharding.logical_to_spec(("expert_mlp",), rules, mesh, wg_ExDxF.shape[2:])
    f_axes = tuple(a for a in ((f_axes,) if isinstance(f_axes, str) else f_axes or ()) if a not in row_axes)
    f_spec = f_axes[0] if len(f_axes) == 1 else (f_axes or None)
    up, down = PartitionSpec(None, None, f_spec), PartitionSpec(None, f_spec, None)

    def local(x, wg, wu, wo, ids, w):
        y = ffn(x, wg, wu, wo, ids, w)
        return jax.lax.psum(y, f_axes) if f_axes else y

    # check_vma off: megablox's pallas_call does not declare how its outputs vary over the mesh axes
    return jax.shard_map(local, mesh=mesh, in_specs=(rows, up, up, down, rows, rows), out_specs=rows, check_vma=False)(
        x_NxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, ids_NxK, w_NxK
    )


# ----------------------------------------------------------------------------- expert parallelism

# How tokens reach the experts' shards under expert parallelism: "a2a" (ragged all-to-all of the assignments),
# "gather" (all-gather the tokens, reduce-scatter the outputs), or "auto" (_expert_parallel_plan's rule). A module
# knob, not an argument: moe_ffn's signature is the model's; tests set it to run both exchanges on one mesh.
EP_EXCHANGE = "auto"


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def _expert_parallel_plan(w_shape, k: int) -> dict | None:
    """The mesh axes of expert parallelism for expert stacks of `w_shape` [E, D, F], or None (no active mesh, or the
    rules put E on no mesh axis of size > 1: then the dispatch is unchanged). The rules table says where E goes, as
    it does for the weights themselves, so model code never names a mesh axis.

    exchange: a ragged all-to-all sends each chip ~N*k*(ep-1)/ep of its rows and gets as many back; all-gather +
    reduce-scatter moves N*(ep-1) rows each way. So "a2a" when ep > k, else "gather" (also whenever the rows are
    not split over the expert axes: each chip already holds every token, and only a psum of the outputs is needed).
    """
    ctx = sharding.active()
    if ctx is None:
        return None
    mesh, rules = ctx
    e_spec, _, f_spec = sharding.logical_to_spec(("expert", None, "expert_mlp"), rules, mesh, w_shape)
    e_axes = _axes(e_spec)
    if not e_axes:
        return None
    ep = math.prod(mesh.shape[a] for a in e_axes)
    exchange = EP_EXCHANGE
    if exchange == "auto":
        exchange = "a2a" if ep > k else "gather"
    return dict(mesh=mesh, rules=rules, e_axes=e_axes, f_spec=f_spec, ep=ep, exchange=exchange)


def _masked_rows(swiglu, xs_BxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, sizes_E):
    """swiglu on expert-sorted rows whose groups may end before the buffer does: megablox visits only the groups'
    tiles and leaves the other rows of its outputs unwritten, forward (y) and backward (dx): both are masked (a select
    on the way in masks dx, on the way out y)."""
    valid_Bx1 = (jnp.arange(xs_BxD.shape[0]) < jnp.sum(sizes_E))[:, None]
    ys_BxD = swiglu(jnp.where(valid_Bx1, xs_BxD, 0), wg_ExDxF, wu_ExDxF, wo_ExFxD, sizes_E)
    return jnp.where(valid_Bx1, ys_BxD, 0)


def _tiled_rows(xs_BxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, sizes_E, tile=None):
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


def _exclusive_cumsum(a, axis=-1):
    return jnp.cumsum(a, axis=axis) - a


def _ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name):
    """jax.lax.ragged_all_to_all; on CPU (whose XLA has no such op) the same semantics from a dense all_to_all: each
    slice padded to the operand's rows, sent, and scattered into `output` at the offsets its sender chose. Tests run
    this form; TPU and GPU programs the native op."""
    if sharding.current_platform() != "cpu":
        return jax.lax.ragged_all_to_all(
            operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axis_name
        )
    m = operand.shape[0]
    s = input_offsets.shape[0]
    t_M = jnp.arange(m)
    # [S, M] rows of each slice (the padding rows read row 0 and are dropped on arrival)
    src_SxM = jnp.where(t_M < send_sizes[:, None], input_offsets[:, None] + t_M, 0)
    got = jax.lax.all_to_all(operand[src_SxM], axis_name, 0, 0, tiled=True)
    at_S = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    dst_SxM = jnp.where(t_M < recv_sizes[:, None], at_S[:, None] + t_M, output.shape[0])  # out of range: dropped
    return output.at[dst_SxM.reshape(s * m)].set(got.reshape(s * m, *operand.shape[1:]), mode="drop")


def _expert_parallel(ep, rows_fn, x_NxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, ids_NxK, w_NxK):
    """Expert parallelism: moe_ffn with each chip holding E/ep experts (the stacks split over ep["e_axes"], and over
    the "expert_mlp" axes in F with the outputs summed, as _on_each_device), under shard_map.

    "a2a": each chip sorts its (token, slot) assignments by expert and sends every expert's rows to the chip owning
    it with one ragged all-to-all, one slice per expert, placed so that the receiver's buffer is already grouped by
    its local experts (expert-major, sender-minor): rows_fn runs on it, a second ragged all-to-all (the first one's
    offsets mirrored) returns each row to its sender, which un-sorts and combines with the routing weights.
    "gather": every chip gathers the tokens of the chips it shares experts with, runs its own experts' assignments and
    the outputs are reduce-scattered back.

    Dropless: the receive buffer holds the worst case, every assignment of the ep chips (ep * N_local * k rows), as
    MaxText's dropless ragged all-to-all does. The group sizes are the real ones, so the tiled kernel and megablox
    (grid over the groups' tiles) work on the rows received, not on the buffer; XLA's and Pallas's static cost
    estimates count the buffer.
    """
    mesh, e_axes, ep_size = ep["mesh"], ep["e_axes"], ep["ep"]
    rows_spec = sharding.logical_to_spec(("batch", None), ep["rules"], mesh, x_NxD.shape)
    row_axes = set(_axes(rows_spec[0]))
    split = tuple(a for a in e_axes if a in row_axes)  # expert axes the tokens are split over
    rest = tuple(a for a in e_axes if a not in row_axes)  # and those they are replicated over
    exchange = ep["exchange"] if split == e_axes else "gather"
    f_axes = tuple(a for a in _axes(ep["f_spec"]) if a not in row_axes)
    f_spec = f_axes[0] if len(f_axes) == 1 else (f_axes or None)
    e_spec = e_axes[0] if len(e_axes) == 1 else e_axes
    up, down = PartitionSpec(e_spec, None, f_spec), PartitionSpec(e_spec, f_spec, None)
    k = ids_NxK.shape[1]
    e = wg_ExDxF.shape[0]
    e_loc = e // ep_size

    def a2a(x_NxD, wg, wu, wo, ids_NxK, w_NxK):
        n, d = x_NxD.shape
        me = jax.lax.axis_index(e_axes)
        order_R, counts_E = _sort_by_expert(ids_NxK, e)
        xs_RxD = x_NxD[order_R // k]
        # counts of every chip: c[i, j, l] = rows chip i sends to local expert l of chip j
        c_PxPxL = jax.lax.all_gather(counts_E, e_axes).reshape(ep_size, ep_size, e_loc)
        per_expert_PxL = c_PxPxL.sum(0)  # rows each chip's local experts receive
        group_start_PxL = _exclusive_cumsum(per_expert_PxL)  # receiver buffers: expert-major ...
        before_PxPxL = _exclusive_cumsum(c_PxPxL, axis=0)  # ... then by sender
        out_off_E = (group_start_PxL + before_PxPxL[me]).reshape(e)
        recv_PxL = c_PxPxL[:, me]  # from each sender, for each of my experts
        buf_rows = ep_size * n * k  # the worst case: every assignment of every chip comes here
        xb_BxD = _ragged_all_to_all(
            xs_RxD,
            jnp.zeros((buf_rows, d), x_NxD.dtype),
            _exclusive_cumsum(counts_E),
            counts_E,
            out_off_E,
            recv_PxL.reshape(e),
            e_axes,
        )
        yb_BxD = rows_fn(xb_BxD, wg, wu, wo, per_expert_PxL[me])
        # back: my slice (sender i, expert l) sits at group_start[me, l] + before[i, me, l]; it goes to where sender i
        # took it from, its own exclusive cumsum over the global experts
        sent_at_PxE = _exclusive_cumsum(c_PxPxL.reshape(ep_size, e))
        ys_RxD = _ragged_all_to_all(
            yb_BxD,
            jnp.zeros_like(xs_RxD),
            (group_start_PxL[me][None, :] + before_PxPxL[:, me]).reshape(e),
            recv_PxL.reshape(e),
            jax.lax.dynamic_slice_in_dim(sent_at_PxE, me * e_loc, e_loc, axis=1).reshape(e),
            counts_E,
            e_axes,
        )
        y_RxD = jnp.zeros_like(ys_RxD).at[order_R].set(ys_RxD)
        return jnp.einsum("nkd,nk->nd", y_RxD.reshape(n, k, d), w_NxK)

    def gather(x_NxD, wg, wu, wo, ids_NxK, w_NxK):
        if split:
            x_NxD, ids_NxK, w_NxK = (jax.lax.all_gather(a, split, tiled=True) for a in (x_NxD, ids_NxK, w_NxK))
        n, d = x_NxD.shape
        first = jax.lax.axis_index(e_axes) * e_loc
        local_R = ids_NxK.reshape(-1) - first
        # assignments to other chips' experts sort last, into no group
        key_R = jnp.where((local_R >= 0) & (local_R < e_loc), local_R, e_loc)
        order_R = jnp.argsort(key_R, stable=True).astype(jnp.int32)
        sizes_L = jnp.bincount(key_R, length=e_loc + 1)[:e_loc].astype(jnp.int32)
        ys_RxD = rows_fn(x_NxD[order_R // k], wg, wu, wo, sizes_L)
        y_RxD = jnp.zeros_like(ys_RxD).at[order_R].set(ys_RxD)
        y_NxD = jnp.einsum("nkd,nk->nd", y_RxD.reshape(n, k, d), w_NxK)
        if split:
            y_NxD = jax.lax.psum_scatter(y_NxD, split, scatter_dimension=0, tiled=True)
        return jax.lax.psum(y_NxD, rest) if rest else y_NxD

    body = a2a if exchange == "a2a" else gather

    def local(*args):
        y = body(*args)
        return jax.lax.psum(y, f_axes) if f_axes else y

    rows = PartitionSpec(rows_spec[0], None)
    # check_vma off: megablox's pallas_call does not declare how its outputs vary over the mesh axes
    return jax.shard_map(local, mesh=mesh, in_specs=(rows, up, up, down, rows, rows), out_specs=rows, check_vma=False)(
        x_NxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, ids_NxK, w_NxK
    )


def moe_ffn(
    x_NxD: jax.Array,
    wg_ExDxF: jax.Array,
    wu_ExDxF: jax.Array,
    wo_ExFxD: jax.Array,
    ids_NxK: jax.Array,
    w_NxK: jax.Array,
    *,
    impl: str = "auto",
    tile: int | None = None,
) -> jax.Array:
    """sum_k w[n,k] * expert_{ids[n,k]}(x[n]) with SwiGLU experts; dropless, every assignment exact.

    Weights are applied in the compute dtype (as the HF reference casts them to the logits dtype).
    impl: "tiled" (loops of row tiles, the CPU path; `tile` is the largest tile height, default choose_tile, see
    _tiled_swiglu), "gmm" (megablox's TPU kernels on each device's rows; Pallas's interpreter off TPU, for tests),
    "triton" (gpu_grouped.py's Triton grouped matmuls on each device's rows; Pallas's interpreter off GPU, for tests),
    "ragged" (XLA's ragged_dot), "dense" (every expert on every token: the reference), "auto" (default_impl).
    On an active mesh whose rules split E (the "expert" logical axis) over mesh axes of size > 1, tiled, gmm and
    ragged run expert-parallel (_expert_parallel: tokens travel to the chips that hold their experts); dense is left
    to GSPMD.
    """
    x_NxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, ids_NxK, w_NxK = map(
        jnp.asarray, (x_NxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, ids_NxK, w_NxK)
    )
    n, d = x_NxD.shape
    e, _, f = wg_ExDxF.shape
    k = ids_NxK.shape[1]
    if impl == "auto":
        impl = default_impl()
    if impl not in IMPLS:
        raise errors.UserError(f"unknown moe impl {impl!r}; one of {IMPLS}")
    w_NxK = w_NxK.astype(x_NxD.dtype)

    if impl == "dense":  # every expert on every token: a reference, E/k times the FLOPs
        g_ExNxF = jnp.einsum("nd,edf->enf", x_NxD, wg_ExDxF)
        u_ExNxF = jnp.einsum("nd,edf->enf", x_NxD, wu_ExDxF)
        y_ExNxD = jnp.einsum("enf,efd->end", jax.nn.silu(g_ExNxF) * u_ExNxF, wo_ExFxD)
        comb_NxE = jnp.zeros((n, e), x_NxD.dtype).at[jnp.arange(n)[:, None], ids_NxK].add(w_NxK)
        return jnp.einsum("end,ne->nd", y_ExNxD, comb_NxE)

    platform = sharding.current_platform()
    if impl == "gmm":
        if platform in sharding.GPU_PLATFORMS:
            raise errors.UserError("moe impl 'gmm' is megablox's TPU kernel; on GPU use 'triton'")
        swiglu = functools.partial(_gmm_swiglu, interpret=platform != "tpu")  # the interpreter: CPU tests
    if impl == "triton":
        if platform == "tpu":
            raise errors.UserError("moe impl 'triton' is a GPU kernel; on TPU use 'gmm'")
        swiglu = functools.partial(
            triton_swiglu, interpret=platform not in sharding.GPU_PLATFORMS
        )  # the interpreter: CPU tests
    ep = _expert_parallel_plan(wg_ExDxF.shape, k)
    if ep is not None:
        rows_fn = {
            "gmm": lambda *a: _masked_rows(swiglu, *a),
            "triton": lambda *a: _masked_rows(swiglu, *a),
            "ragged": _ragged_swiglu,  # rows past the groups come out zero
            "tiled": functools.partial(_tiled_rows, tile=tile or choose_tile(n * k // ep["ep"], e // ep["ep"])),
        }[impl]
        return _expert_parallel(ep, rows_fn, x_NxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, ids_NxK, w_NxK)
    if impl in ("gmm", "triton"):
        return _on_each_device(
            functools.partial(_sorted_ffn, swiglu), x_NxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, ids_NxK, w_NxK
        )
    if impl == "ragged":
        return _sorted_ffn(_ragged_swiglu, x_NxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, ids_NxK, w_NxK)

    rows = n * k
    order_R, sizes_E = _sort_by_expert(ids_NxK, e)

    # tiled: the sorted rows plus a tail of don't-care rows that a group's last tile may run into
    tiles = tile_sizes(max(min(tile or choose_tile(rows, e), rows), 1))  # a tile never exceeds the rows
    tail = tiles[-1]
    start_E = jnp.cumsum(sizes_E) - sizes_E
    token_S = jnp.concatenate([order_R // k, jnp.zeros(tail, jnp.int32)])
    w_S = jnp.concatenate([w_NxK.reshape(-1)[order_R], jnp.zeros(tail, w_NxK.dtype)])
    return _tiled_swiglu(x_NxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, w_S, token_S, start_E, sizes_E, tiles)


class MoE(nnx.Module):
    """Router + routed SwiGLU experts (shared experts live in the family files)."""

    def __init__(
        self,
        d_model: int,
        d_expert: int,
        num_experts: int,
        k: int,
        *,
        rngs: nnx.Rngs,
        param_dtype,
        dtype,
        method: str = "greedy",
        n_group: int | None = None,
        topk_group: int | None = None,
        norm_topk_prob: bool = False,
        scaling: float = 1.0,
        router_dtype=jnp.float32,
        impl: str = "auto",
        tile: int | None = None,
    ):
        self.k, self.dtype, self.router_dtype = k, dtype, router_dtype
        # a tuple, not a dict: static attributes must be hashable for jax.jit(static graphdef)
        self.route_kw = tuple(
            dict(
                method=method, n_group=n_group, topk_group=topk_group, norm_topk_prob=norm_topk_prob, scaling=scaling
            ).items()
        )
        self.impl, self.tile = impl, tile
        self.router_DxE = param(rngs, (d_model, num_experts), ("embed", "router_experts"), param_dtype)
        self.wg_ExDxF = param(rngs, (num_experts, d_model, d_expert), ("expert", "embed", "expert_mlp"), param_dtype)
        self.wu_ExDxF = param(rngs, (num_experts, d_model, d_expert), ("expert", "embed", "expert_mlp"), param_dtype)
        self.wo_ExFxD = param(rngs, (num_experts, d_expert, d_model), ("expert", "expert_mlp", "embed"), param_dtype)

    def __call__(self, x_BxLxD: jax.Array, replay_BxLxK: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """Returns (y [B, L, D], the router's own top-k expert ids [B, L, k]).

        replay_BxLxK: expert ids to use instead of the router's choice (routing replay: the rollout engine's ids,
        any integer dtype); the gate weights are then replay_weights at those ids. The returned ids are still the
        router's own, so a caller can count where they differ."""
        b, l, d = x_BxLxD.shape
        x_NxD = x_BxLxD.reshape(b * l, d).astype(self.dtype)
        logits_NxE = jnp.einsum(
            "nd,de->ne", x_NxD.astype(self.router_dtype), self.router_DxE[...].astype(self.router_dtype)
        )
        route_kw = dict(self.route_kw)
        w_NxK, ids_NxK = route(logits_NxE, k=self.k, **route_kw)
        own_NxK = ids_NxK
        if replay_BxLxK is not None:
            if replay_BxLxK.shape != (b, l, self.k):
                raise ValueError(f"replayed routing {replay_BxLxK.shape} for tokens {(b, l)} and k={self.k}")
            ids_NxK = replay_BxLxK.reshape(b * l, self.k).astype(jnp.int32)
            w_NxK = replay_weights(
                logits_NxE, ids_NxK, norm_topk_prob=route_kw["norm_topk_prob"], scaling=route_kw["scaling"]
            )
        y_NxD = moe_ffn(
            x_NxD,
            self.wg_ExDxF[...].astype(self.dtype),
            self.wu_ExDxF[...].astype(self.dtype),
            self.wo_ExFxD[...].astype(self.dtype),
            ids_NxK,
            w_NxK,
            impl=self.impl,
            tile=self.tile,
        )
        y_BxLxD = sharding.constrain(y_NxD.reshape(b, l, d), ("batch", "length", "act_embed"))
        return y_BxLxD, own_NxK.reshape(b, l, self.k)
