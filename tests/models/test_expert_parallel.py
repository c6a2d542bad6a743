"""Expert parallelism: moe_ffn with the expert stacks split over an "expert" mesh axis vs a float64 loop (8 devices)."""

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cisjax import sharding
from cisjax.models import expert_parallel, hf_io, moe
from tests.models.test_moe import _problem, ref_moe
from tests.support.hf import SHARDABLE_QWEN2_MOE

EP_MESHES = {
    "expert8": {"expert": 8},
    "expert4_fsdp2": {"expert": 4, "fsdp": 2},
    "data2_expert2_tensor2": {"data": 2, "expert": 2, "tensor": 2},
}
N, D, F, E, K = 64, 16, 8, 8, 2


def _ids(kind):
    if kind == "ragged":  # ragged groups; experts 5 and 7 get no token
        return [[i % 5, (3 * i + 1) % 5] if i % 9 else [6, 2] for i in range(N)]
    # imbalanced: every token to experts 0 and 1, both on chip 0 where ep is 2 or 4 (its receive buffer full: the
    # dropless worst case), on chips 0 and 1 where ep is 8 (each gets every token, 8x the mean)
    return [[i % 2, 1 - i % 2] for i in range(N)]


def _run_on_mesh(mesh_shape, impl, ids_kind, exchange="auto", seed=3, monkeypatch=None, rules=None):
    x, wg, wu, wo, ids, w, ct = _problem(N, D, F, E, _ids(ids_kind), seed=seed)
    mesh, rules = sharding.make_mesh(mesh_shape), sharding.rules_from_config(rules)
    if monkeypatch is not None:
        monkeypatch.setattr(expert_parallel, "EXCHANGE", exchange)

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
    assert args[1].sharding.spec[0] == "expert"  # the stacks really are split over E

    def loss(x, wg, wu, wo, w, ids, ct):
        with sharding.use_mesh(mesh, rules):
            y = moe.moe_ffn(x, wg, wu, wo, ids, w, impl=impl)
        return jnp.sum(y * ct), y

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))
    (_, y), grads = fn(*args)
    hlo = fn.lower(*args).as_text()
    return (x, wg, wu, wo, ids, w, ct), y, grads, hlo


def _check(problem, y, grads, where):
    x, wg, wu, wo, ids, w, ct = problem
    y_ref, grads_ref = ref_moe(x, wg, wu, wo, ids, w, ct)
    np.testing.assert_allclose(np.asarray(y), y_ref, rtol=2e-5, atol=2e-5, err_msg=where)
    for gname, g, g_ref in zip(("x", "wg", "wu", "wo", "w"), grads, grads_ref):
        np.testing.assert_allclose(np.asarray(g), g_ref, rtol=2e-5, atol=2e-5, err_msg=f"{where} d{gname}")


# Every mesh with every routing and every exchange (the exchange's own logic: send counts, receive buffers, the
# dropless worst case), and the kernel that runs on each shard's groups in turn, so that every pair of settings
# (mesh and kernel, kernel and routing, kernel and exchange) is covered: 12 cases, not the 36 of the whole product
# (the kernel sees only its shard's groups, whatever exchange brought them; tests/models/test_moe.py checks each
# kernel on the same routings without the exchange).
KERNELS = ("tiled", "gmm", "ragged")
CASES = [
    (mesh, KERNELS[(k + m) % len(KERNELS)], ("ragged", "imbalanced")[k // 2], ("a2a", "gather")[k % 2])
    for m, mesh in enumerate(EP_MESHES)
    for k in range(4)
] + [  # the GPU kernels (Pallas's interpreter here: slow), both exchanges
    ("expert4_fsdp2", "triton", "imbalanced", "a2a"),
    ("data2_expert2_tensor2", "triton", "ragged", "gather"),
]
FAST = {("expert4_fsdp2", "tiled", "imbalanced", "a2a"), ("data2_expert2_tensor2", "tiled", "ragged", "gather")}


@pytest.mark.parametrize(
    "mesh_name, impl, ids_kind, exchange",
    [pytest.param(*c, marks=() if c in FAST else pytest.mark.slow) for c in CASES],
)
def test_expert_parallel_matches_float64_loop(mesh_name, impl, ids_kind, exchange, monkeypatch):
    """Values and every gradient (x, each expert stack, the routing weights) as the float64 loop, with ragged groups
    and empty experts, and with every token sent to one shard's experts (nothing may be dropped)."""
    problem, y, grads, hlo = _run_on_mesh(EP_MESHES[mesh_name], impl, ids_kind, exchange, monkeypatch=monkeypatch)
    _check(problem, y, grads, f"{mesh_name} {impl} {ids_kind} {exchange}")
    # the exchange really ran: tokens between the expert shards (CPU: the all_to_all form of the ragged one)
    assert ("all_to_all" if exchange == "a2a" else "all_gather") in hlo


def test_expert_parallel_with_rows_replicated_over_the_expert_axis(monkeypatch):
    """Rules that split the batch over fsdp only: every chip of an expert group holds the same tokens, runs its own
    experts' assignments, and the outputs are summed over the expert axis (no exchange of tokens)."""
    problem, y, grads, hlo = _run_on_mesh(
        EP_MESHES["expert4_fsdp2"], "tiled", "imbalanced", "a2a", monkeypatch=monkeypatch, rules={"batch": "fsdp"}
    )
    _check(problem, y, grads, "rows replicated over expert")
    assert "all_to_all" not in hlo and "all_gather" not in hlo and "all_reduce" in hlo


def test_expert_parallel_auto_exchange_rule():
    mesh, rules = sharding.make_mesh({"expert": 8}), sharding.rules_from_config()
    with sharding.use_mesh(mesh, rules):
        assert expert_parallel.plan((8, 16, 8), 2)["exchange"] == "a2a"  # ep 8 > k 2
        assert expert_parallel.plan((8, 16, 8), 8)["exchange"] == "gather"
        assert expert_parallel.plan((6, 16, 8), 2) is None  # 6 experts do not split 8 ways: unchanged
    with sharding.use_mesh(mesh, sharding.rules_from_config({"expert": None})):
        assert expert_parallel.plan((8, 16, 8), 2) is None
    assert expert_parallel.plan((8, 16, 8), 2) is None  # no mesh
    with sharding.use_mesh(sharding.make_mesh({"fsdp": 8}), rules):
        assert expert_parallel.plan((8, 16, 8), 2) is None  # expert axis of size 1


def test_cpu_ragged_all_to_all_semantics():
    """The CPU stand-in for jax.lax.ragged_all_to_all, on the example of its docstring (axis of size 2)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    P = jax.sharding.PartitionSpec

    def f(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
        return expert_parallel.ragged_all_to_all(
            operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, "x"
        )

    # the docstring's example, the two devices' arguments concatenated
    operand = np.array([1, 2, 2, 3, 4, 0], np.float32)
    output = np.zeros(8, np.float32)
    input_offsets = np.array([0, 1, 0, 1], np.int32)
    send_sizes = np.array([1, 2, 1, 1], np.int32)
    output_offsets = np.array([0, 0, 1, 2], np.int32)
    recv_sizes = np.array([1, 1, 2, 1], np.int32)
    out = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("x"),) * 6, out_specs=P("x")))(
        operand, output, input_offsets, send_sizes, output_offsets, recv_sizes
    )
    np.testing.assert_array_equal(np.asarray(out), [1, 3, 0, 0, 2, 2, 4, 0])


# ----------------------------------------------------------------------------- a model on an expert-parallel mesh


def _loss_fn(graphdef, rest):
    def loss(params, tokens_BxL):
        model = nnx.merge(graphdef, params, rest)
        logits_BxLxV = model.logits(model(tokens_BxL).hidden_BxLxD).astype(jnp.float32)
        logp_BxLxV = jax.nn.log_softmax(logits_BxLxV[:, :-1], axis=-1)
        nll = -jnp.take_along_axis(logp_BxLxV, tokens_BxL[:, 1:, None], axis=-1)
        return jnp.mean(nll), logits_BxLxV

    return jax.jit(jax.value_and_grad(loss, has_aux=True))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_model_on_expert_parallel_mesh_matches_unsharded(family, tiny_hf_dir):
    """A tiny Qwen2-MoE / Qwen3-MoE on expert=4 x fsdp=2 (each chip 2 of the 8 experts, tokens exchanged by the ragged
    all-to-all): the unsharded model's logits, loss and parameter gradients."""
    path = tiny_hf_dir("qwen2_moe", **SHARDABLE_QWEN2_MOE) if family == "qwen2_moe" else tiny_hf_dir(family)
    tokens_BxL = np.random.default_rng(0).integers(0, 90, (8, 8)).astype(np.int32)

    model, _, _ = hf_io.load(path)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    (loss_ref, logits_ref), grads_ref = _loss_fn(graphdef, rest)(params, tokens_BxL)

    mesh, rules = sharding.make_mesh({"expert": 4, "fsdp": 2}), sharding.rules_from_config()
    model, _, _ = hf_io.load(path, mesh=mesh, rules=rules)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    wg = params["stacks"][0]["mlp"]["moe"]["wg_ExDxF"][...]  # [layers, E, D, F]: E split 4 ways
    assert wg.sharding.spec[1] == "expert" and wg.addressable_shards[0].data.shape[1] == 2
    with sharding.use_mesh(mesh, rules):
        fn = _loss_fn(graphdef, rest)
        tokens = sharding.place(tokens_BxL, mesh, rules)
        (loss, logits), grads = fn(params, tokens)
        hlo = fn.lower(params, tokens).as_text()
    assert "all_to_all" in hlo  # the exchange of EP (the CPU form of the ragged all-to-all)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(logits_ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(loss), float(loss_ref), rtol=1e-6)
    flat, flat_ref = nnx.to_flat_state(grads), dict(nnx.to_flat_state(grads_ref))
    for name, g in flat:
        np.testing.assert_allclose(
            np.asarray(g[...]), np.asarray(flat_ref[name][...]), rtol=1e-4, atol=1e-6, err_msg=".".join(map(str, name))
        )


def test_the_cases_cover_every_pair_of_settings():
    """The 12 cases of test_expert_parallel_matches_float64_loop: every (mesh, routing, exchange) and every pair with
    the kernel."""
    grid = [c for c in CASES if c[1] in KERNELS]
    assert len({(m, i, e) for m, _, i, e in grid}) == len(EP_MESHES) * 2 * 2
    levels = [set(EP_MESHES), set(KERNELS), {"ragged", "imbalanced"}, {"a2a", "gather"}]
    for a, b in [(0, 1), (1, 2), (1, 3)]:
        assert {(c[a], c[b]) for c in grid} == {(x, y) for x in levels[a] for y in levels[b]}, (a, b)
    assert FAST <= set(CASES)
