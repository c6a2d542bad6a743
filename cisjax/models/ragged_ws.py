"""A warp-specialized, persistent Hopper grouped matmul ("mgpu_ws"): tasks that never straddle a group, from XLA."""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from cisjax.models.padding import pad_axes, round_up

ROW_ALIGN = 8  # a task's rows are loaded from a multiple of 8 (the shared-memory tiling of the row dimension)
COMPUTE_WGS = 2  # compute warpgroups per CTA, each a block_m x block_n tile of the CTA's block_m x 2 block_n
MEMORY_REGISTERS = 40  # registers per thread left to the memory warpgroup (JAX's Hopper matmul's choice)


@dataclasses.dataclass(frozen=True)
class Tiles:
    """One configuration of the kernel: each of the two compute warpgroups computes block_m x block_n of a task's
    block_m x (2 block_n) tile, over K in steps of block_k with `stages` of them in shared memory at once."""

    block_m: int = 128  # a task's rows (a power of two: the stores' ladder)
    block_n: int = 128  # columns per compute warpgroup
    block_k: int = 64  # the contraction step (128 bytes of bf16: the swizzle)
    stages: int = 3  # pipeline stages in shared memory (4 with 128 x 128 tiles: 256 KiB, over the H100's 227)
    # the forward's and input gradient's pipelines chained across a CTA's tasks (the memory warpgroup loads the next
    # task's first steps during this one's epilogue), where the K steps are a multiple of `stages` (JAX's condition)
    chain: bool = True

    def __post_init__(self):
        if self.block_m & (self.block_m - 1) or self.block_m < 64:
            raise ValueError(f"block_m must be a power of two >= 64 (a wgmma's rows), not {self.block_m}")
        if self.block_n % 8 or self.block_k % 8 or self.stages < 1:
            raise ValueError(f"block_n and block_k must be multiples of 8 and stages >= 1: {self}")


def max_tasks(rows: int, groups: int, block_m: int) -> int:
    """A bound of the row tasks of `rows` sorted rows in `groups` groups: a group of n rows starting o (< 8) rows
    past a multiple of 8 takes floor((n + o - 1) / block_m) + 1 tasks, so all together at most
    (rows + 7 groups) / block_m + groups."""
    return (rows + (ROW_ALIGN - 1) * groups) // block_m + groups


def row_tasks(sizes_G: jax.Array, rows: int, block_m: int) -> jax.Array:
    """The row tasks of groups of sizes_G over sorted rows, [max_tasks, 4] int32 (group, load, offset, count): a task
    loads block_m rows from `load` (a multiple of 8, load + block_m <= rows) and computes them with its group's
    matrix; its group's rows in it are the `count` from load + offset. A group's tasks start at its first row
    rounded down to 8 and step by block_m, so no task holds rows of two groups and an empty group has none; the
    tasks with rows come first, the rest are zeros. rows: the rows of the (padded) buffer, a multiple of 8 and
    >= block_m."""
    if rows % ROW_ALIGN or rows < block_m:
        raise ValueError(f"rows ({rows}) must be a multiple of {ROW_ALIGN} and >= block_m ({block_m})")
    sizes_G = sizes_G.astype(jnp.int32)
    ends_G = jnp.cumsum(sizes_G)
    starts_G = ends_G - sizes_G
    first_G = starts_G // ROW_ALIGN * ROW_ALIGN
    tiles_G = jnp.where(sizes_G > 0, (ends_G - first_G + block_m - 1) // block_m, 0)
    cum_G = jnp.cumsum(tiles_G)
    t_T = jnp.arange(max_tasks(rows, sizes_G.shape[0], block_m), dtype=jnp.int32)
    g_T = jnp.minimum(jnp.searchsorted(cum_G, t_T, side="right"), sizes_G.shape[0] - 1).astype(jnp.int32)
    begin_T = first_G[g_T] + (t_T - (cum_G - tiles_G)[g_T]) * block_m
    lo_T = jnp.maximum(starts_G[g_T], begin_T)
    hi_T = jnp.minimum(ends_G[g_T], begin_T + block_m)
    load_T = jnp.minimum(begin_T, rows - block_m)
    real_T = t_T < cum_G[-1]
    return jnp.where(real_T[:, None], jnp.stack([g_T, load_T, lo_T - load_T, hi_T - lo_T], axis=1), 0)


def _kernel(num_gmem, tasks_gmem, lhs_gmem, rhs_gmem, out_gmem, *, tiles: Tiles, transpose_rhs: bool, n: int):
    """The kernel body: each CTA (one memory and two compute warpgroups) walks its share of the (row task, N tile)
    pairs of the num_gmem[0] row tasks with rows; per pair, one warp-specialized pipeline over K and an epilogue that
    stores the task's rows. Chained (tiles.chain): a CTA's first pipeline starts its stages, its last drains them."""
    # Mosaic GPU locates its runtime library (the CUDA plugin's) when first imported: after cisjax plan adds the plugin
    from jax.experimental.pallas import mosaic_gpu as plgpu  # lazy: mosaic_gpu

    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    cta_n = COMPUTE_WGS * bn
    k = lhs_gmem.shape[1]
    n_tiles = -(-n // cta_n)
    transforms = _transforms(plgpu, lhs_gmem.dtype, bk)
    chain = tiles.chain and (k // bk) % tiles.stages == 0
    rhs_block, rhs_index = ((cta_n, bk), lambda kk: (0, kk)) if transpose_rhs else ((bk, cta_n), lambda kk: (kk, 0))

    def pipeline(body, compute_context, state=None):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k // bk,),
            pipeline_state=state,
            memory_registers=MEMORY_REGISTERS,
            in_specs=[
                plgpu.BlockSpec((bm, bk), lambda kk: (0, kk), transforms=transforms, memory_space=plgpu.SMEM),
                plgpu.BlockSpec(rhs_block, rhs_index, transforms=transforms, memory_space=plgpu.SMEM),
            ],
            wg_axis="wg",
            num_compute_wgs=COMPUTE_WGS,
            max_concurrent_steps=tiles.stages,
            compute_context=compute_context,
        )

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(_ignore, _ignore).get_allocations(lhs_gmem, rhs_gmem.at[0]),
        out_smem=plgpu.SMEM((COMPUTE_WGS, bm, bn), out_gmem.dtype),
        collective_axes="wg",
    )
    def _scope(allocations, out_smem):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((num_gmem[0] * n_tiles,), collective_axes="cluster_grid")
        def _tasks(info: plgpu.NDLoopInfo):
            (lin,) = info.index
            task, j = lin // n_tiles, lin % n_tiles
            group, load, offset, count = (tasks_gmem[task, c] for c in range(4))
            load = pl.multiple_of(load, ROW_ALIGN)
            n0, wg_n0, stores = _n_tile(j, wg, bn, n)

            def store(smem_ref):
                pl.when(stores)(
                    lambda: _store_rows(plgpu, smem_ref, out_gmem.at[:, pl.ds(wg_n0, bn)], load, offset, count)
                )

            def mma(_, lhs_smem, rhs_smem, acc_ref):
                if transpose_rhs:
                    rhs = rhs_smem.at[pl.ds(wg * bn, bn), :].transpose((1, 0))
                else:
                    rhs = rhs_smem.at[:, pl.ds(wg * bn, bn)]
                pl.when(stores)(lambda: _mma(plgpu, acc_ref, lhs_smem, rhs))  # an overlap's columns: not again
                return acc_ref

            rhs_g = (
                rhs_gmem.at[group, pl.ds(n0, cta_n), :] if transpose_rhs else rhs_gmem.at[group, :, pl.ds(n0, cta_n)]
            )

            refs = (lhs_gmem.at[pl.ds(load, bm), :], rhs_g)
            context = _epilogue(plgpu, out_smem, wg, store)
            if not chain:
                pipeline(mma, context)(*refs, allocations=allocations)
                return
            first, last = info.local_index == 0, info.local_index == info.num_local_steps - 1
            chained = plgpu.PipelinePipeline  # START fills the stages, STEADY goes on, STOP drains them
            state = jnp.where(first, chained.START, jnp.where(last, chained.STOP, chained.STEADY))
            pl.when(first & last)(lambda: pipeline(mma, context)(*refs, allocations=allocations))  # one task: alone
            pl.when(~(first & last))(lambda: pipeline(mma, context, state)(*refs, allocations=allocations))

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _ignore(*_, **__) -> None:
    """A pipeline body or compute context that does nothing: a pipeline's allocations do not depend on them."""


def _transforms(plgpu, dtype, minor: int) -> tuple:
    """Shared-memory tiling and swizzle of a block whose minor dimension holds `minor` elements of dtype."""
    swizzle = plgpu.find_swizzle(minor * jnp.dtype(dtype).itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle)


def _n_tile(j, wg, bn: int, n: int):
    """(the CTA's first column, this warpgroup's, whether it computes and stores) of N tile j of 2 bn columns: the
    last tile ends at N and overlaps the one before by bn columns when N is an odd number of bn; its first
    warpgroup then multiplies nothing (its accumulator stays 0) and stores nothing."""
    n0 = jnp.minimum(j * COMPUTE_WGS * bn, n - COMPUTE_WGS * bn)
    wg_n0 = n0 + wg * bn
    return n0, wg_n0, wg_n0 >= j * COMPUTE_WGS * bn


def _launch(plgpu, body, out_shape, dtype, sms: int):
    """plgpu.kernel of body on a persistent grid of `sms` CTAs, each one memory and two compute warpgroups."""
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(out_shape, dtype),
        grid=(sms,),
        grid_names=("cluster_grid",),
        cluster=(1,),
        cluster_names=("cluster",),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )


def _epilogue(plgpu, out_smem, wg, store):
    """A pipeline's compute context: the warpgroup's fp32 accumulator, run through the pipeline, rounded into its
    slot of out_smem once the previous task's stores have read it, then store(that slot) (TMA copies to GMEM)."""
    bm, bn = out_smem.shape[1:]

    def context(run_pipeline):
        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, bn), jnp.float32))
        def _acc(acc_ref):
            run_pipeline(acc_ref)
            acc = acc_ref[...].astype(out_smem.dtype)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            out_smem[wg] = acc
            plgpu.commit_smem()
            store(out_smem.at[wg])

    return context


def _mma(plgpu, acc_ref, a_smem, b_smem) -> None:
    """acc += a @ b on the tensor cores, waited for (the pipeline may refill a and b's slot once the body returns)."""
    plgpu.wgmma(acc_ref, a_smem, b_smem)
    plgpu.wgmma_wait(0)


def _store_rows(plgpu, smem_ref, gmem_ref, load, offset, count) -> None:
    """Store smem_ref's rows offset to offset + count into gmem_ref's rows load + offset on: a TMA copy of 2^i rows
    per set bit i of count (a copy's shape is static, the count is not), largest first."""
    start = offset
    for bit in reversed(range(smem_ref.shape[0].bit_length())):
        rows = 1 << bit

        def copy(start=start, rows=rows):
            plgpu.copy_smem_to_gmem(smem_ref.at[pl.ds(start, rows)], gmem_ref.at[pl.ds(load + start, rows)])

        pl.when(count & rows != 0)(copy)
        start = start + (count & rows)


def ragged_dot(lhs_RxK, rhs, sizes_G, *, transpose_rhs: bool, sms: int, tiles: Tiles = Tiles()) -> jax.Array:
    """out[r] = lhs[r] @ rhs[group(r)] for the rows of the groups (sorted by group, sum(sizes) <= rows), rhs [G, K, N]
    (transpose_rhs: given [G, N, K] and multiplied transposed), in lhs's dtype with fp32 accumulation. Rows past the
    groups come out unwritten. K is padded to whole block_k, N to whole block_n and at least 2 block_n, rows to a
    multiple of 8 and at least block_m (each a copy; none at the paper shapes' rows, K and N), and sliced back.
    sms: the CTAs of the persistent grid (the GPU's SM count)."""
    r, k = lhs_RxK.shape
    g = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    if rhs.dtype != lhs_RxK.dtype:
        raise ValueError(f"lhs and rhs must have one dtype, not {lhs_RxK.dtype} and {rhs.dtype}")
    if sizes_G.shape != (g,):
        raise ValueError(f"sizes {sizes_G.shape} must have one entry per group ({g})")
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    rp = max(round_up(r, ROW_ALIGN), bm)
    kp, np_ = round_up(k, bk), max(round_up(n, bn), COMPUTE_WGS * bn)
    lhs_PxK = pad_axes(lhs_RxK, {0: rp, 1: kp})
    rhs = pad_axes(rhs, {1: np_, 2: kp} if transpose_rhs else {1: kp, 2: np_})
    tasks_Tx4 = row_tasks(sizes_G, rp, bm)
    num_1 = jnp.sum(tasks_Tx4[:, 3] > 0, keepdims=True, dtype=jnp.int32)  # the row tasks with rows: the first ones
    from jax.experimental.pallas import mosaic_gpu as plgpu  # lazy: mosaic_gpu (see _kernel)

    body = functools.partial(_kernel, tiles=tiles, transpose_rhs=transpose_rhs, n=np_)
    return _launch(plgpu, body, (rp, np_), lhs_RxK.dtype, sms)(num_1, tasks_Tx4, lhs_PxK, rhs)[:r, :n]


def group_blocks(sizes_G: jax.Array, block_k: int) -> jax.Array:
    """[G, 4] int32 (start, end, first block, blocks) of each group's rows in steps of block_k: the steps run from the
    group's first row rounded down to block_k to its last rounded up; an empty group has none."""
    sizes_G = sizes_G.astype(jnp.int32)
    ends_G = jnp.cumsum(sizes_G)
    starts_G = ends_G - sizes_G
    first_G = starts_G // block_k
    blocks_G = jnp.where(sizes_G > 0, (ends_G + block_k - 1) // block_k - first_G, 0)
    return jnp.stack([starts_G, ends_G, first_G, blocks_G], axis=1)


def _wgrad_kernel(groups_gmem, x_gmem, dy_gmem, out_gmem, *, tiles: Tiles):
    """The weight gradient's body: each CTA walks its share of the (group, K tile, N tile) tasks; per task, one
    warp-specialized pipeline over the group's row steps (a grid as long as the group) and a whole-tile store. The
    rows of other groups in a group's first and last step are zeroed in dy, each warpgroup in its own columns."""
    from jax.experimental.pallas import mosaic_gpu as plgpu  # lazy: mosaic_gpu (see _kernel)

    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    g, k, n = out_gmem.shape
    m_tiles, n_tiles = k // bm, -(-n // (COMPUTE_WGS * bn))

    def pipeline(body, compute_context, steps):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(steps,),
            memory_registers=MEMORY_REGISTERS,
            in_specs=[
                plgpu.BlockSpec((bk, bm), lambda s: (s, 0), transforms=_transforms(plgpu, x_gmem.dtype, bm)),
                plgpu.BlockSpec(
                    (bk, COMPUTE_WGS * bn), lambda s: (s, 0), transforms=_transforms(plgpu, dy_gmem.dtype, bn)
                ),
            ],
            wg_axis="wg",
            num_compute_wgs=COMPUTE_WGS,
            max_concurrent_steps=tiles.stages,
            compute_context=compute_context,
        )

    steps0 = groups_gmem[0, 3]  # any traced length: the allocations do not depend on it

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(_ignore, _ignore, steps0).get_allocations(x_gmem, dy_gmem),
        out_smem=plgpu.SMEM((COMPUTE_WGS, bm, bn), out_gmem.dtype),
        collective_axes="wg",
    )
    def _scope(allocations, out_smem):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((g * m_tiles * n_tiles,), collective_axes="cluster_grid")
        def _tasks(info: plgpu.NDLoopInfo):
            (lin,) = info.index
            group, rest = lin // (m_tiles * n_tiles), lin % (m_tiles * n_tiles)
            mi, j = rest // n_tiles, rest % n_tiles
            start, end, first, steps = (groups_gmem[group, c] for c in range(4))
            n0, wg_n0, stores = _n_tile(j, wg, bn, n)

            def store(smem_ref):
                @pl.when(stores)
                def _store():
                    plgpu.copy_smem_to_gmem(smem_ref, out_gmem.at[group, pl.ds(mi * bm, bm), pl.ds(wg_n0, bn)])

            def mma(idx, x_smem, dy_smem, acc_ref):
                (s,) = idx
                dy_half = dy_smem.at[:, pl.ds(wg * bn, bn)]

                @pl.when(((s == 0) | (s == steps - 1)) & stores)
                def _mask():
                    rows = (first + s) * bk + plgpu.layout_cast(
                        lax.broadcasted_iota(jnp.int32, (bk, bn), 0), plgpu.Layout.WGMMA
                    )
                    dy_half[...] = jnp.where((rows >= start) & (rows < end), dy_half[...], 0)
                    plgpu.commit_smem()

                pl.when(stores)(lambda: _mma(plgpu, acc_ref, x_smem.transpose((1, 0)), dy_half))
                return acc_ref

            rows = pl.ds(pl.multiple_of(first * bk, bk), x_gmem.shape[0])  # past the buffer: never read
            pipeline(mma, _epilogue(plgpu, out_smem, wg, store), steps)(  # an empty group: no step, zeros
                x_gmem.at[rows, pl.ds(mi * bm, bm)],
                dy_gmem.at[rows, pl.ds(n0, COMPUTE_WGS * bn)],
                allocations=allocations,
            )

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def transposed_ragged_dot(x_RxK, dy_RxN, sizes_G, *, sms: int, tiles: Tiles = Tiles()) -> jax.Array:
    """dW[g] = x[rows of g]^T @ dy[rows of g], [G, K, N] in x's dtype with fp32 accumulation; an empty group's is
    zeros. Rows in no group never reach dW: they are zeroed in dy (a select: any value there is fine) and must be
    finite in x. K is padded to whole block_m, N to whole block_n and at least 2 block_n, rows to whole block_k
    (a copy each; none at the paper shapes), and sliced back. sms: the CTAs of the persistent grid."""
    r, k = x_RxK.shape
    n = dy_RxN.shape[1]
    g = sizes_G.shape[0]
    if dy_RxN.dtype != x_RxK.dtype or dy_RxN.shape[0] != r:
        raise ValueError(f"x {x_RxK.shape} {x_RxK.dtype} and dy {dy_RxN.shape} {dy_RxN.dtype}: one dtype and rows")
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    rp, kp, np_ = round_up(r, bk), round_up(k, bm), max(round_up(n, bn), COMPUTE_WGS * bn)
    from jax.experimental.pallas import mosaic_gpu as plgpu  # lazy: mosaic_gpu (see _kernel)

    body = functools.partial(_wgrad_kernel, tiles=tiles)
    groups_Gx4 = group_blocks(sizes_G, bk)
    x_PxK, dy_PxN = pad_axes(x_RxK, {0: rp, 1: kp}), pad_axes(dy_RxN, {0: rp, 1: np_})
    return _launch(plgpu, body, (g, kp, np_), x_RxK.dtype, sms)(groups_Gx4, x_PxK, dy_PxN)[:, :k, :n]


def _block_n(n: int) -> int:
    """Columns per compute warpgroup for an N of n: 64 where one pair of 64 covers it (less padding), else 128."""
    return 64 if n <= COMPUTE_WGS * 64 else 128


def tiles_for(rows: int, groups: int, n: int) -> Tiles:
    """The forward's and input gradient's tiles for `rows` rows in `groups` groups and an N of n: 128 rows a task
    where the groups average 128 rows or more, else 64 (a group's last task computes block_m rows however few it
    stores); _block_n's columns."""
    return Tiles(block_m=128 if rows >= 128 * groups else 64, block_n=_block_n(n))


def wgrad_tiles(k: int, n: int) -> Tiles:
    """The weight gradient's tiles for a dW of [K, N]: K tiles of 128 where 128 divides K, else 64; _block_n's."""
    return Tiles(block_m=128 if k % 128 == 0 else 64, block_n=_block_n(n))


@contextlib.contextmanager
def interpreted(interpret: bool):
    """Trace the Mosaic GPU kernels called inside in Mosaic GPU's interpreter (CPU tests) when `interpret`."""
    if not interpret:
        yield
        return
    # jax keeps the interpreter's switch private
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams, force_gpu_interpret_mode  # lazy: tests

    with force_gpu_interpret_mode(InterpretGPUParams()):
        yield


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def gmm(x_RxK, w_GxKxN, sizes_G, interpret: bool, sms: int):
    """Grouped matmul on rows sorted by group, out[r] = x[r] @ W[group(r)], on the warp-specialized kernels: the
    forward and the input gradient (W read transposed) ragged_dot, the weight gradient transposed_ragged_dot. x and W
    of one 16-bit float dtype, sum(sizes) <= rows; rows past the groups come out unwritten (out and dx), and must be
    finite in x (see transposed_ragged_dot). interpret: Mosaic GPU's interpreter; sms: the GPU's SM count."""
    with interpreted(interpret):
        out_RxN = ragged_dot(
            x_RxK,
            w_GxKxN,
            sizes_G,
            transpose_rhs=False,
            sms=sms,
            tiles=tiles_for(x_RxK.shape[0], sizes_G.shape[0], w_GxKxN.shape[2]),
        )
    return jax.lax.optimization_barrier(out_RxN)  # as moe_hopper.gmm's: XLA would launch the kernel twice


def _gmm_fwd(x_RxK, w_GxKxN, sizes_G, interpret, sms):
    return gmm(x_RxK, w_GxKxN, sizes_G, interpret, sms), (x_RxK, w_GxKxN, sizes_G)


def _gmm_bwd(interpret, sms, res, dout_RxN):
    x_RxK, w_GxKxN, sizes_G = res
    _, k, n = w_GxKxN.shape
    dout_RxN = dout_RxN.astype(x_RxK.dtype)
    tiles = tiles_for(x_RxK.shape[0], sizes_G.shape[0], k)  # the input gradient's N is W's K
    with interpreted(interpret):
        dx_RxK = ragged_dot(dout_RxN, w_GxKxN, sizes_G, transpose_rhs=True, sms=sms, tiles=tiles)
        dw = transposed_ragged_dot(x_RxK, dout_RxN, sizes_G, sms=sms, tiles=wgrad_tiles(k, n))
    return dx_RxK, dw.astype(w_GxKxN.dtype), None


gmm.defvjp(_gmm_fwd, _gmm_bwd)


def kernel_flops(assignments: int, groups: int, d: int, f: int, *, backward: bool) -> float:
    """An upper bound of the FLOPs the warp-specialized kernels compute for one SwiGLU over `assignments` sorted
    rows in `groups` groups, hidden d, expert width f (cisjax plan: a Mosaic GPU kernel carries no cost estimate),
    with gmm's tiles. Forward and input gradient: max_tasks tasks of block_m rows over N rounded up to whole
    block_n (a last pair's overlap is not computed again); the weight gradient: each group's rows from a multiple of
    block_k to one (at most one step more per group) over K and N in whole tiles."""

    def cols(n: int, t: Tiles) -> int:
        return max(round_up(n, t.block_n), COMPUTE_WGS * t.block_n)

    def rows_x_k(k: int, n: int) -> float:  # a ragged_dot of K = k, N = n
        t = tiles_for(assignments, groups, n)
        rows = max_tasks(max(round_up(assignments, ROW_ALIGN), t.block_m), groups, t.block_m) * t.block_m
        return 2.0 * rows * k * cols(n, t)

    def wgrad(k: int, n: int) -> float:  # a transposed_ragged_dot of dW [K = k, N = n]
        t = wgrad_tiles(k, n)
        return 2.0 * (assignments + groups * t.block_k) * round_up(k, t.block_m) * cols(n, t)

    forward = 2 * rows_x_k(d, f) + rows_x_k(f, d)  # gate and up, down
    if not backward:
        return forward
    dx = 2 * rows_x_k(f, d) + rows_x_k(d, f)  # dx of gate and up (N = D), dh of down (N = F)
    return forward + dx + 2 * wgrad(d, f) + wgrad(f, d)
