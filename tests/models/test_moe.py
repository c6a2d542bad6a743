"""MoE dropless dispatch: every impl vs a float64 numpy loop (values and grads), the MoE module."""

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cisjax import sharding
from cisjax.models import moe, moe_hopper, moe_tpu, routing
from tests.models import mgpu_interpret
from tests.support.hf import MESHES
from tests.support.programs import jaxpr_eqns

# gmm (megablox), triton (gpu_grouped): Pallas's interpreter on CPU; mgpu (moe_hopper) in float32 runs the Triton
# kernels (full fp32), in bf16 JAX's Mosaic GPU kernels, here in Mosaic GPU's interpreter (test_moe_hopper.py)
IMPLS = ("tiled", "gmm", "triton", "mgpu", "ragged", "dense")


# ----------------------------------------------------------------------------- moe_ffn vs a float64 loop


def test_moe_ffn_rejects_an_unknown_impl():
    with pytest.raises(ValueError, match="unknown moe impl"):
        moe.moe_ffn(
            jnp.zeros((2, 4)), *(jnp.zeros((3, 4, 4)),) * 3, jnp.zeros((2, 1), jnp.int32), jnp.ones((2, 1)), impl="nope"
        )


def _silu(g):
    return g / (1 + np.exp(-g))


def ref_moe(x, wg, wu, wo, ids, w, ct):
    """float64 loop over tokens and their k experts: y, and the grads of sum(y * ct) w.r.t. (x, wg, wu, wo, w)."""
    x, wg, wu, wo, w, ct = (np.asarray(a, np.float64) for a in (x, wg, wu, wo, w, ct))
    ids = np.asarray(ids)
    y, dx, dwg, dwu, dwo, dw = (np.zeros_like(a) for a in (x, x, wg, wu, wo, w))
    for n in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[n, j]
            g, u = x[n] @ wg[e], x[n] @ wu[e]
            sig = 1 / (1 + np.exp(-g))
            h = _silu(g) * u
            out = h @ wo[e]
            y[n] += w[n, j] * out
            dw[n, j] = ct[n] @ out
            dh = w[n, j] * (wo[e] @ ct[n])
            dwo[e] += np.outer(h, w[n, j] * ct[n])
            dg, du = dh * u * sig * (1 + g * (1 - sig)), dh * _silu(g)
            dwg[e] += np.outer(x[n], dg)
            dwu[e] += np.outer(x[n], du)
            dx[n] += wg[e] @ dg + wu[e] @ du
    return y, (dx, dwg, dwu, dwo, dw)


def _problem(n, d, f, e, ids, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32)
    wg, wu = (rng.normal(size=(e, d, f)).astype(np.float32) * d**-0.5 for _ in range(2))
    wo = rng.normal(size=(e, f, d)).astype(np.float32) * f**-0.5
    ids = np.asarray(ids, np.int32).reshape(n, -1)
    w = rng.uniform(0.1, 1.0, size=ids.shape).astype(np.float32)
    ct = rng.normal(size=(n, d)).astype(np.float32)
    return x, wg, wu, wo, ids, w, ct


def test_ref_moe_matches_finite_differences():
    """The float64 reference's hand-written gradients, checked once by central differences."""
    x, wg, wu, wo, ids, w, ct = _problem(3, 4, 3, 3, [[0, 2], [2, 1], [0, 1]])
    args = [np.asarray(a, np.float64) for a in (x, wg, wu, wo)] + [ids, np.asarray(w, np.float64)]
    _, grads = ref_moe(*args, ct)
    rng = np.random.default_rng(1)
    for i, grad in zip((0, 1, 2, 3, 5), grads):
        for _ in range(3):
            idx = tuple(rng.integers(0, s) for s in args[i].shape)
            lo, hi = [a.copy() for a in args], [a.copy() for a in args]
            lo[i][idx] -= 1e-6
            hi[i][idx] += 1e-6
            fd = (np.sum(ref_moe(*hi, ct)[0] * ct) - np.sum(ref_moe(*lo, ct)[0] * ct)) / 2e-6
            np.testing.assert_allclose(grad[idx], fd, rtol=1e-5, atol=1e-8)


_JITTED = {}


def _run(impl, tile, x, wg, wu, wo, ids, w, ct):
    """(y, grads of sum(y * ct) w.r.t. x, wg, wu, wo, w), jitted once per (impl, tile, shapes)."""
    key = (impl, tile, x.shape, wg.shape, ids.shape)
    if key not in _JITTED:

        def loss(x, wg, wu, wo, w, ids, ct):
            y = moe.moe_ffn(x, wg, wu, wo, ids, w, impl=impl, tile=tile)
            return jnp.sum(y * ct), y

        _JITTED[key] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))
    (_, y), grads = _JITTED[key](x, wg, wu, wo, w, ids, ct)
    return np.asarray(y), [np.asarray(g) for g in grads]


def _ids_cycle(n, k, experts):
    """Token n uses experts[(n + j) % len] for slot j: distinct per token, group sizes as balanced as can be."""
    return [[experts[(i + j) % len(experts)] for j in range(k)] for i in range(n)]


# name -> (N, D, F, E, ids, extra tiles for "tiled"). Most cases leave some experts without tokens.
CASES = {
    # 40 rows over experts 0..3 (10 each): tile 5 divides every group, 64 (-> 40, 20: capped at the rows) does not
    "balanced": (20, 8, 6, 5, _ids_cycle(20, 2, [0, 1, 2, 3]), (5, 64)),
    # uneven groups of 1, 29, 36, 34 rows (experts 0, 5 empty): full and masked tiles, a 1-row group
    "uneven": (
        50,
        8,
        4,
        6,
        [[4, 1] if i == 0 else [2, 3] if i < 17 else [3, 4] if i < 37 else [2, 4] for i in range(50)],
        (16, 8, 1),
    ),
    # groups of 37, 90, 113, 60 rows: tile 64 (-> 64, 16) and 256 (-> 256, 64, 16) run 2x16 + 5 masked,
    # 64 + 16 + 10, 64 + 3x16 + 1, 3x16 + 12; tile 32 (-> 32, 16) 32 + 5, 2x32 + 16 + 10, 3x32 + 16 + 1, 32 + 16 + 12
    "levels": (150, 8, 4, 5, [[0, 1] if i < 37 else [1, 2] if i < 90 else [2, 3] for i in range(150)], (64, 256, 32)),
    # every token on one expert (k = 1): one group of all rows, the other experts empty
    "all_on_one": (33, 8, 4, 4, [[2]] * 33, (32, 11)),
    "single_token": (1, 8, 4, 4, [[3, 0]], (2,)),
    # the same expert twice for a token (route never does this; moe_ffn must still sum both)
    "repeated_slots": (6, 8, 4, 4, [[1, 1], [0, 2], [2, 2], [1, 0], [0, 0], [2, 1]], ()),
    "top4_of_8": (24, 16, 8, 8, _ids_cycle(24, 4, [5, 0, 6, 2, 1, 3]), (8,)),
}


# The fast tier (make test-fast) runs every case with the CPU default (tiled) and every impl on "levels"; CI all.
FAST_CASE = "levels"


@pytest.mark.parametrize(
    "name, impl",
    [
        pytest.param(name, impl, marks=() if impl == "tiled" or name == FAST_CASE else pytest.mark.slow)
        for name in CASES
        for impl in IMPLS
    ],
)
def test_moe_ffn_matches_float64_loop(name, impl, monkeypatch):
    if impl == "mgpu":
        mgpu_interpret.enable(monkeypatch)
    n, d, f, e, ids, tiles = CASES[name]
    x, wg, wu, wo, ids, w, ct = _problem(n, d, f, e, ids, seed=len(name))
    y_ref, grads_ref = ref_moe(x, wg, wu, wo, ids, w, ct)
    used = np.unique(ids)
    runs = [(impl, None)] + ([("tiled", t) for t in tiles] if impl == "tiled" else [])
    for impl, tile in runs:
        y, grads = _run(impl, tile, x, wg, wu, wo, ids, w, ct)
        where = f"{name} impl={impl} tile={tile}"
        np.testing.assert_allclose(y, y_ref, rtol=2e-5, atol=2e-5, err_msg=where)
        for gname, g, g_ref in zip(("x", "wg", "wu", "wo", "w"), grads, grads_ref):
            np.testing.assert_allclose(g, g_ref, rtol=2e-5, atol=2e-5, err_msg=f"{where} d{gname}")
        for g in grads[1:4]:  # experts without tokens get exactly zero gradient
            assert not np.any(g[np.setdiff1d(np.arange(e), used)]), where


@pytest.mark.parametrize(
    "mesh_name, impl",
    [
        (m, impl) if m == "data2_fsdp2_tensor2" and impl == "gmm" else pytest.param(m, impl, marks=pytest.mark.slow)
        for m in MESHES
        for impl in ("gmm", "triton")
    ],
)
def test_kernels_on_a_mesh_match_float64_loop(mesh_name, impl):
    """The gmm and triton dispatches (Pallas kernels) on 8 devices (rows split as "batch", F as "expert_mlp", under shard_map): values and every
    gradient as the float64 loop, with the weights placed as the sharding table places the model's."""
    n, d, f, e = 64, 16, 8, 6
    ids = [[i % 5, (3 * i + 1) % 5] if i % 9 else [2, 4] for i in range(n)]  # expert 5 empty, ragged groups
    x, wg, wu, wo, ids, w, ct = _problem(n, d, f, e, ids, seed=3)
    y_ref, grads_ref = ref_moe(x, wg, wu, wo, ids, w, ct)
    mesh, rules = sharding.make_mesh(MESHES[mesh_name]), sharding.rules_from_config()

    def place(a, axes):
        return jax.device_put(a, sharding.named_sharding(axes, rules, mesh, a.shape))

    rows = ("batch", None)
    args = (
        place(x, rows),
        place(wg, ("expert", "embed", "expert_mlp")),
        place(wu, ("expert", "embed", "expert_mlp")),
        place(wo, ("expert", "expert_mlp", "embed")),
        place(w, rows),
        place(ids, rows),
        place(ct, rows),
    )

    def loss(x, wg, wu, wo, w, ids, ct):
        with sharding.use_mesh(mesh, rules):
            y = moe.moe_ffn(x, wg, wu, wo, ids, w, impl=impl)
        return jnp.sum(y * ct), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(*args)
    np.testing.assert_allclose(np.asarray(y), y_ref, rtol=2e-5, atol=2e-5)
    for gname, g, g_ref in zip(("x", "wg", "wu", "wo", "w"), grads, grads_ref):
        np.testing.assert_allclose(np.asarray(g), g_ref, rtol=2e-5, atol=2e-5, err_msg=f"d{gname}")
    assert y.sharding.is_equivalent_to(args[0].sharding, 2)  # rows stay where they were


def test_moe_ffn_auto_is_the_default_impl_and_bf16_close():
    x, wg, wu, wo, ids, w, ct = _problem(40, 8, 6, 5, _ids_cycle(40, 2, [0, 1, 2, 3]))
    y_ref, grads_ref = ref_moe(x, wg, wu, wo, ids, w, ct)
    assert moe.default_impl() == "tiled"  # the CPU default
    # GPU: by compute capability (default: the traced program's devices': none here); cuda: cisjax plan's targets
    assert [moe.default_impl(p) for p in ("tpu", "gpu", "cuda")] == ["gmm", "triton", "triton"]
    assert [moe.default_impl(p, (9, 0)) for p in ("gpu", "cuda", "tpu", "cpu")] == [
        "mgpu_ws",
        "mgpu_ws",
        "gmm",
        "tiled",
    ]
    assert [moe.default_impl("gpu", c) for c in ((8, 0), (8, 9), (10, 0))] == ["triton"] * 3
    # a decode step's few rows per expert: Triton's small row blocks on Hopper too, under the kernels' 64-row tiles
    few = [moe.default_impl(p, c, rows_per_expert=r) for p, c, r in (("gpu", (9, 0), 8), ("gpu", (9, 0), 64))]
    assert few == ["triton", "mgpu_ws"]
    assert [moe.default_impl(p, (9, 0), rows_per_expert=8) for p in ("tpu", "cpu")] == ["gmm", "tiled"]
    assert moe.device_rows_per_expert(40, 2, 8) == 10.0  # no mesh: every token on the one device
    with sharding.use_mesh(sharding.make_mesh({"fsdp": 8})):
        assert moe.device_rows_per_expert(40, 2, 8) == 1.25  # 5 tokens per device
    np.testing.assert_allclose(moe.moe_ffn(x, wg, wu, wo, ids, w), y_ref, rtol=2e-5, atol=2e-5)
    # bf16 in and out (the tiled impl keeps its loop buffers as uint16 bits): close to float64
    bf = [jnp.asarray(a, jnp.bfloat16) for a in (x, wg, wu, wo, w, ct)]
    for impl, tile in (("tiled", None), ("tiled", 16), ("triton", None), ("dense", None)):  # mgpu: test_moe_hopper.py
        y, grads = _run(impl, tile, *bf[:4], ids, *bf[4:])
        assert y.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
        for a, ref in zip((y, *grads), (y_ref, *grads_ref)):
            a = np.asarray(a, np.float32)
            np.testing.assert_allclose(
                a, ref, rtol=0.03, atol=0.03 * np.abs(ref).max(), err_msg=f"bf16 {impl} tile={tile}"
            )


# ----------------------------------------------------------------------------- MoE module


def test_moe_module_routes_then_dispatches():
    mod = moe.MoE(
        8,
        4,
        6,
        2,
        rngs=nnx.Rngs(0),
        param_dtype=jnp.float32,
        dtype=jnp.float32,
        method="group_limited_greedy",
        n_group=3,
        topk_group=2,
        scaling=1.5,
    )
    x_BxLxD = jax.random.normal(jax.random.key(1), (2, 5, 8))
    y, ids_BxLxK = nnx.jit(lambda m, x: m(x))(mod, x_BxLxD)
    x_NxD = np.asarray(x_BxLxD).reshape(10, 8)
    w_ref, ids_ref = routing.route(
        x_NxD @ np.asarray(mod.router_DxE[...]),
        k=2,
        method="group_limited_greedy",
        n_group=3,
        topk_group=2,
        scaling=1.5,
    )
    np.testing.assert_array_equal(np.asarray(ids_BxLxK).reshape(10, 2), ids_ref)
    y_ref, _ = ref_moe(
        x_NxD, mod.wg_ExDxF[...], mod.wu_ExDxF[...], mod.wo_ExFxD[...], ids_ref, w_ref, np.zeros((10, 8))
    )
    np.testing.assert_allclose(np.asarray(y).reshape(10, 8), y_ref, rtol=2e-5, atol=2e-6)


def test_gmm_row_tile_follows_the_rows_per_expert():
    """megablox's row tile: the power of two at or above the mean group size within [16, 512], never past the rows
    (rounded up to 16). Training's 65,536 rows over 60 experts: 512; a decode step's 512 rows per chip over 60 (8.5
    each): 16, not 512 (the kernel computes a whole tile per group it visits); 4,096 over 60 (68): 128; 300 over 5:
    64; 10 rows: 16. The lanes: 512, 256 or 128 where they divide the dimension, else the dimension."""
    tiling = moe_tpu.gmm_tiling
    assert tiling(65536, 2048, 1408, 60) == (512, 512, 128)
    assert tiling(512, 2048, 1408, 60)[0] == 16 and tiling(4096, 1408, 2048, 60) == (128, 128, 512)
    assert tiling(300, 8, 4, 5) == (64, 8, 4) and tiling(10, 8, 4, 1)[0] == 16 and tiling(40, 8, 4, 1)[0] == 48


def test_auto_on_hopper_takes_the_triton_kernels_for_few_rows_per_expert(monkeypatch):
    """moe_ffn traced for a compute capability 9.0 GPU: 4 rows per expert (a decode step's) go through cisjax's
    Triton grouped matmuls (`cisjax_gmm`), 128 per expert through the Hopper kernels (no `cisjax_gmm`)."""
    monkeypatch.setattr(sharding, "current_platform", lambda: "gpu")
    monkeypatch.setattr(moe_hopper, "compute_capability", lambda *a, **k: (9, 0))

    def kernels(n):
        x = jnp.ones((n, 128), jnp.bfloat16)
        w_ExDxF = jnp.ones((8, 128, 128), jnp.bfloat16)
        ids = jnp.asarray(np.arange(n * 2).reshape(n, 2) % 8, jnp.int32)
        jaxpr = jax.make_jaxpr(moe.moe_ffn)(x, w_ExDxF, w_ExDxF, w_ExDxF, ids, jnp.ones((n, 2), jnp.bfloat16))
        return {
            str(eqn.params.get("name_and_src_info", eqn.params.get("name"))).split()[0]
            for eqn, _ in jaxpr_eqns(jaxpr.jaxpr)
            if eqn.primitive.name == "pallas_call"
        }

    assert "cisjax_gmm" in kernels(16)  # 16 tokens x 2 / 8 experts
    assert "cisjax_gmm" not in kernels(512)
