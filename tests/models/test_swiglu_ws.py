"""cisjax.models.swiglu_ws: the fused gate/up (SwiGLU epilogue) and dh (dSwiGLU epilogue) kernels in Mosaic GPU's
interpreter (race detection on) against float64, the custom VJP's values and gradients, and sm_90a compiles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

from cisjax.models import ragged_ws, swiglu_ws
from tests.models import mgpu_interpret
from tests.support.programs import fresh_process_json

U = {"bfloat16": 2.0**-8, "float32": 2.0**-24}  # unit roundoff: each kernel output is rounded once
FP32_REL = 1e-5  # an fp32 accumulation (or fp32 elementwise math) within 1e-5 of its magnitude
# groups of 0, 1, 7 and 129 rows, sizes not multiples of 8, 5 rows past the groups (an expert-parallel buffer's
# tail, NaN where a kernel may read them); F = 192: one pair of 64-column halves and a last pair overlapping it
SIZES = [0, 37, 1, 0, 120, 7, 129, 0]
M = sum(SIZES)
R, D, F = 304, 128, 192
STARTS = np.concatenate([[0], np.cumsum(SIZES)[:-1]])
TILES = ragged_ws.Tiles(block_m=64, block_n=64, block_k=64, stages=2)
SMS = 2  # CTAs of the persistent grids in the interpreter (each costs there: 4 took about 3x the time)


def _f64(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


def _per_group(fn, *row_arrays) -> np.ndarray:
    """[M, ...] of fn(g, each array's rows of group g) stacked over the groups' rows."""
    return np.concatenate([fn(g, *(a[s : s + z] for a in row_arrays)) for g, (s, z) in enumerate(zip(STARTS, SIZES))])


def _within(what: str, got, want, bound) -> None:
    worst = np.max(np.abs(got - want) / bound)
    assert worst <= 1, f"{what}: {worst:.3g} x the bound"


def _silu_parts(g):
    s = 1 / (1 + np.exp(-g))
    return s, g * s


@pytest.mark.parametrize(("dtype", "weighted"), [("bfloat16", False), ("bfloat16", True), ("float32", True)])
def test_gate_up_and_down_grad_match_float64_without_races(dtype, weighted, monkeypatch):
    """gate_up: g = x Wg and u = x Wu (one launch, [Wg | Wu] side by side) into gu, h = silu(g) u of the rounded g
    and u (times each row's routing weight w where weighted); rows past the groups unwritten (NaN in the
    interpreter). down_grad: dh' = dout Wo^T in fp32, dh = w dh' (weighted) and dg = dh u silu'(g), du = dh silu(g)
    from gu, each rounded once, and (weighted) each row's weight gradient <dh', silu(g) u>; gu and w NaN past the
    groups (loaded, never stored: the weight gradient is 0 there)."""
    mgpu_interpret.enable(monkeypatch)
    kx, kw, ko, kd, kg, kr = jax.random.split(jax.random.key(5), 6)
    x = jax.random.normal(kx, (R, D), dtype)
    wgu = jax.random.normal(kw, (len(SIZES), D, 2 * F), dtype) * 0.2
    wo = jax.random.normal(ko, (len(SIZES), F, D), dtype) * 0.2
    dout = jax.random.normal(kd, (R, D), dtype)
    gu_in = (jax.random.normal(kg, (R, 2 * F), dtype) * 2).at[M:].set(jnp.nan)
    w_R = jax.random.uniform(kr, (R,), jnp.float32, 0.1, 1.0).at[M:].set(jnp.nan) if weighted else None
    sizes = jnp.array(SIZES, jnp.int32)
    gpu_callbacks.reset_gpu_interpret_mode_state()
    with mgpu_interpret.interpreted(detect_races=True):
        h, gu = swiglu_ws.gate_up(x, wgu, sizes, w_R, sms=SMS, tiles=TILES)
        dgu = swiglu_ws.down_grad(dout, wo, gu_in, sizes, w_R, sms=SMS, tiles=TILES)
    assert not gpu_callbacks.get_races().races_found
    dgu, dw = dgu if weighted else (dgu, None)
    assert (h.shape, gu.shape, dgu.shape) == ((R, F), (R, 2 * F), (R, 2 * F)) and h.dtype == gu.dtype == x.dtype
    u = U[dtype]
    w64 = np.asarray(w_R, np.float64)[:M, None] if weighted else np.ones((M, 1))
    xs, ws = _f64(x), _f64(wgu)
    want_gu = _per_group(lambda g, xg: xg @ ws[g], xs)
    scale = _per_group(lambda g, xg: np.abs(xg) @ np.abs(ws[g]), xs)
    _within("gu", _f64(gu)[:M], want_gu, u * np.abs(want_gu) + FP32_REL * scale)
    g, up = _f64(gu)[:M, :F], _f64(gu)[:M, F:]
    want_h = _silu_parts(g)[1] * up * w64
    _within("h", _f64(h)[:M], want_h, (u + FP32_REL) * np.abs(want_h) + 1e-30)
    assert np.all(np.isnan(_f64(h)[M:])) and np.all(np.isnan(_f64(gu)[M:]))  # unwritten: swiglu zeroes h's

    os_, ds = _f64(wo), _f64(dout)
    dh1 = _per_group(lambda g, dg: dg @ os_[g].T, ds)  # dh' (unweighted)
    mag = _per_group(lambda g, dg: np.abs(dg) @ np.abs(os_[g]).T, ds)
    g, up = _f64(gu_in)[:M, :F], _f64(gu_in)[:M, F:]
    s, silu = _silu_parts(g)
    dsilu = s + silu * (1 - s)
    dh, mag_w = dh1 * w64, mag * w64
    # fp32's error: dh's accumulation (of its magnitude sum) and silu' = s + silu (1 - s) evaluated in fp32 (of its
    # terms' magnitude: it cancels near g = -1)
    for what, want, err, got in (
        ("dg", dh * up * dsilu, mag_w * np.abs(up * dsilu) + np.abs(dh * up) * (s + np.abs(silu)), _f64(dgu)[:M, :F]),
        ("du", dh * silu, mag_w * np.abs(silu), _f64(dgu)[:M, F:]),
    ):
        _within(what, got, want, (u + FP32_REL) * np.abs(want) + FP32_REL * err + 1e-30)
    if weighted:
        assert dw.shape == (R,) and dw.dtype == jnp.float32
        want_dw = np.sum(dh1 * silu * up, axis=1)
        err = np.sum((mag + np.abs(dh1)) * np.abs(silu * up), axis=1)
        _within("dw", np.asarray(dw, np.float64)[:M], want_dw, FP32_REL * err + 1e-30)
        assert np.all(np.asarray(dw)[M:] == 0)


def test_gathered_partials_by_hand():
    # 10 rows, tasks of 4: task 0 loads row 0 and holds group 0's rows 0-2, task 1 loads 0 and holds group 1's row 3
    # (offset 3), task 2 loads 4 and holds group 1's rows 4-7, task 3 holds none; two shares a task; rows 8-9 in none
    tasks = jnp.array([[0, 0, 0, 3], [1, 0, 3, 1], [1, 4, 0, 4], [0, 0, 0, 0]], jnp.int32)
    partials = jnp.arange(4 * 2 * 4, dtype=jnp.float32).reshape(4, 2, 4)  # [task, share, position]
    got = np.asarray(swiglu_ws.gathered_partials(partials, tasks, 10))
    p = np.asarray(partials)
    want = [p[0, 0, i] + p[0, 1, i] for i in range(3)] + [p[1, 0, 3] + p[1, 1, 3]]
    want += [p[2, 0, i] + p[2, 1, i] for i in range(4)] + [0.0, 0.0]
    assert got.tolist() == want


def test_swiglu_values_and_gradients_match_float64(monkeypatch):
    """The custom VJP, stage by stage against float64 of each kernel's own inputs (gate_up's h and gu, down_grad's
    dgu, recomputed: the kernels are deterministic): out = h Wo, dx = [dg | du] [Wg | Wu]^T (one call, K = 2F),
    dWg and dWu = x^T [dg | du] (one call), dWo = h^T dout; the empty groups' weight gradients exactly 0, and
    none is NaN though the rows past the groups are (h's: zeroed, full_groups=False)."""
    mgpu_interpret.enable(monkeypatch)
    kx, kg, ku, ko, kd = jax.random.split(jax.random.key(9), 5)
    x = jax.random.normal(kx, (R, D), jnp.bfloat16)
    wg, wu = (jax.random.normal(key, (len(SIZES), D, F), jnp.bfloat16) * 0.2 for key in (kg, ku))
    wo = jax.random.normal(ko, (len(SIZES), F, D), jnp.bfloat16) * 0.2
    dout = jax.random.normal(kd, (R, D), jnp.bfloat16)
    sizes = jnp.array(SIZES, jnp.int32)
    tiles = swiglu_ws.tiles_for(R, len(SIZES))
    with ragged_ws.interpreted(True):
        h, gu = swiglu_ws.gate_up(x, jnp.concatenate([wg, wu], axis=2), sizes, sms=SMS, tiles=tiles)
        dgu = swiglu_ws.down_grad(dout, wo, gu, sizes, sms=SMS, tiles=tiles)
        out, vjp = jax.vjp(lambda *a: swiglu_ws.swiglu(*a, sizes, None, True, SMS, False), x, wg, wu, wo)
    dx, dwg, dwu, dwo = vjp(dout)
    xs, hs, ds, dgus = _f64(x), _f64(h), _f64(dout), _f64(dgu)
    wgus, os_ = _f64(jnp.concatenate([wg, wu], axis=2)), _f64(wo)
    checks = [
        (
            "out",
            out[:M],
            _per_group(lambda g, a: a @ os_[g], hs),
            _per_group(lambda g, a: np.abs(a) @ np.abs(os_[g]), hs),
        ),
        ("dx", dx[:M], *(_per_group(lambda g, a, f=f: f(a) @ f(wgus[g]).T, dgus) for f in (lambda a: a, np.abs))),
    ]
    for what, got, want, scale in checks:
        _within(what, _f64(got), want, U["bfloat16"] * np.abs(want) + FP32_REL * scale)
    for what, got, left, right in (("dWg", dwg, xs, dgus[:, :F]), ("dWu", dwu, xs, dgus[:, F:]), ("dWo", dwo, hs, ds)):
        got = _f64(got)
        assert not np.isnan(got).any(), what
        for g, (s, z) in enumerate(zip(STARTS, SIZES)):
            if z == 0:
                assert np.all(got[g] == 0), f"{what}: group {g} is empty"
                continue
            want = left[s : s + z].T @ right[s : s + z]
            scale = np.abs(left[s : s + z]).T @ np.abs(right[s : s + z])
            _within(f"{what}[{g}]", got[g], want, U["bfloat16"] * np.abs(want) + FP32_REL * scale)


def test_swiglu_refuses_unpadded_shapes():
    x = jnp.zeros((300, 128), jnp.bfloat16)
    w = jnp.zeros((2, 128, 192), jnp.bfloat16)
    with pytest.raises(ValueError, match="must be whole"):
        swiglu_ws.swiglu(x, w, w, jnp.zeros((2, 192, 128), jnp.bfloat16), jnp.array([300, 0]), None, True, SMS, True)
    assert swiglu_ws.padded_width(100) == 128 and swiglu_ws.padded_width(1408) == 1408


def test_kernel_flops_by_hand():
    # 1,000 rows in 4 groups (250 a group: 128-row tasks), D 64, F 32 (padded to 128): at most (1,000 + 7 x 4) // 128
    # + 4 = 12 tasks (1,536 rows); gate/up over 2 x 128 columns, down over D = 64 in one pair of 64; dh over 128,
    # dx of K 256; the weight gradients' rows 1,000 + 4 x 64 over [64, 256] (128-column halves) and [128, 64] (one
    # pair of 64)
    fwd = 2 * 1536 * 64 * 256 + 2 * 1536 * 128 * 128
    bwd = 2 * 1536 * 64 * 128 + 2 * 1536 * 256 * 128 + 2 * 1256 * 64 * 256 + 2 * 1256 * 128 * 128
    assert swiglu_ws.kernel_flops(1000, 4, 64, 32, backward=False) == fwd
    assert swiglu_ws.kernel_flops(1000, 4, 64, 32, backward=True) == fwd + bwd


@pytest.mark.slow
def test_paper_shapes_compile_for_sm90a_within_shared_memory():
    """swiglu's forward and backward with routing weights (its six kernel calls) compile for a deviceless H100 (sm_90a) at the three paper
    shapes' MoE layers (8,192 tokens, hidden 2048), which Mosaic GPU refuses when a kernel exceeds the SM's shared
    memory: 4 stages of ragged_ws's default 128 x 2 x 128 tiles do (a check that can fail). In a fresh process: the
    CUDA plugin loads before Mosaic GPU."""
    out = fresh_process_json(
        """
        import json
        import jax, jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec as P
        from cisjax import sharding
        from cisjax.plan import hardware

        mesh = sharding.make_mesh({"fsdp": 1}, hardware.target("h100x1").devices())
        from cisjax.models import ragged_ws, swiglu_ws  # after the plugin

        spec = NamedSharding(mesh, P())
        def arg(*shape, dtype=jnp.bfloat16):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=spec)

        def compiles(fn, *args):
            def traced(*a):
                with sharding.use_mesh(mesh):
                    return fn(*a)
            try:
                jax.jit(traced).lower(*args).compile()
                return "ok"
            except Exception as e:  # noqa: BLE001 - the message is the result
                return str(e)[:200]

        def both(x, wg, wu, wo, sizes, w):
            out, vjp = jax.vjp(lambda x, wg, wu, wo, w: swiglu_ws.swiglu(x, wg, wu, wo, sizes, w, False, 132, True),
                               x, wg, wu, wo, w)
            return out, vjp(x)

        out = {}
        for name, (e, k, f) in {"qwen15": (60, 4, 1408), "dsv2_lite": (64, 6, 1408), "qwen3": (128, 8, 768)}.items():
            r, d = 8192 * k, 2048
            weights = arg(r, dtype=jnp.float32)
            out[name] = compiles(both, arg(r, d), arg(e, d, f), arg(e, d, f), arg(e, f, d), arg(e, dtype=jnp.int32), weights)
        four = ragged_ws.Tiles(stages=4)
        out["4 stages"] = compiles(
            lambda x, w, s: ragged_ws.ragged_dot(x, w, s, transpose_rhs=False, sms=132, tiles=four),
            arg(32768, 2048), arg(60, 2048, 1408), arg(60, dtype=jnp.int32),
        )
        print(json.dumps(out))
        """
    )
    four = out.pop("4 stages")
    assert out == {"qwen15": "ok", "dsv2_lite": "ok", "qwen3": "ok"}, out
    assert "shared memory" in four
