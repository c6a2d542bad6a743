"""cisjax.models.ragged_ws: the row tasks by hand, and the warp-specialized kernel in Mosaic GPU's interpreter (race
detection on) against float64: ragged and empty groups, rows past the groups, padded K and N, both rhs layouts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

from cisjax.models import ragged_ws
from tests.models import mgpu_interpret

BF16_U = 2.0**-8  # bf16's unit roundoff: the kernel accumulates in fp32 and rounds each output once
FP32_REL = 1e-5  # fp32 end to end: the float64 result within 1e-5 of the magnitude sum |x| @ |w|
# rows, K, N, sizes: groups of 0, 1, 7 and 129 rows, sizes not multiples of 8, 5 rows past the groups (an expert-
# parallel buffer's tail); K 96 and N 80 are padded inside; N 192 is one whole tile of 2 x 64 and a last tile that
# overlaps it by 64 columns (its first warpgroup stores nothing)
SIZES = [0, 37, 1, 0, 120, 7, 129, 0]
CASES = {"ragged": (sum(SIZES) + 5, 128, 192, SIZES), "padded_k_n": (70, 96, 80, [0, 33, 0, 30])}
TILES = ragged_ws.Tiles(block_m=64, block_n=64, block_k=64, stages=2)
SMS = 2  # CTAs of the persistent grids in the interpreter (each costs there: 4 took about 3x the time)


def _ref(x, w, sizes, transpose_rhs):
    """float64 out[r] = x[r] @ w[group(r)] for the rows of the groups, zeros past them."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    w = np.swapaxes(w, 1, 2) if transpose_rhs else w
    out, start = np.zeros((x.shape[0], w.shape[2])), 0
    for g, size in enumerate(sizes):
        out[start : start + size] = x[start : start + size] @ w[g]
        start += size
    return out, np.abs(x) @ np.abs(w).max(axis=0)


def test_row_tasks_by_hand():
    # groups (start, end): 1 (0, 37), 2 (37, 38), 4 (38, 158), 5 (158, 165), 6 (165, 294) over 320 rows, tasks of 64
    # rows from each group's start rounded down to 8; the last one's load moves back to 256 (320 - 64)
    tasks = np.asarray(ragged_ws.row_tasks(jnp.array(SIZES), 320, 64))
    want = [
        (1, 0, 0, 37),  # rows 0-36 from 0
        (2, 32, 5, 1),  # row 37: load from 32, 5 in
        (4, 32, 6, 58),  # rows 38-95
        (4, 96, 0, 62),  # rows 96-157
        (5, 152, 6, 7),  # rows 158-164
        (6, 160, 5, 59),  # rows 165-223
        (6, 224, 0, 64),  # rows 224-287
        (6, 256, 32, 6),  # rows 288-293: loaded from 256, 32 in
    ]
    assert [tuple(t) for t in tasks[: len(want)]] == want
    assert tasks.shape == (ragged_ws.max_tasks(320, 8, 64), 4) and np.all(tasks[len(want) :, 3] == 0)


@pytest.mark.parametrize("sizes", [[0, 0, 0], [64], [1] * 9, [200, 0, 55, 8, 8, 1]])
def test_row_tasks_cover_each_group_once(sizes):
    """Every row of every group in exactly one task of its group, loads 8-aligned and in the buffer, within max_tasks."""
    rows = max(-(-sum(sizes) // 8) * 8, 128)
    tasks = np.asarray(ragged_ws.row_tasks(jnp.array(sizes), rows, 128))
    owner = np.full(rows, -1)
    for g, load, offset, count in tasks:
        assert load % 8 == 0 and 0 <= load <= rows - 128 and offset + count <= 128
        assert np.all(owner[load + offset : load + offset + count] == -1)
        owner[load + offset : load + offset + count] = g
    assert owner[: sum(sizes)].tolist() == [g for g, size in enumerate(sizes) for _ in range(size)]
    assert np.all(owner[sum(sizes) :] == -1)


def test_tiles_refuse_what_the_kernel_cannot_do():
    with pytest.raises(ValueError, match="power of two"):
        ragged_ws.Tiles(block_m=96)
    with pytest.raises(ValueError, match="multiples of 8"):
        ragged_ws.Tiles(block_n=60)


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["forward", "transposed_rhs"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_float64_without_races(name, dtype, transpose_rhs, monkeypatch):
    mgpu_interpret.enable(monkeypatch)
    r, k, n, sizes = CASES[name]
    kx, kw = jax.random.split(jax.random.key(len(sizes)))
    x = jax.random.normal(kx, (r, k), dtype)
    w = jax.random.normal(kw, (len(sizes), n, k) if transpose_rhs else (len(sizes), k, n), dtype)
    gpu_callbacks.reset_gpu_interpret_mode_state()
    with mgpu_interpret.interpreted(detect_races=True):
        out = ragged_ws.ragged_dot(x, w, jnp.array(sizes, jnp.int32), transpose_rhs=transpose_rhs, sms=SMS, tiles=TILES)
    assert not gpu_callbacks.get_races().races_found
    assert out.shape == (r, n) and out.dtype == x.dtype
    m = sum(sizes)
    want, scale = _ref(x, w, sizes, transpose_rhs)
    got = np.asarray(out.astype(jnp.float32), np.float64)[:m]
    if dtype == "float32":
        bound = FP32_REL * scale[:m]
    else:  # rounded once to bf16 from the fp32 sum
        bound = BF16_U * np.abs(want[:m]) + 1e-6 * scale[:m]
    worst = np.max(np.abs(got - want[:m]) / bound)
    assert worst <= 1, f"{worst:.3g} x the bound"


def test_group_blocks_by_hand():
    # groups (start, end) (0, 37), (37, 38), (38, 158) in steps of 64: blocks 0; 0; 0-2 (rows 0-191)
    got = np.asarray(ragged_ws.group_blocks(jnp.array([0, 37, 1, 0, 120]), 64))
    assert got.tolist() == [[0, 0, 0, 0], [0, 37, 0, 1], [37, 38, 0, 1], [38, 38, 0, 0], [38, 158, 0, 3]]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(CASES))
def test_weight_gradient_matches_float64_and_empty_groups_are_zero(name, dtype, monkeypatch):
    """dW[g] = x[g's rows]^T dy[g's rows]; dy is NaN in the rows past the groups (the kernel selects them away) and an
    empty group's dW is exactly 0."""
    mgpu_interpret.enable(monkeypatch)
    r, k, n, sizes = CASES[name]
    kx, ky = jax.random.split(jax.random.key(r))
    x = jax.random.normal(kx, (r, k), dtype)
    dy = jax.random.normal(ky, (r, n), dtype).at[sum(sizes) :].set(jnp.nan)
    gpu_callbacks.reset_gpu_interpret_mode_state()
    with mgpu_interpret.interpreted(detect_races=True):
        dw = ragged_ws.transposed_ragged_dot(x, dy, jnp.array(sizes, jnp.int32), sms=SMS, tiles=TILES)
    assert not gpu_callbacks.get_races().races_found
    assert dw.shape == (len(sizes), k, n) and dw.dtype == x.dtype
    got = np.asarray(dw.astype(jnp.float32), np.float64)
    xs, dys = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    for g, (s, size) in enumerate(zip(starts, sizes)):
        if size == 0:
            assert np.all(got[g] == 0), f"group {g} is empty: its dW must be 0"
            continue
        want = xs[s : s + size].T @ dys[s : s + size]
        scale = np.abs(xs[s : s + size]).T @ np.abs(dys[s : s + size])
        bound = FP32_REL * scale if dtype == "float32" else BF16_U * np.abs(want) + 1e-6 * scale
        worst = np.max(np.abs(got[g] - want) / bound)
        assert worst <= 1, f"group {g}: {worst:.3g} x the bound"


def test_tiles_for_few_rows_per_group_and_narrow_n():
    assert ragged_ws.tiles_for(32768, 60, 1408) == ragged_ws.Tiles(block_m=128, block_n=128)
    assert ragged_ws.tiles_for(1000, 60, 2048) == ragged_ws.Tiles(block_m=64, block_n=128)
    assert ragged_ws.tiles_for(1000, 4, 96).block_n == 64  # one pair of 64 covers N: half the padding of 128s
    assert (
        ragged_ws.wgrad_tiles(1408, 2048) == ragged_ws.Tiles(block_m=128) and ragged_ws.wgrad_tiles(96, 8).block_m == 64
    )


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["forward", "transposed_rhs"])
def test_chained_pipelines_compute_what_separate_ones_do(transpose_rhs, monkeypatch):
    """A CTA's tasks with their pipelines chained (the next task's first K steps loaded during this one's epilogue)
    give bit for bit the unchained kernel's output (the same accumulation order): 6 K steps in stages of 2 and 3 (a
    chain of START, STEADY and STOP pipelines on each of the 2 CTAs) and of 4 (not a divisor: unchained)."""
    mgpu_interpret.enable(monkeypatch)
    sizes = [60, 0, 90, 7, 70]
    r, k, n = sum(sizes), 384, 128
    kx, kw = jax.random.split(jax.random.key(3))
    x = jax.random.normal(kx, (r, k), jnp.bfloat16)
    w = jax.random.normal(kw, (len(sizes), n, k) if transpose_rhs else (len(sizes), k, n), jnp.bfloat16)
    outs = {}
    for stages, chain in ((2, False), (2, True), (3, True), (4, True)):
        tiles = ragged_ws.Tiles(block_m=64, block_n=64, block_k=64, stages=stages, chain=chain)
        gpu_callbacks.reset_gpu_interpret_mode_state()
        with mgpu_interpret.interpreted(detect_races=True):
            outs[stages, chain] = np.asarray(
                ragged_ws.ragged_dot(x, w, jnp.array(sizes), transpose_rhs=transpose_rhs, sms=2, tiles=tiles)
            )
        assert not gpu_callbacks.get_races().races_found
    want, _ = _ref(x, w, sizes, transpose_rhs)
    base = outs.pop((2, False))
    assert np.max(np.abs(base.astype(np.float64) - want) / (BF16_U * np.abs(want) + 1e-6 * np.abs(want).max())) <= 1
    for key, out in outs.items():
        np.testing.assert_array_equal(out, base, err_msg=f"stages, chain = {key}")
