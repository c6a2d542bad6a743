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


@dataclasses.dataclass(frozen=True)
class SwigluStore:
    """The gate/up kernel's epilogue: the accumulators of gate's columns and up's (f columns further in rhs =
    [Wg | Wu]) rounded to g and u and stored side by side into gu [rows, 2f], then h = silu(g) * u (fp32 of the
    rounded g and u, rounded once) into h [rows, f]. Two [block_m, block_n] slots a warpgroup: h waits for g and
    u's stores to have read them."""

    f: int  # the padded expert width: up's columns start there in rhs and in gu

    @property
    def rhs_columns(self) -> tuple:
        return (0, self.f)

    def scratch(self, plgpu, tiles: Tiles, dtype) -> dict:
        return {"out": plgpu.SMEM((COMPUTE_WGS, 2, tiles.block_m, tiles.block_n), dtype)}

    def begin(self, plgpu, task: Task, scratch: dict, refs) -> None:
        del plgpu, task, scratch, refs

    def end(self, plgpu, task: Task, scratch: dict, refs, accs) -> None:
        h_gmem, gu_gmem = refs
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
        h = (silu * u_acc[...].astype(dtype).astype(jnp.float32)).astype(dtype)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # g's store has read slot 0
        slots.at[0][...] = h
        plgpu.commit_smem()
        store_rows(plgpu, task, slots.at[0], h_gmem, task.col)


@dataclasses.dataclass(frozen=True)
class DSwigluStore:
    """The dh kernel's epilogue (dh = dout @ Wo^T): the task's g and u tiles loaded (TMA, issued before the
    pipeline, waited for after it) from gu [rows, 2f], and dg = dh u silu'(g), du = dh silu(g) in fp32 from the
    fp32 dh, rounded once and stored side by side into dgu [rows, 2f] through the same slots."""

    f: int  # the padded expert width: u's (and du's) columns start there

    rhs_columns: tuple = (0,)

    def scratch(self, plgpu, tiles: Tiles, dtype) -> dict:
        return {
            "gu": plgpu.SMEM((COMPUTE_WGS, 2, tiles.block_m, tiles.block_n), dtype),
            "loaded": plgpu.Barrier(num_barriers=2 * COMPUTE_WGS),
        }

    def begin(self, plgpu, task: Task, scratch: dict, refs) -> None:
        gu_gmem, _ = refs
        slots = scratch["gu"].at[task.wg]
        rows, bn = pl.ds(task.load, slots.shape[1]), slots.shape[2]
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous task's dg and du stores have read the slots
        for i, col in enumerate((task.col, self.f + task.col)):
            plgpu.copy_gmem_to_smem(
                gu_gmem.at[rows, pl.ds(col, bn)], slots.at[i], scratch["loaded"].at[COMPUTE_WGS * task.wg + i]
            )

    def end(self, plgpu, task: Task, scratch: dict, refs, accs) -> None:
        _, dgu_gmem = refs
        slots = scratch["gu"].at[task.wg]
        dtype = slots.dtype
        for i in range(2):
            plgpu.barrier_wait(scratch["loaded"].at[COMPUTE_WGS * task.wg + i])
        g = slots.at[0][...].astype(jnp.float32)
        u = slots.at[1][...].astype(jnp.float32)
        dh = accs[0][...]
        s, silu = _silu_parts(g)
        slots.at[0][...] = (dh * u * (s + silu * (1.0 - s))).astype(dtype)  # silu'(g) = s + g s (1 - s)
        slots.at[1][...] = (dh * silu).astype(dtype)
        plgpu.commit_smem()
        store_rows(plgpu, task, slots.at[0], dgu_gmem, task.col)
        store_rows(plgpu, task, slots.at[1], dgu_gmem, self.f + task.col)


def tiles_for(rows: int, groups: int) -> Tiles:
    """The fused kernels' tiles: ragged_ws's row rule, BLOCK_N columns a warpgroup, 3 stages (gate/up: 3 x 48 KiB of
    x, Wg and Wu tiles and 64 KiB of slots at 128 rows; dh: 3 x 32 KiB and 64 KiB)."""
    return Tiles(block_m=ragged_ws.tiles_for(rows, groups, 2 * BLOCK_N).block_m, block_n=BLOCK_N)


def gate_up(xs_RxD, wgu_GxDx2F, sizes_G, *, sms: int, tiles: Tiles):
    """(h [R, F], gu [R, 2F]): g = x Wg, u = x Wu in one launch (wgu = [Wg | Wu], F a whole number of block_n and
    >= 2 block_n, D of whole block_k, R a multiple of 8 and >= block_m), h = silu(g) u; rows past the groups are
    unwritten."""
    r, f = xs_RxD.shape[0], wgu_GxDx2F.shape[2] // 2
    out_type = (jax.ShapeDtypeStruct((r, f), xs_RxD.dtype), jax.ShapeDtypeStruct((r, 2 * f), xs_RxD.dtype))
    call = ragged_ws.row_task_call(
        sizes_G, r, n=f, transpose_rhs=False, sms=sms, tiles=tiles, out_type=out_type, epilogue=SwigluStore(f)
    )
    return call(xs_RxD, wgu_GxDx2F)


def down_grad(dout_RxD, wo_GxFxD, gu_Rx2F, sizes_G, *, sms: int, tiles: Tiles):
    """dgu [R, 2F] = [dg | du] of h = silu(g) u from dh = dout Wo^T (Wo read transposed) and gu = [g | u]; rows past
    the groups are unwritten. Shapes as gate_up's (D of whole block_k)."""
    r, f = dout_RxD.shape[0], wo_GxFxD.shape[1]
    call = ragged_ws.row_task_call(
        sizes_G,
        r,
        n=f,
        transpose_rhs=True,
        sms=sms,
        tiles=tiles,
        out_type=jax.ShapeDtypeStruct((r, 2 * f), dout_RxD.dtype),
        epilogue=DSwigluStore(f),
    )
    return call(dout_RxD, wo_GxFxD, gu_Rx2F)


def padded_width(f: int) -> int:
    """An expert width f in whole BLOCK_N and at least one pair of them (both warpgroups' columns): swiglu's F."""
    return max(round_up(f, BLOCK_N), COMPUTE_WGS * BLOCK_N)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def swiglu(xs_RxD, wg_GxDxF, wu_GxDxF, wo_GxFxD, sizes_G, interpret: bool, sms: int, full_groups: bool):
    """SwiGLU experts silu(x Wg) (x Wu) Wo on rows sorted by group in four launches forward (gate and up with the
    SwiGLU in one, down) and backward (dh with the dSwiGLU, dx of gate and up in one of K = 2F, dW of gate and up in
    one, dWo). x and the weights of one 16-bit float dtype, rows a multiple of 8, D a whole number of 64 and F
    padded_width's (mgpu_swiglu pads them); sum(sizes) <= rows. Output rows past the groups come out unwritten, and so do dx's; h's rows past
    the groups are zeroed unless full_groups (every row in a group), so that none reaches dWo. interpret: Mosaic
    GPU's interpreter; sms: the persistent grids' CTAs (the GPU's SM count)."""
    return _swiglu_fwd(xs_RxD, wg_GxDxF, wu_GxDxF, wo_GxFxD, sizes_G, interpret, sms, full_groups)[0]


def _swiglu_fwd(xs_RxD, wg_GxDxF, wu_GxDxF, wo_GxFxD, sizes_G, interpret, sms, full_groups):
    (r, d), f = xs_RxD.shape, wg_GxDxF.shape[2]
    if r % ROW_ALIGN or d % 64 or f != padded_width(f):
        raise ValueError(f"rows ({r}), D ({d}) and F ({f}) must be whole {ROW_ALIGN}, 64 and {padded_width(f)}")
    # one [G, D, 2F] copy of the weights (fused with their cast where the parameters are float32)
    wgu_GxDx2F = jnp.concatenate([wg_GxDxF, wu_GxDxF], axis=2)
    tiles = tiles_for(r, sizes_G.shape[0])
    with ragged_ws.interpreted(interpret):
        h_RxF, gu_Rx2F = gate_up(xs_RxD, wgu_GxDx2F, sizes_G, sms=sms, tiles=tiles)
        # both are a layer scan's residuals and read in the body: without the barrier jax 0.11.2's XLA moves the
        # kernel into the residual's dynamic-update-slice fusion and launches it twice (moe_hopper.gmm's output too)
        h_RxF, gu_Rx2F = jax.lax.optimization_barrier((h_RxF, gu_Rx2F))
        if not full_groups:
            h_RxF = jnp.where((jnp.arange(r) < jnp.sum(sizes_G))[:, None], h_RxF, 0)
        out_RxD = ragged_ws.ragged_dot(
            h_RxF, wo_GxFxD, sizes_G, transpose_rhs=False, sms=sms, tiles=ragged_ws.tiles_for(r, sizes_G.shape[0], d)
        )
    out_RxD = jax.lax.optimization_barrier(out_RxD)  # the same for the output
    return out_RxD, (xs_RxD, wgu_GxDx2F, wo_GxFxD, sizes_G, h_RxF, gu_Rx2F)


def _swiglu_bwd(interpret, sms, full_groups, res, dout_RxD):
    del full_groups
    xs_RxD, wgu_GxDx2F, wo_GxFxD, sizes_G, h_RxF, gu_Rx2F = res
    (r, d), f = xs_RxD.shape, wo_GxFxD.shape[1]
    dout_RxD = dout_RxD.astype(xs_RxD.dtype)
    groups = sizes_G.shape[0]
    with ragged_ws.interpreted(interpret):
        dgu_Rx2F = down_grad(dout_RxD, wo_GxFxD, gu_Rx2F, sizes_G, sms=sms, tiles=tiles_for(r, groups))
        dx_RxD = ragged_ws.ragged_dot(
            dgu_Rx2F, wgu_GxDx2F, sizes_G, transpose_rhs=True, sms=sms, tiles=ragged_ws.tiles_for(r, groups, d)
        )
        dwgu = ragged_ws.transposed_ragged_dot(
            xs_RxD, dgu_Rx2F, sizes_G, sms=sms, tiles=ragged_ws.wgrad_tiles(d, 2 * f)
        )
        dwo = ragged_ws.transposed_ragged_dot(h_RxF, dout_RxD, sizes_G, sms=sms, tiles=ragged_ws.wgrad_tiles(f, d))
    return dx_RxD, dwgu[:, :, :f], dwgu[:, :, f:], dwo, None


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
