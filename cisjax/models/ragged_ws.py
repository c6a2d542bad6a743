"""A warp-specialized, persistent Hopper grouped matmul ("mgpu_ws"): tasks that never straddle a group, from XLA."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import NamedTuple

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


class Task(NamedTuple):
    """What an epilogue knows of its (row task, N tile) in one compute warpgroup."""

    wg: jax.Array  # the compute warpgroup
    load: jax.Array  # the task's first row, a multiple of 8: it computes block_m rows from there
    offset: jax.Array  # its group's rows among them: `count` from load + offset
    count: jax.Array
    col: jax.Array  # the warpgroup's first column (of each accumulator's block_n)
    stores: jax.Array  # whether it multiplies and stores: not the first half of a last tile's overlap
    index: jax.Array  # the row task's index in row_tasks
    tile: jax.Array  # the N tile's index (of 2 block_n columns)


class Store:
    """The plain epilogue: one accumulator, rounded to the output's dtype and stored (TMA) into out's rows of the
    group. An epilogue's parts: rhs_columns (one accumulator per entry: the column offset in rhs of its block_n
    columns), scratch (its shared memory), begin (the compute warpgroups, before the task's pipeline) and end (after
    it, with the accumulators); refs are the kernel's gmem refs after lhs and rhs (inputs, then outputs)."""

    rhs_columns: tuple = (0,)

    def scratch(self, plgpu, tiles: Tiles, dtype) -> dict:
        return {"out": plgpu.SMEM((COMPUTE_WGS, tiles.block_m, tiles.block_n), dtype)}

    def begin(self, plgpu, task: Task, scratch: dict, refs) -> None:
        del plgpu, task, scratch, refs

    def end(self, plgpu, task: Task, scratch: dict, refs, accs) -> None:
        (out_gmem,) = refs
        out_smem = scratch["out"].at[task.wg]
        acc = accs[0][...].astype(out_smem.dtype)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous task's stores have read the slot
        out_smem[...] = acc
        plgpu.commit_smem()
        store_rows(plgpu, task, out_smem, out_gmem, task.col)


def store_rows(plgpu, task: Task, smem_ref, gmem_ref, col) -> None:
    """Store smem_ref's [block_m, block_n] rows of the task's group into gmem_ref's rows load + offset on, columns
    col on, where the warpgroup stores (task.stores)."""
    pl.when(task.stores)(
        lambda: _store_rows(
            plgpu, smem_ref, gmem_ref.at[:, pl.ds(col, smem_ref.shape[1])], task.load, task.offset, task.count
        )
    )


def _kernel(num_gmem, tasks_gmem, lhs_gmem, rhs_gmem, *refs, tiles: Tiles, transpose_rhs: bool, n: int, epilogue):
    """The kernel body: each CTA (one memory and two compute warpgroups) walks its share of the (row task, N tile)
    pairs of the num_gmem[0] row tasks with rows; per pair, one warp-specialized pipeline over K (an accumulator per
    epilogue.rhs_columns entry, each multiplying the lhs tile by its columns of rhs) and the epilogue. Chained
    (tiles.chain): a CTA's first pipeline starts its stages, its last drains them."""
    # Mosaic GPU locates its runtime library (the CUDA plugin's) when first imported: after cisjax plan adds the plugin
    from jax.experimental.pallas import mosaic_gpu as plgpu  # lazy: mosaic_gpu

    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    cta_n = COMPUTE_WGS * bn
    k = lhs_gmem.shape[1]
    n_tiles = -(-n // cta_n)
    transforms = _transforms(plgpu, lhs_gmem.dtype, bk)
    chain = tiles.chain and (k // bk) % tiles.stages == 0
    rhs_block, rhs_index = ((cta_n, bk), lambda kk: (0, kk)) if transpose_rhs else ((bk, cta_n), lambda kk: (kk, 0))
    columns = epilogue.rhs_columns

    def pipeline(body, compute_context, state=None):
        rhs_spec = plgpu.BlockSpec(rhs_block, rhs_index, transforms=transforms, memory_space=plgpu.SMEM)
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k // bk,),
            pipeline_state=state,
            memory_registers=MEMORY_REGISTERS,
            in_specs=[
                plgpu.BlockSpec((bm, bk), lambda kk: (0, kk), transforms=transforms, memory_space=plgpu.SMEM),
                *[rhs_spec] * len(columns),
            ],
            wg_axis="wg",
            num_compute_wgs=COMPUTE_WGS,
            max_concurrent_steps=tiles.stages,
            compute_context=compute_context,
        )

    rhs_0 = rhs_gmem.at[0]

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(_ignore, _ignore).get_allocations(lhs_gmem, *[rhs_0] * len(columns)),
        scratch=epilogue.scratch(plgpu, tiles, lhs_gmem.dtype),
        collective_axes="wg",
    )
    def _scope(allocations, scratch):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((num_gmem[0] * n_tiles,), collective_axes="cluster_grid")
        def _tasks(info: plgpu.NDLoopInfo):
            (lin,) = info.index
            task_i, j = lin // n_tiles, lin % n_tiles
            group, load, offset, count = (tasks_gmem[task_i, c] for c in range(4))
            n0, wg_n0, stores = _n_tile(j, wg, bn, n)
            task = Task(wg, pl.multiple_of(load, ROW_ALIGN), offset, count, wg_n0, stores, task_i, j)

            def mma(_, lhs_smem, *rhs_and_accs):
                *rhs_smems, accs = rhs_and_accs

                @pl.when(stores)  # an overlap's columns: not again
                def _multiply():
                    for rhs_smem, acc_ref in zip(rhs_smems, accs):
                        if transpose_rhs:
                            rhs = rhs_smem.at[pl.ds(wg * bn, bn), :].transpose((1, 0))
                        else:
                            rhs = rhs_smem.at[:, pl.ds(wg * bn, bn)]
                        plgpu.wgmma(acc_ref, lhs_smem, rhs)
                    plgpu.wgmma_wait(0)  # the pipeline may refill the step's slots once the body returns

                return accs

            def rhs_of(col):
                cols = pl.ds(col + n0, cta_n)
                return rhs_gmem.at[group, cols, :] if transpose_rhs else rhs_gmem.at[group, :, cols]

            def context(run_pipeline):
                def with_accs(*accs):
                    epilogue.begin(plgpu, task, scratch, refs)
                    epilogue.end(plgpu, task, scratch, refs, run_pipeline(accs))

                pl.run_scoped(with_accs, *[plgpu.ACC((bm, bn), jnp.float32)] * len(columns))

            operands = (lhs_gmem.at[pl.ds(task.load, bm), :], *map(rhs_of, columns))
            if not chain:
                pipeline(mma, context)(*operands, allocations=allocations)
                return
            first, last = info.local_index == 0, info.local_index == info.num_local_steps - 1
            chained = plgpu.PipelinePipeline  # START fills the stages, STEADY goes on, STOP drains them
            state = jnp.where(first, chained.START, jnp.where(last, chained.STOP, chained.STEADY))
            pl.when(first & last)(lambda: pipeline(mma, context)(*operands, allocations=allocations))  # one: alone
            pl.when(~(first & last))(lambda: pipeline(mma, context, state)(*operands, allocations=allocations))

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


def launch(plgpu, body, out_type, sms: int):
    """plgpu.kernel of body on a persistent grid of `sms` CTAs, each one memory and two compute warpgroups; out_type:
    a jax.ShapeDtypeStruct or a tuple of them."""
    return plgpu.kernel(
        body,
        out_type=out_type,
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
    out_type = jax.ShapeDtypeStruct((rp, np_), lhs_RxK.dtype)
    call = row_task_call(sizes_G, rp, n=np_, transpose_rhs=transpose_rhs, sms=sms, tiles=tiles, out_type=out_type)
    return call(lhs_PxK, rhs)[:r, :n]


def row_task_call(sizes_G, rows: int, *, n: int, transpose_rhs: bool, sms: int, tiles: Tiles, out_type, epilogue=None):
    """The row-task kernel as a function of (lhs [rows, K], rhs, *epilogue's gmem inputs) -> out_type, for groups
    of sizes_G over lhs's sorted rows: rows a multiple of 8 and >= block_m, K whole block_k, rhs's N (n) whole
    block_n and >= 2 block_n (the callers pad); epilogue: Store() unless given."""
    tasks_Tx4 = row_tasks(sizes_G, rows, tiles.block_m)
    num_1 = jnp.sum(tasks_Tx4[:, 3] > 0, keepdims=True, dtype=jnp.int32)  # the row tasks with rows: the first ones
    from jax.experimental.pallas import mosaic_gpu as plgpu  # lazy: mosaic_gpu (see _kernel)

    epilogue = epilogue or Store()
    body = functools.partial(_kernel, tiles=tiles, transpose_rhs=transpose_rhs, n=n, epilogue=epilogue)
    kernel = launch(plgpu, body, out_type, sms)
    return lambda lhs, rhs, *inputs: kernel(num_1, tasks_Tx4, lhs, rhs, *inputs)


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
    return launch(plgpu, body, jax.ShapeDtypeStruct((g, kp, np_), x_RxK.dtype), sms)(groups_Gx4, x_PxK, dy_PxN)[
        :, :k, :n
    ]


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
