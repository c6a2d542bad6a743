"""SwiGLU experts on the warp-specialized kernels with gate and up in one launch and SwiGLU / dSwiGLU in epilogues."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from cisjax.models import ragged_ws
from cisjax.models.padding import round_up
from cisjax.models.ragged_ws import COMPUTE_WGS, ROW_ALIGN, Task, Tiles, store_rows

# the fused kernels' columns per compute warpgroup: two fp32 accumulators (gate and up) or an accumulator and the
# gate and up tiles it combines with must fit in a warpgroup's registers: 2 x 128 x 64 fp32 is 128 a thread
BLOCK_N = 64


def _silu_parts(g):
    """(sigmoid(g), silu(g)) in fp32: exp and one division (what the kernels' epilogues lower)."""
    s = 1.0 / (1.0 + jnp.exp(-g))
    return s, g * s


def _rows(vec_smem, shape):
    """A [block_m] fp32 vector of per-row values in shared memory, as the rows of a [block_m, block_n] tile."""
    return jax.lax.broadcast_in_dim(vec_smem[...], shape, [0])


def _load_weights(plgpu, task: Task, scratch: dict, w_gmem, barrier_index) -> None:
    """Start the TMA load of the task's block_m routing weights (one per row, fp32) into the warpgroup's slot."""
    w_smem = scratch["w"].at[task.wg]
    plgpu.copy_gmem_to_smem(w_gmem.at[pl.ds(task.load, w_smem.shape[0])], w_smem, scratch["loaded"].at[barrier_index])


@dataclasses.dataclass(frozen=True)
class SwigluStore:
    """The gate/up kernel's epilogue: the accumulators of gate's columns and up's (f columns further in rhs =
    [Wg | Wu]) rounded to g and u and stored side by side into gu [rows, 2f], then h = silu(g) u (fp32 of the
    rounded g and u, times the row's routing weight where `weighted`, rounded once) into h [rows, f]. Two
    [block_m, block_n] slots a warpgroup: h waits for g and u's stores to have read them. Its gmem refs: (weights
    [rows] fp32 where weighted,) h, gu."""

    f: int  # the padded expert width: up's columns start there in rhs and in gu
    weighted: bool = False

    @property
    def rhs_columns(self) -> tuple:
        return (0, self.f)

    def scratch(self, plgpu, tiles: Tiles, dtype) -> dict:
        slots = {"out": plgpu.SMEM((COMPUTE_WGS, 2, tiles.block_m, tiles.block_n), dtype)}
        if not self.weighted:
            return slots
        w = plgpu.SMEM((COMPUTE_WGS, tiles.block_m), jnp.float32)
        return {**slots, "w": w, "loaded": plgpu.Barrier(num_barriers=COMPUTE_WGS)}

    def begin(self, plgpu, task: Task, scratch: dict, refs) -> None:
        if self.weighted:
            _load_weights(plgpu, task, scratch, refs[0], task.wg)

    def end(self, plgpu, task: Task, scratch: dict, refs, accs) -> None:
        h_gmem, gu_gmem = refs[-2:]
        slots = scratch["out"].at[task.wg]
        dtype = slots.dtype
        g_acc, u_acc = accs
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous task's h store has read slot 0
        slots.at[0][...] = g_acc[...].astype(dtype)
        slots.at[1][...] = u_acc[...].astype(dtype)
        plgpu.commit_smem()
        store_rows(plgpu, task, slots.at[0], gu_gmem, task.col)
        store_rows(plgpu, task, slots.at[1], gu_gmem, self.f + task.col)
        _, silu = _silu_parts(g_acc[...].astype(dtype).astype(jnp.float32))
        h = silu * u_acc[...].astype(dtype).astype(jnp.float32)
        if self.weighted:
            plgpu.barrier_wait(scratch["loaded"].at[task.wg])
            h = h * _rows(scratch["w"].at[task.wg], h.shape)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # g's store has read slot 0
        slots.at[0][...] = h.astype(dtype)
        plgpu.commit_smem()
        store_rows(plgpu, task, slots.at[0], h_gmem, task.col)


@dataclasses.dataclass(frozen=True)
class DSwigluStore:
    """The dh kernel's epilogue (dh' = dout @ Wo^T): the task's g and u tiles (and, where `weighted`, its rows'
    routing weights w) loaded by TMA (issued before the pipeline, waited for after it) from gu [rows, 2f]; with
    h = silu(g) u in fp32 and dh = w dh' (dh' where not weighted), dg = dh u silu'(g) and du = dh silu(g) in fp32
    from the fp32 dh', rounded once and stored side by side into dgu [rows, 2f] through the same slots. Weighted,
    each row's sum of dh' h over the warpgroup's columns (its share of the routing weight's gradient, <dy, y> =
    <dh', h>) goes to partials[task, 2 tile + warpgroup, :block_m] (fp32; summed by gathered_partials). Its gmem
    refs: gu, (weights,) dgu, (partials)."""

    f: int  # the padded expert width: u's (and du's) columns start there
    weighted: bool = False

    rhs_columns: tuple = (0,)

    def scratch(self, plgpu, tiles: Tiles, dtype) -> dict:
        bm, loads = tiles.block_m, 3 if self.weighted else 2
        slots = {
            "gu": plgpu.SMEM((COMPUTE_WGS, 2, bm, tiles.block_n), dtype),
            "loaded": plgpu.Barrier(num_barriers=loads * COMPUTE_WGS),
        }
        if not self.weighted:
            return slots
        return {**slots, **{name: plgpu.SMEM((COMPUTE_WGS, bm), jnp.float32) for name in ("w", "dw")}}

    def begin(self, plgpu, task: Task, scratch: dict, refs) -> None:
        gu_gmem = refs[0]
        slots = scratch["gu"].at[task.wg]
        rows, bn, loads = pl.ds(task.load, slots.shape[1]), slots.shape[2], 3 if self.weighted else 2
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous task's stores have read the slots
        for i, col in enumerate((task.col, self.f + task.col)):
            plgpu.copy_gmem_to_smem(
                gu_gmem.at[rows, pl.ds(col, bn)], slots.at[i], scratch["loaded"].at[loads * task.wg + i]
            )
        if self.weighted:
            _load_weights(plgpu, task, scratch, refs[1], loads * task.wg + 2)

    def end(self, plgpu, task: Task, scratch: dict, refs, accs) -> None:
        slots, loads = scratch["gu"].at[task.wg], 3 if self.weighted else 2
        dtype = slots.dtype
        for i in range(loads):
            plgpu.barrier_wait(scratch["loaded"].at[loads * task.wg + i])
        g = slots.at[0][...].astype(jnp.float32)
        u = slots.at[1][...].astype(jnp.float32)
        dh = accs[0][...]
        s, silu = _silu_parts(g)
        if self.weighted:
            dgu_gmem, partials_gmem = refs[2:]
            dw_smem = scratch["dw"].at[task.wg]
            dw_smem[...] = jnp.sum(dh * (silu * u), axis=1)
            dh = dh * _rows(scratch["w"].at[task.wg], dh.shape)
        else:
            (dgu_gmem,) = refs[1:]
        slots.at[0][...] = (dh * u * (s + silu * (1.0 - s))).astype(dtype)  # silu'(g) = s + g s (1 - s)
        slots.at[1][...] = (dh * silu).astype(dtype)
        plgpu.commit_smem()
        store_rows(plgpu, task, slots.at[0], dgu_gmem, task.col)
        store_rows(plgpu, task, slots.at[1], dgu_gmem, self.f + task.col)
        if self.weighted:  # every warpgroup's share, an overlap's zeros too (its accumulator never multiplied)
            plgpu.copy_smem_to_gmem(dw_smem, partials_gmem.at[task.index, COMPUTE_WGS * task.tile + task.wg])


def tiles_for(rows: int, groups: int) -> Tiles:
    """The fused kernels' tiles: ragged_ws's row rule, BLOCK_N columns a warpgroup, 3 stages (gate/up: 3 x 48 KiB of
    x, Wg and Wu tiles and 64 KiB of slots at 128 rows; dh: 3 x 32 KiB and 64 KiB)."""
    return Tiles(block_m=ragged_ws.tiles_for(rows, groups, 2 * BLOCK_N).block_m, block_n=BLOCK_N)


def gate_up(xs_RxD, wgu_GxDx2F, sizes_G, w_R=None, *, sms: int, tiles: Tiles):
    """(h [R, F], gu [R, 2F]): g = x Wg, u = x Wu in one launch (wgu = [Wg | Wu], F a whole number of block_n and
    >= 2 block_n, D of whole block_k, R a multiple of 8 and >= block_m), h = silu(g) u, times each row's routing
    weight w_R (fp32 [R]) where given; rows past the groups are unwritten."""
    r, f = xs_RxD.shape[0], wgu_GxDx2F.shape[2] // 2
    out_type = (jax.ShapeDtypeStruct((r, f), xs_RxD.dtype), jax.ShapeDtypeStruct((r, 2 * f), xs_RxD.dtype))
    epilogue = SwigluStore(f, weighted=w_R is not None)
    call = ragged_ws.row_task_call(
        sizes_G, r, n=f, transpose_rhs=False, sms=sms, tiles=tiles, out_type=out_type, epilogue=epilogue
    )
    return call(xs_RxD, wgu_GxDx2F, *([] if w_R is None else [w_R.astype(jnp.float32)]))


def down_grad(dout_RxD, wo_GxFxD, gu_Rx2F, sizes_G, w_R=None, *, sms: int, tiles: Tiles):
    """dgu [R, 2F] = [dg | du] of h = silu(g) u from dh = dout Wo^T (Wo read transposed; times each row's routing
    weight w_R where given) and gu = [g | u]; rows past the groups are unwritten. With w_R: (dgu, dw_R), dw_R [R]
    fp32 the gradient of each row's routing weight, <dout, h Wo> (zero past the groups). Shapes as gate_up's."""
    r, f = dout_RxD.shape[0], wo_GxFxD.shape[1]
    out_type = jax.ShapeDtypeStruct((r, 2 * f), dout_RxD.dtype)
    inputs = [gu_Rx2F]
    if w_R is not None:
        tasks = ragged_ws.max_tasks(r, sizes_G.shape[0], tiles.block_m)
        shares = COMPUTE_WGS * -(-f // (COMPUTE_WGS * tiles.block_n))
        out_type = (out_type, jax.ShapeDtypeStruct((tasks, shares, tiles.block_m), jnp.float32))
        inputs.append(w_R.astype(jnp.float32))
    call = ragged_ws.row_task_call(
        sizes_G,
        r,
        n=f,
        transpose_rhs=True,
        sms=sms,
        tiles=tiles,
        out_type=out_type,
        epilogue=DSwigluStore(f, weighted=w_R is not None),
    )
    out = call(dout_RxD, wo_GxFxD, *inputs)
    if w_R is None:
        return out
    dgu_Rx2F, partials_TxSxM = out
    return dgu_Rx2F, gathered_partials(partials_TxSxM, ragged_ws.row_tasks(sizes_G, r, tiles.block_m), r)


def gathered_partials(partials_TxSxM, tasks_Tx4, rows: int) -> jax.Array:
    """[rows] fp32: each row's partials summed in share order (fixed), read from its row task (the one of its group
    holding it: tasks_Tx4 from ragged_ws.row_tasks, [task, 4] of (group, load, offset, count)); 0 for a row in no
    group's task."""
    load_T, first_T, count_T = tasks_Tx4[:, 1], tasks_Tx4[:, 1] + tasks_Tx4[:, 2], tasks_Tx4[:, 3]
    r_R = jnp.arange(rows, dtype=jnp.int32)
    starts_T = jnp.where(count_T > 0, first_T, jnp.iinfo(jnp.int32).max)  # the tasks with rows come first, in order
    t_R = jnp.maximum(jnp.searchsorted(starts_T, r_R, side="right") - 1, 0)
    inside_R = (r_R >= first_T[t_R]) & (r_R < first_T[t_R] + count_T[t_R])
    shares_RxS = partials_TxSxM[t_R, :, jnp.clip(r_R - load_T[t_R], 0, partials_TxSxM.shape[2] - 1)]
    total_R = shares_RxS[:, 0]
    for i in range(1, shares_RxS.shape[1]):
        total_R = total_R + shares_RxS[:, i]
    return jnp.where(inside_R, total_R, 0.0)


def padded_width(f: int) -> int:
    """An expert width f in whole BLOCK_N and at least one pair of them (both warpgroups' columns): swiglu's F."""
    return max(round_up(f, BLOCK_N), COMPUTE_WGS * BLOCK_N)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def swiglu(xs_RxD, wg_GxDxF, wu_GxDxF, wo_GxFxD, sizes_G, w_R, interpret: bool, sms: int, full_groups: bool):
    """SwiGLU experts silu(x Wg) (x Wu) Wo on rows sorted by group, each row's output times its routing weight w_R
    ([R]; None: unweighted), in four launches forward (gate and up with the SwiGLU and the weight in one, down) and
    backward (dh with the dSwiGLU and the weights' gradient, dx of gate and up in one of K = 2F, dW of gate and up
    in one, dWo). x and the weights of one 16-bit float dtype, rows a multiple of 8, D a whole number of 64 and F
    padded_width's (mgpu_swiglu pads them); sum(sizes) <= rows. Output rows past the groups come out unwritten, and
    so do dx's (w_R's gradient is 0 there); h's rows past the groups are zeroed unless full_groups (every row in a
    group), so that none reaches dWo. interpret: Mosaic GPU's interpreter; sms: the persistent grids' CTAs (the
    GPU's SM count)."""
    return _swiglu_fwd(xs_RxD, wg_GxDxF, wu_GxDxF, wo_GxFxD, sizes_G, w_R, interpret, sms, full_groups)[0]


def _swiglu_fwd(xs_RxD, wg_GxDxF, wu_GxDxF, wo_GxFxD, sizes_G, w_R, interpret, sms, full_groups):
    (r, d), f = xs_RxD.shape, wg_GxDxF.shape[2]
    if r % ROW_ALIGN or d % 64 or f != padded_width(f):
        raise ValueError(f"rows ({r}), D ({d}) and F ({f}) must be whole {ROW_ALIGN}, 64 and {padded_width(f)}")
    if w_R is not None and w_R.shape != (r,):
        raise ValueError(f"routing weights {w_R.shape} for {r} rows")
    # one [G, D, 2F] copy of the weights (fused with their cast where the parameters are float32)
    wgu_GxDx2F = jnp.concatenate([wg_GxDxF, wu_GxDxF], axis=2)
    tiles = tiles_for(r, sizes_G.shape[0])
    with ragged_ws.interpreted(interpret):
        h_RxF, gu_Rx2F = gate_up(xs_RxD, wgu_GxDx2F, sizes_G, w_R, sms=sms, tiles=tiles)
        # both are a layer scan's residuals and read in the body: without the barrier jax 0.11.2's XLA moves the
        # kernel into the residual's dynamic-update-slice fusion and launches it twice (moe_hopper.gmm's output too)
        h_RxF, gu_Rx2F = jax.lax.optimization_barrier((h_RxF, gu_Rx2F))
        if not full_groups:
            h_RxF = jnp.where((jnp.arange(r) < jnp.sum(sizes_G))[:, None], h_RxF, 0)
        out_RxD = ragged_ws.ragged_dot(
            h_RxF, wo_GxFxD, sizes_G, transpose_rhs=False, sms=sms, tiles=ragged_ws.tiles_for(r, sizes_G.shape[0], d)
        )
    out_RxD = jax.lax.optimization_barrier(out_RxD)  # the same for the output
    # wg and wu, not their [Wg | Wu] copy: a layer scan without remat keeps its residuals per layer, and wg and wu
    # are the parameters themselves where they are in the compute dtype (the backward makes the copy again)
    return out_RxD, (xs_RxD, wg_GxDxF, wu_GxDxF, wo_GxFxD, sizes_G, w_R, h_RxF, gu_Rx2F)


def _swiglu_bwd(interpret, sms, full_groups, res, dout_RxD):
    del full_groups
    xs_RxD, wg_GxDxF, wu_GxDxF, wo_GxFxD, sizes_G, w_R, h_RxF, gu_Rx2F = res
    wgu_GxDx2F = jnp.concatenate([wg_GxDxF, wu_GxDxF], axis=2)
    (r, d), f = xs_RxD.shape, wo_GxFxD.shape[1]
    dout_RxD = dout_RxD.astype(xs_RxD.dtype)
    groups = sizes_G.shape[0]
    with ragged_ws.interpreted(interpret):
        dgu_Rx2F = down_grad(dout_RxD, wo_GxFxD, gu_Rx2F, sizes_G, w_R, sms=sms, tiles=tiles_for(r, groups))
        dw_R = None
        if w_R is not None:
            dgu_Rx2F, dw_R = dgu_Rx2F
            dw_R = dw_R.astype(w_R.dtype)
        dx_RxD = ragged_ws.ragged_dot(
            dgu_Rx2F, wgu_GxDx2F, sizes_G, transpose_rhs=True, sms=sms, tiles=ragged_ws.tiles_for(r, groups, d)
        )
        dwgu = ragged_ws.transposed_ragged_dot(
            xs_RxD, dgu_Rx2F, sizes_G, sms=sms, tiles=ragged_ws.wgrad_tiles(d, 2 * f)
        )
        dwo = ragged_ws.transposed_ragged_dot(h_RxF, dout_RxD, sizes_G, sms=sms, tiles=ragged_ws.wgrad_tiles(f, d))
    return dx_RxD, dwgu[:, :, :f], dwgu[:, :, f:], dwo, None, dw_R


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def kernel_flops(assignments: int, groups: int, d: int, f: int, *, backward: bool) -> float:
    """An upper bound of the FLOPs swiglu computes over `assignments` sorted rows in `groups` groups, hidden d,
    expert width f (cisjax plan: a Mosaic GPU kernel carries no cost estimate), with its tiles. A row-task call of
    K = k, N = n: max_tasks tasks of block_m rows over n in whole block_n (a last pair's overlap is not computed
    again); a weight gradient of [k, n]: each group's rows from a multiple of block_k to one (at most one step more
    per group) over k and n in whole tiles."""
    fp, rows = padded_width(f), max(round_up(assignments, ROW_ALIGN), 128)

    def cols(n: int, t: Tiles) -> int:
        return max(round_up(n, t.block_n), COMPUTE_WGS * t.block_n)

    def row_tasks(k: int, n: int, t: Tiles) -> float:
        return 2.0 * ragged_ws.max_tasks(rows, groups, t.block_m) * t.block_m * k * cols(n, t)

    def wgrad(k: int, n: int) -> float:
        t = ragged_ws.wgrad_tiles(k, n)
        return 2.0 * (assignments + groups * t.block_k) * round_up(k, t.block_m) * cols(n, t)

    fused, plain = tiles_for(assignments, groups), ragged_ws.tiles_for(assignments, groups, d)
    forward = row_tasks(d, 2 * fp, fused) + row_tasks(fp, d, plain)  # gate and up, down
    if not backward:
        return forward
    dh, dx = row_tasks(d, fp, fused), row_tasks(2 * fp, d, plain)  # dh of down with dSwiGLU; dx of gate and up
    return forward + dh + dx + wgrad(d, 2 * fp) + wgrad(fp, d)
