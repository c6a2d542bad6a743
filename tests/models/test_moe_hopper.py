"""cisjax.models.moe_hopper: JAX's Hopper grouped matmuls, run in Mosaic GPU's interpreter (values, dx and dW vs a
float64 reference, ragged and empty groups, padded shapes), the block table, the float32 fallback, auto by device."""

import contextlib
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals
from jax.extend import core as jex_core

from cisjax import errors, sharding
from cisjax.models import moe, moe_hopper
from tests.models import mgpu_interpret
from tests.models.test_moe import _ids_cycle, _problem, _run, ref_moe
from tests.support.programs import fresh_process_json

BF16_U = 2.0**-8  # bf16's unit roundoff: the kernels accumulate in fp32 and round each output once


def _ref_gmm(x, w, sizes):
    """float64: out[r] = x[r] @ w[group(r)] for the rows of the groups (the rest zero), the inputs as given."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    out = np.zeros((x.shape[0], w.shape[2]))
    start = 0
    for g, size in enumerate(sizes):
        out[start : start + size] = x[start : start + size] @ w[g]
        start += size
    return out


def _ref_dw(x, dy, sizes):
    x, dy = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    return np.stack([x[s : s + n].T @ dy[s : s + n] for s, n in zip(starts, sizes)])


def _assert_rounded_once(got, want, what):
    """got is want rounded to bf16 once (the fp32 accumulation's own error far below): |got - want| <= u |want|."""
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    err = np.abs(got - want)
    bound = BF16_U * np.abs(want) + 1e-6 * np.abs(want).max()
    assert np.all(err <= bound), f"{what}: worst {np.max(err / np.maximum(bound, 1e-30)):.3g} x the bf16 bound"


# rows, K, N, group sizes: rows past the groups where sum < rows (an expert-parallel buffer's tail)
GMM_CASES = {
    # K 96 and N 80 (not whole blocks of 64: padded inside), 200 rows (not whole row blocks), empty groups first,
    # inside and last, a group of 1 row, groups crossing the row blocks
    "ragged_padded": (200, 96, 80, [0, 37, 1, 0, 120, 42, 0]),
    # rows past the groups (their x and cotangent are large: none of it may reach dW or the groups' rows)
    "rows_past_groups": (192, 64, 128, [50, 0, 70]),
}


@pytest.mark.parametrize("name", list(GMM_CASES))
def test_gmm_values_and_gradients_match_float64(name, monkeypatch):
    mgpu_interpret.enable(monkeypatch)
    r, k, n, sizes = GMM_CASES[name]
    rng = np.random.default_rng(len(name))
    x, w, dy = (jnp.asarray(rng.normal(size=s), jnp.bfloat16) for s in ((r, k), (len(sizes), k, n), (r, n)))
    rows = sum(sizes)
    x, dy = x.at[rows:].set(1e4), dy.at[rows:].set(-1e4)  # finite, as the contract asks, and loud
    sizes_G = jnp.asarray(sizes, jnp.int32)
    out, vjp = jax.vjp(lambda x, w: moe_hopper.gmm(x, w, sizes_G, True), x, w)
    dx, dw = vjp(dy)
    assert out.dtype == dx.dtype == dw.dtype == jnp.bfloat16 and dw.shape == w.shape
    xf, wf, dyf = (np.asarray(a.astype(jnp.float32), np.float64) for a in (x, w, dy))
    _assert_rounded_once(out[:rows], _ref_gmm(xf, wf, sizes)[:rows], f"{name} out")
    _assert_rounded_once(dx[:rows], _ref_gmm(dyf, np.swapaxes(wf, 1, 2), sizes)[:rows], f"{name} dx")
    _assert_rounded_once(dw, _ref_dw(xf[:rows], dyf[:rows], sizes), f"{name} dW")
    assert not np.any(np.asarray(dw)[np.asarray(sizes) == 0])  # an empty group's gradient is exactly zero


def test_gmm_float16(monkeypatch):
    """fp16, the kernels' other dtype: one call, forward and both gradients, at the fp16 bound."""
    mgpu_interpret.enable(monkeypatch)
    rng = np.random.default_rng(0)
    x, w, dy = (jnp.asarray(rng.normal(size=s), jnp.float16) for s in ((128, 64), (2, 64, 64), (128, 64)))
    sizes = [70, 58]
    out, vjp = jax.vjp(lambda x, w: moe_hopper.gmm(x, w, jnp.asarray(sizes, jnp.int32), True), x, w)
    dx, dw = vjp(dy)
    xf, wf, dyf = (np.asarray(a, np.float64) for a in (x, w, dy))
    for got, want in ((out, _ref_gmm(xf, wf, sizes)), (dx, _ref_gmm(dyf, np.swapaxes(wf, 1, 2), sizes))):
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2.0**-11, atol=1e-3)
    np.testing.assert_allclose(np.asarray(dw, np.float64), _ref_dw(xf, dyf, sizes), rtol=2.0**-11, atol=1e-3)


def test_masked_rows_past_the_groups(monkeypatch):
    """The expert-parallel receive buffer: rows past the groups, which the kernels leave unwritten (the interpreter
    fills them with NaN), masked out of y and dx by moe._masked_rows; none of them reaches a weight gradient."""
    mgpu_interpret.enable(monkeypatch)
    n, d, f, e = 100, 16, 8, 4
    ids = [[i % 3, 3] if i % 5 else [1, 3] for i in range(n)]
    x, wg, wu, wo, ids, w, ct = _problem(n, d, f, e, ids, seed=5)
    order = np.argsort(np.asarray(ids).reshape(-1), kind="stable")
    sizes = np.bincount(np.asarray(ids).reshape(-1), minlength=e)
    buf = 260  # 200 rows in the groups, 60 past them
    xs = np.concatenate([x[order // 2], np.full((buf - 200, d), 7.0, np.float32)])
    cts = np.random.default_rng(6).normal(size=(buf, d)).astype(np.float32)
    bf = [jnp.asarray(a, jnp.bfloat16) for a in (xs, wg, wu, wo, cts)]
    swiglu = functools.partial(moe_hopper.mgpu_swiglu, interpret=True)

    def loss(xs, wg, wu, wo):
        y = moe._masked_rows(swiglu, xs, wg, wu, wo, jnp.asarray(sizes, jnp.int32))
        return jnp.sum(y.astype(jnp.float32) * bf[4].astype(jnp.float32)), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(*bf[:4])
    # the float64 loop on the same rows: each sorted row its own token of weight 1
    rounded = [np.asarray(a.astype(jnp.float32), np.float64) for a in bf]
    y_ref, (dx_ref, *dw_ref, _) = ref_moe(
        rounded[0][:200], *rounded[1:4], np.sort(np.asarray(ids).reshape(-1))[:, None], np.ones((200, 1)), cts[:200]
    )
    y, (dx, *dws) = np.asarray(y.astype(jnp.float32)), [np.asarray(g.astype(jnp.float32)) for g in grads]
    assert not np.any(y[200:]) and not np.any(dx[200:]) and all(np.isfinite(g).all() for g in dws)
    for got, ref, what in ((y[:200], y_ref, "y"), (dx[:200], dx_ref, "dx"), *zip(dws, dw_ref, ("dwg", "dwu", "dwo"))):
        np.testing.assert_allclose(got, ref, rtol=0.03, atol=0.03 * np.abs(ref).max(), err_msg=what)


def test_mgpu_ws_keeps_the_sorted_rows_h_and_gu_and_nothing_of_the_combine(monkeypatch):
    """What moe_ffn("mgpu_ws") keeps for its backward besides its arguments (what a layer scan without remat stores
    per layer): the sorted rows [R, D], h [R, F] and gu [R, 2F]; not the experts' output (the routing weights'
    gradient comes from the dh kernel: routing.combine would keep [R, D] more), not a [Wg | Wu] copy of the weights
    (the backward makes it again), not g, u or silu(g) apart (mgpu keeps those)."""
    mgpu_interpret.enable(monkeypatch)
    n, d, f, e, k = 64, 128, 192, 4, 2
    x, w = jnp.ones((n, d), jnp.bfloat16), jnp.ones((n, k), jnp.bfloat16)
    wg, wo = jnp.ones((e, d, f), jnp.bfloat16), jnp.ones((e, f, d), jnp.bfloat16)
    ids = jnp.asarray(np.arange(n * k).reshape(n, k) % e, jnp.int32)

    def kept(impl):
        ffn = lambda x, wg, wu, wo, w: moe.moe_ffn(x, wg, wu, wo, ids, w, impl=impl)  # noqa: E731
        return sorted(
            a.shape for a, why in saved_residuals(ffn, x, wg, wg, wo, w) if "argument" not in why and a.ndim > 1
        )

    r = n * k  # 128: a multiple of moe_hopper.ROW_ALIGN, no padding
    assert kept("mgpu_ws") == sorted([(r, d), (r, f), (r, 2 * f)])
    assert len(kept("mgpu")) > 3


@pytest.mark.parametrize("impl", ["mgpu", "mgpu_ws"])
def test_moe_ffn_mgpu_bf16_close_to_float64(impl, monkeypatch):
    """moe_ffn's "mgpu" and "mgpu_ws" in bf16 (JAX's Mosaic GPU kernels or cisjax's warp-specialized ones,
    interpreted) as close to the float64 loop as the other impls are (tests/models/test_moe.py's bf16 bound),
    routing weights and all; unused experts get exactly zero."""
    mgpu_interpret.enable(monkeypatch)
    x, wg, wu, wo, ids, w, ct = _problem(40, 8, 6, 5, _ids_cycle(40, 2, [0, 1, 2, 3]))  # expert 4 unused
    y_ref, grads_ref = ref_moe(x, wg, wu, wo, ids, w, ct)
    bf = [jnp.asarray(a, jnp.bfloat16) for a in (x, wg, wu, wo, w, ct)]
    y, grads = _run(impl, None, *bf[:4], ids, *bf[4:])
    assert y.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
    for a, ref, what in zip((y, *grads), (y_ref, *grads_ref), ("y", "dx", "dwg", "dwu", "dwo", "dw")):
        a = np.asarray(a, np.float32)
        np.testing.assert_allclose(a, ref, rtol=0.03, atol=0.03 * np.abs(ref).max(), err_msg=what)
    assert all(not np.any(np.asarray(g, np.float32)[4]) for g in grads[1:4])


def test_float32_runs_the_full_precision_triton_kernels(monkeypatch):
    """wgmma would multiply float32 in TF32: an fp32 "mgpu" program runs the Triton kernels (at HIGHEST), a bf16 one
    JAX's Mosaic GPU kernels (forward and both gradients)."""
    mgpu_interpret.enable(monkeypatch)
    sizes = jnp.asarray([40, 0, 24], jnp.int32)

    def kernels(dtype):
        """The kernels' primitives in the jaxpr of the gradient: (Triton pallas_calls, Mosaic GPU mpmd_maps)."""
        args = [jnp.ones(s, dtype) for s in ((64, 16), (3, 16, 8), (3, 16, 8), (3, 8, 16))]

        def loss(*a):
            return jnp.sum(moe_hopper.mgpu_swiglu(*a, sizes, interpret=True).astype(jnp.float32))

        names = []

        def walk(jaxpr):
            for eqn in jaxpr.eqns:
                names.append(eqn.primitive.name)
                if eqn.primitive.name not in ("pallas_call", "mpmd_map"):  # not into a kernel's body
                    for sub in jex_core.jaxprs_in_params(eqn.params):
                        walk(sub)

        walk(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args).jaxpr)
        return names.count("pallas_call"), names.count("mpmd_map")

    assert kernels(jnp.float32) == (9, 0)  # 3 matmuls x (forward, input gradient, weight gradient)
    assert kernels(jnp.bfloat16) == (0, 9)


def test_blocks_table_and_rule():
    b = moe_hopper.blocks("ragged_dot", 32768, 60, 2048, 1408)  # the measured shape: the table's entry
    assert b == moe_hopper.BLOCKS[("ragged_dot", 2048, 1408)] == moe_hopper.Blocks(128, 128, 64, 4, 2)
    # groups under 128 rows on average: the rule, 64-row tiles
    assert moe_hopper.blocks("ragged_dot", 4096, 60, 2048, 1408) == moe_hopper.Blocks(64, 128, 64, 4, 2)
    assert moe_hopper.blocks("ragged_dot", 32768, 60, 1408, 2048) == moe_hopper.Blocks(128, 128, 64, 4, 2)
    assert moe_hopper.blocks("ragged_dot", 32768, 60, 96, 80) == moe_hopper.Blocks(128, 64, 64, 4, 2)
    assert moe_hopper.blocks("transposed", 32768, 60, 2048, 1408) == moe_hopper.Blocks(128, 128, 64, 4, 1)
    assert moe_hopper.blocks("transposed", 100, 60, 96, 768) == moe_hopper.Blocks(64, 128, 64, 4, 1)
    # the input gradient: the forward's rule, not its table entry (measured for the forward alone)
    assert moe_hopper.blocks("ragged_dot_t", 32768, 60, 2048, 1408) == moe_hopper.Blocks(128, 128, 64, 4, 2)
    assert moe_hopper.blocks("ragged_dot_t", 32768, 60, 2048, 1000) == moe_hopper.Blocks(128, 64, 64, 4, 2)
    with pytest.raises(ValueError, match="unknown kernel"):
        moe_hopper.blocks("nope", 1, 1, 64, 64)


def _recording_kernels(calls):
    """Stand-ins with the kernels' signatures and shape checks, recording each call (jax.eval_shape: nothing runs)."""

    def ragged_dot(lhs, rhs, *, group_sizes, block_m, block_n, block_k, max_concurrent_steps, grid_block_n, **kw):
        transpose = kw.get("transpose_rhs", False)
        (m, k), n = lhs.shape, rhs.shape[1 if transpose else 2]
        assert lhs.dtype == rhs.dtype and k == rhs.shape[2 if transpose else 1] and k % block_k == 0
        assert group_sizes.shape == (rhs.shape[0],)
        calls.append(("ragged_dot", lhs.shape, rhs.shape, transpose, block_m, block_n, block_k, grid_block_n))
        return jnp.zeros((m, n), lhs.dtype)

    def transposed(lhs, rhs, *, group_sizes, block_m, block_n, block_k, max_concurrent_steps, grid_block_n):
        (k, m), n = lhs.shape, rhs.shape[1]
        assert lhs.dtype == rhs.dtype and k == rhs.shape[0] and m % block_m == 0 and n % block_n == 0
        calls.append(("transposed", lhs.shape, rhs.shape, False, block_m, block_n, block_k, grid_block_n))
        return jnp.zeros((group_sizes.shape[0], m, n), lhs.dtype)

    return ragged_dot, transposed


def test_paper_shapes_need_no_padding_of_the_weights(monkeypatch):
    """At Qwen1.5-MoE's expert shape (8,192 tokens x top-4 in 60 experts, 2,048 x 1,408) the kernels get the arrays
    as they are (no copy of a weight stack), in the table's blocks; the nine calls of forward and backward."""
    calls = []
    monkeypatch.setattr(moe_hopper, "_kernels", lambda: _recording_kernels(calls))
    r, d, f, e = 32768, 2048, 1408, 60
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((r, d), (e, d, f), (e, d, f), (e, f, d))]

    def loss(*a):
        return jnp.sum(moe_hopper.mgpu_swiglu(*a, jnp.full((e,), r // e, jnp.int32), interpret=False))

    jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2, 3)), *args)
    assert len(calls) == 9
    for kernel, lhs, rhs, *_ in calls:  # rows, K and N as they are: no padding
        assert lhs[0] == r and (rhs in ((e, d, f), (e, f, d)) if kernel == "ragged_dot" else rhs[0] == r)
    assert ("ragged_dot", (r, d), (e, d, f), False, 128, 128, 64, 2) in calls  # gate/up forward: the table's entry
    assert ("ragged_dot", (r, f), (e, d, f), True, 128, 128, 64, 2) in calls  # their input gradient
    assert ("transposed", (r, d), (r, f), False, 128, 128, 64, 1) in calls  # their weight gradient


def _gate_up_selects(n, d, f, e, k, mesh=None):
    """select_n equations with a float [..., F] output in the jaxpr of moe_ffn(impl="mgpu")'s forward and backward
    for n tokens (the gate/up validity selects of mgpu_swiglu and their transposes), on `mesh` (expert-parallel where
    its rules split E) or none."""
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((n, d), (e, d, f), (e, d, f), (e, f, d), (n, k))]
    ids = jax.ShapeDtypeStruct((n, k), jnp.int32)

    def loss(x, wg, wu, wo, w, ids):
        with sharding.use_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            return jnp.sum(moe.moe_ffn(x, wg, wu, wo, ids, w, impl="mgpu").astype(jnp.float32))

    def selects(jaxpr):
        for eqn in jaxpr.eqns:
            out = eqn.outvars[0].aval
            yield (
                eqn.primitive.name == "select_n" and jnp.issubdtype(out.dtype, jnp.floating) and out.shape[-1:] == (f,)
            )
            for sub in jex_core.jaxprs_in_params(eqn.params):
                yield from selects(sub)

    return sum(selects(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*args, ids).jaxpr))


def test_validity_selects_only_where_rows_can_be_unwritten(monkeypatch):
    """mgpu_swiglu's gate/up selects (a pass over [rows, F] each, forward and backward; under a layer scan without
    remat a stored [rows, F] mask too) only where the kernels can leave rows unwritten: moe_ffn's dispatch without
    expert parallelism, every sorted row in a group and the rows whole blocks of ROW_ALIGN, has none; rows padded up
    to a block, or an expert-parallel receive buffer (groups ending before it does), keep them."""
    monkeypatch.setattr(moe_hopper, "_kernels", lambda: _recording_kernels([]))  # traced, never run
    monkeypatch.setattr(moe_hopper, "_seeing", lambda fn, sms: fn)
    monkeypatch.setattr(moe_hopper, "INTERPRET", True)
    d, f, e, k = 64, 96, 8, 2  # F apart from D: the expert-parallel masks on [rows, D] are not counted
    assert _gate_up_selects(128, d, f, e, k) == 0  # 256 rows: 2 x ROW_ALIGN
    assert _gate_up_selects(100, d, f, e, k) >= 2  # 200 rows padded to 256: 56 in no group
    assert _gate_up_selects(128, d, f, e, k, sharding.make_mesh({"expert": 8})) >= 2
    # rows split over 8 devices, E not: each device's 64 tokens x 2 fill one block
    assert _gate_up_selects(512, d, f, e, k, sharding.make_mesh({"fsdp": 8})) == 0


def test_kernel_signatures_are_the_ones_called():
    """The keyword arguments moe_hopper passes, and the module global `jax` its grid-size rebinding replaces (the same
    in jax 0.10.2, 0.11.0 and 0.11.1's sources: a jax where they change fails here, not on a GPU)."""
    ragged_dot, transposed = moe_hopper._kernels()
    blocks = {"group_sizes", "block_m", "block_n", "block_k", "max_concurrent_steps", "grid_block_n"}
    assert blocks | {"transpose_rhs"} <= set(inspect.signature(ragged_dot).parameters)
    assert blocks <= set(inspect.signature(transposed).parameters)
    assert transposed.__globals__["jax"] is jax and "jax.devices()[0].core_count" in inspect.getsource(transposed)


def test_kernels_see_the_devices_they_are_given():
    """_seeing: the weight-gradient kernel's jax.devices()[0].core_count is the program's GPU's SM count (the kernel
    itself where that is unknown), without touching the kernel's module."""
    _, transposed = moe_hopper._kernels()
    assert moe_hopper._seeing(transposed, None) is transposed
    seen = moe_hopper._seeing(transposed, 3)
    assert seen is not transposed and seen.__globals__["jax"].devices()[0].core_count == 3
    assert seen.__globals__["jax"].numpy is jnp and transposed.__globals__["jax"] is jax
    assert moe_hopper._sms() is None  # no mesh: the kernel asks JAX's default device
    with sharding.use_mesh(sharding.make_mesh({"fsdp": 8})):
        assert moe_hopper._sms() is None  # CPU devices have no SMs


def test_mgpu_is_refused_where_it_cannot_run():
    args = (jnp.zeros((4, 8)), *(jnp.zeros((2, 8, 8)),) * 3, jnp.zeros((4, 1), jnp.int32), jnp.ones((4, 1)))
    with pytest.raises(errors.UserError, match="compute capability 9"):
        moe.moe_ffn(*args, impl="mgpu")  # CPU, interpreter not enabled
    assert moe_hopper.compute_capability() is None  # a CPU device has none
    with sharding.use_mesh(sharding.make_mesh({"fsdp": 8})):
        assert moe_hopper.compute_capability() is None


@pytest.mark.slow
def test_h100_target_picks_and_compiles_the_hopper_kernels(tmp_path):
    """A CPU host compiling for deviceless H100s (cisjax plan's targets, XLA's CUDA plugin): auto picks "mgpu_ws" on
    compute capability 9.0 and "triton" on an A100's 8.0, and the MoE's forward and backward compile for sm_90a (the
    persistent grids sized by the target's SM count, not the host's devices). In a fresh process: the plugin."""
    out = fresh_process_json(
        """
        import json, sys
        import jax, jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec as P
        from cisjax import sharding
        from cisjax.models import moe
        from cisjax.plan import hardware

        out = {}
        for name in ("a100x1", "h100x1"):
            mesh = sharding.make_mesh({"fsdp": 1}, hardware.target(name).devices())
            with sharding.use_mesh(mesh):
                out[name] = moe.default_impl()
        n, d, f, e, k = 256, 128, 192, 4, 2
        spec = NamedSharding(mesh, P())
        shapes = [((n, d), jnp.bfloat16), ((e, d, f), jnp.bfloat16), ((e, d, f), jnp.bfloat16),
                  ((e, f, d), jnp.bfloat16), ((n, k), jnp.int32), ((n, k), jnp.bfloat16)]
        args = [jax.ShapeDtypeStruct(s, t, sharding=spec) for s, t in shapes]

        def loss(x, wg, wu, wo, ids, w):
            with sharding.use_mesh(mesh):
                return jnp.sum(jnp.square(moe.moe_ffn(x, wg, wu, wo, ids, w).astype(jnp.float32)))

        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(*args).compile()
        out["hlo_mosaic_calls"] = compiled.as_text().count('custom_call_target="mosaic_gpu')
        print(json.dumps(out))
        """
    )
    assert out["a100x1"] == "triton" and out["h100x1"] == "mgpu_ws"
    # swiglu_ws: gate/up with the SwiGLU and down forward; dh with the dSwiGLU, dx, dW of gate/up, dWo backward
    assert out["hlo_mosaic_calls"] == 6


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["mgpu", "mgpu_ws"])
def test_h100_layer_scan_launches_each_kernel_once_and_stores_no_unsorted_copy(impl):
    """Two MoE layers in one lax.scan without remat (the model's stack), forward and backward, compiled for a
    deviceless H100: one layer's kernel calls (mgpu: 9, three grouped matmuls forward, input and weight gradient;
    mgpu_ws: 6, swiglu_ws's two forward and four backward), each launched once (XLA's dynamic-slice fusion would launch a kernel
    a second time where its output is both stored as the scan's residual and read in the body: gmm's optimization
    barrier), and no [N, k, D] array outside a fusion (the combine keeps the sorted rows: no un-sorted copy stored
    per layer); JAX's kernels (mgpu) and cisjax's (mgpu_ws) alike. In a fresh process: the plugin."""
    out = fresh_process_json(
        """
        import json, re
        import jax, jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec as P
        from cisjax import sharding
        from cisjax.models import moe
        from cisjax.plan import hardware

        mesh = sharding.make_mesh({"fsdp": 1}, hardware.target("h100x1").devices())
        n, d, f, e, k, layers = 256, 128, 192, 4, 2, 2
        spec = NamedSharding(mesh, P())
        shapes = [((n, d), jnp.bfloat16), ((layers, e, d, f), jnp.bfloat16), ((layers, e, d, f), jnp.bfloat16),
                  ((layers, e, f, d), jnp.bfloat16), ((layers, n, k), jnp.int32), ((layers, n, k), jnp.bfloat16)]
        args = [jax.ShapeDtypeStruct(s, t, sharding=spec) for s, t in shapes]

        def loss(x, wg, wu, wo, ids, w):
            def body(h, p):
                with sharding.use_mesh(mesh):
                    return moe.moe_ffn(h, *p, impl=IMPL), None

            y, _ = jax.lax.scan(body, x, (wg, wu, wo, ids, w))
            return jnp.sum(jnp.square(y.astype(jnp.float32)))

        hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 5))).lower(*args).compile().as_text()
        fused, comp, stored = set(re.findall(r"calls=%?([\\w.\\-]+)", hlo)), None, []
        for line in hlo.splitlines():
            if line and not line.startswith(" ") and line.rstrip().endswith("{"):
                comp = re.match(r"(?:ENTRY )?%?([\\w.\\-]+)", line)[1]
            elif comp not in fused and (m := re.match(r"\\s*(?:ROOT )?%?[\\w.\\-]+ = (\\(.*?\\)|\\S+) ", line)):
                stored += re.findall(r"\\w+\\[(?:\\d+,)?256,2,128\\]", m[1])
        print(json.dumps({"mosaic_calls": hlo.count('custom_call_target="mosaic_gpu'), "unsorted": stored}))
        """.replace("IMPL", repr(impl))
    )
    assert out["mosaic_calls"] == {"mgpu": 9, "mgpu_ws": 6}[impl]
    assert out["unsorted"] == []


def test_kernel_flops_by_hand():
    # 1,000 rows pad to 1,024; 3 group boundaries add a 128-row tile each: 1,408 rows through gate, up and down
    assert moe_hopper.kernel_flops(1000, 4, 64, 32, backward=False) == 3 * 2 * 1408 * 64 * 32
    assert moe_hopper.kernel_flops(1000, 4, 64, 32, backward=True) == 3 * 3 * 2 * 1408 * 64 * 32
