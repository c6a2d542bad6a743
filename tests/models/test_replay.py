"""Routing replay: MoE layers run on forced expert ids (the rollout engine's) with gate weights from the current
router, against the transformers reference forced the same way (tests/support/hf.py hooks its routers)."""

import functools

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cisjax import sharding
from cisjax.models import hf_io, routing
from tests.models.parity import LOGITS_TOL, LOGPROB_TOL
from tests.support.hf import SHARDABLE_QWEN2_MOE, hf_forward, log_softmax

# Per family the routing rules of the HF reference: Qwen2-MoE softmax-gather without renormalisation (and a dense
# middle layer: stacks [0], [1], [2]); Qwen3-MoE renormalised over the k; DeepSeek-V2 group-limited, scaled, a dense
# first layer (stacks [0], [1, 2]).
FAMILIES = {
    "qwen2_moe": dict(num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=False),
    "qwen3_moe": dict(norm_topk_prob=True),
    "deepseek_v2": dict(
        first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.7
    ),
}


def test_replay_weights_by_hand():
    """softmax(log [1, 2, 3, 2]) = [1, 2, 3, 2] / 8; ids (2, 1) -> (3/8, 2/8); renormalised (0.6, 0.4); x2."""
    logits = jnp.log(jnp.asarray([[1.0, 2.0, 3.0, 2.0]]))
    ids = jnp.asarray([[2, 1]], jnp.uint8)
    np.testing.assert_allclose(routing.replay_weights(logits, ids), [[0.375, 0.25]], rtol=1e-6)
    np.testing.assert_allclose(routing.replay_weights(logits, ids, norm_topk_prob=True), [[0.6, 0.4]], rtol=1e-6)
    np.testing.assert_allclose(routing.replay_weights(logits, ids, scaling=2.0), [[0.75, 0.5]], rtol=1e-6)


def _forced_ids(rng, x, b, l, k, e):
    """Distinct random expert ids per (layer, token): [X, B, L, k] uint8."""
    return np.argsort(rng.random((x, b, l, e)), axis=-1)[..., :k].astype(np.uint8)


@jax.jit
def _logits(graphdef, params, tokens_BxL, replay):
    model = nnx.merge(graphdef, params)
    out = model(tokens_BxL, replay_XxBxLxK=replay)
    return model.logits(out.hidden_BxLxD), out.expert_ids_XxBxLxK


@pytest.mark.parametrize("scan", [True, False])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_replay_matches_forced_hf_reference(tiny_hf_dir, family, scan):
    model_dir = tiny_hf_dir(family, **FAMILIES[family])
    model, cfg, _ = hf_io.load(model_dir, scan_layers=scan)
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, cfg.vocab_size, (2, 9), dtype=np.int32)
    forced = _forced_ids(rng, len(model.moe_layers), 2, 9, cfg.num_experts_per_tok, cfg.num_experts)
    graphdef, params = nnx.split(model)
    logits, own = map(np.asarray, _logits(graphdef, params, jnp.asarray(tokens), jnp.asarray(forced)))
    ref_logits, ref_ids = hf_forward(model_dir, tokens, replay_XxBxLxK=forced)
    np.testing.assert_array_equal(ref_ids, np.sort(forced, axis=-1))  # the reference ran the forced ids
    # the forcing matters: most (token, layer) routes differ from the router's own, and so do the logits
    assert (np.sort(own, -1) != np.sort(forced, -1)).any(-1).mean() > 0.5
    free_logits, _ = hf_forward(model_dir, tokens)
    assert np.abs(free_logits - ref_logits).max() > 100 * LOGITS_TOL
    assert np.abs(logits - ref_logits).max() <= LOGITS_TOL
    assert np.abs(log_softmax(logits) - log_softmax(ref_logits)).max() <= LOGPROB_TOL


def _value_and_grads(model, tokens, replay):
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(p):
        m = nnx.merge(graphdef, p)
        logp = jax.nn.log_softmax(m.logits(m(tokens, replay_XxBxLxK=replay).hidden_BxLxD)[:, :-1], axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_replaying_the_routers_own_choice_is_no_replay(tiny_hf_dir, family):
    """Where trainer and engine agree on every route, replay changes nothing: logits and loss are bitwise equal (the
    gathered softmax is the top-k's values), every gradient equal to fp32 rounding (XLA may sum the routing weights'
    gradient in another order in the two programs; a route replayed wrong moves a gradient by its own size)."""
    model, cfg, _ = hf_io.load(tiny_hf_dir(family, **FAMILIES[family]))
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 10)), jnp.int32)
    graphdef, params = nnx.split(model)
    logits, own = _logits(graphdef, params, tokens, None)
    logits_r, own_r = _logits(graphdef, params, tokens, own.astype(jnp.uint8))
    np.testing.assert_array_equal(np.asarray(own_r), np.asarray(own))
    np.testing.assert_array_equal(np.asarray(logits_r), np.asarray(logits))
    value, grads = _value_and_grads(model, tokens, None)
    value_r, grads_r = _value_and_grads(model, tokens, own)
    assert float(value_r) == float(value)
    for (name, g), (_, g_r) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(grads_r)):
        g, g_r = np.asarray(g[...]), np.asarray(g_r[...])
        np.testing.assert_allclose(g_r, g, rtol=1e-5, atol=1e-6 * np.abs(g).max(), err_msg=".".join(map(str, name)))


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2"])
def test_router_learns_under_replay(tiny_hf_dir, family):
    """The forced ids are data, the weights at them a function of the router: its gradient is non-zero."""
    model, cfg, _ = hf_io.load(tiny_hf_dir(family, **FAMILIES[family]))
    rng = np.random.default_rng(4)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 10)), jnp.int32)
    forced = jnp.asarray(_forced_ids(rng, len(model.moe_layers), 2, 10, cfg.num_experts_per_tok, cfg.num_experts))
    _, grads = _value_and_grads(model, tokens, forced)
    for stack in grads["stacks"].values():
        if "moe" in stack["mlp"]:
            g = np.asarray(stack["mlp"]["moe"]["router_DxE"][...])
            assert np.isfinite(g).all() and np.abs(g).max() > 1e-6


@functools.cache
def _replay_reference(model_dir):
    """The tokens, forced ids and swapped ids of test_forced_ids_survive_scan_and_remat, and the unscanned stored
    forward's loss and gradients under the forced ids: once per process (the cases share them)."""
    ref_model, cfg, _ = hf_io.load(model_dir, scan_layers=False)
    rng = np.random.default_rng(5)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 10)), jnp.int32)
    forced = jnp.asarray(_forced_ids(rng, 2, 2, 10, cfg.num_experts_per_tok, cfg.num_experts))
    # layer 2's ids where layer 1's should be: a mix-up of layers inside the scan would show
    swapped = forced[::-1]
    ref_value, ref_grads = _value_and_grads(ref_model, tokens, forced)
    return tokens, forced, swapped, float(ref_value), [(n, np.asarray(r[...])) for n, r in nnx.to_flat_state(ref_grads)]


@pytest.mark.parametrize("remat, scan", [("none", False), ("full", True), ("minimal", True), ("full", False)])
def test_forced_ids_survive_scan_and_remat(tiny_hf_dir, remat, scan):
    """Each scanned layer (and its recompute under remat) gets its own layer's ids: loss and gradients equal the
    unscanned, stored forward's, and differ from no replay."""
    model_dir = tiny_hf_dir("deepseek_v2", **FAMILIES["deepseek_v2"])
    tokens, forced, swapped, ref_value, ref_grads = _replay_reference(model_dir)
    model, _, _ = hf_io.load(model_dir, scan_layers=scan, remat=remat)
    value, grads = _value_and_grads(model, tokens, forced)
    assert float(value) == pytest.approx(ref_value, rel=1e-6)
    assert float(_value_and_grads(model, tokens, swapped)[0]) != pytest.approx(ref_value, rel=1e-4)
    for (name, g), (_, r) in zip(nnx.to_flat_state(grads), ref_grads):
        np.testing.assert_allclose(np.asarray(g[...]), r, rtol=1e-5, atol=1e-6 * np.abs(r).max(), err_msg=str(name))


def test_replay_shape_is_checked(tiny_hf_dir):
    model, cfg, _ = hf_io.load(tiny_hf_dir("qwen3_moe", **FAMILIES["qwen3_moe"]))
    with pytest.raises(Exception, match="replayed routing"):
        model(jnp.zeros((1, 4), jnp.int32), replay_XxBxLxK=jnp.zeros((1, 1, 4, cfg.num_experts_per_tok), jnp.uint8))


@pytest.mark.slow
def test_forced_ids_follow_their_tokens_under_expert_parallelism(tiny_hf_dir):
    """expert=4 x fsdp=2 (tokens exchanged by the all-to-all): the replayed model's logits and gradients equal the
    unsharded replayed model's."""
    path = tiny_hf_dir("qwen2_moe", **SHARDABLE_QWEN2_MOE)
    rng = np.random.default_rng(6)
    tokens_BxL = rng.integers(0, 90, (8, 8)).astype(np.int32)
    forced = _forced_ids(rng, 2, 8, 8, 2, 8)

    def run(mesh=None, rules=None):
        model, _, _ = hf_io.load(path, mesh=mesh, rules=rules)
        graphdef, params = nnx.split(model, nnx.Param)

        def loss(p, tokens, replay):
            m = nnx.merge(graphdef, p)
            logits = m.logits(m(tokens, replay_XxBxLxK=replay).hidden_BxLxD)
            return jnp.mean(jax.nn.logsumexp(logits, -1)), logits

        fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
        if mesh is None:
            return fn(params, tokens_BxL, forced), None
        with sharding.use_mesh(mesh, rules):
            args = (
                params,
                sharding.place(tokens_BxL, mesh, rules),
                sharding.place(forced, mesh, rules, (None, "batch")),
            )
            return fn(*args), fn.lower(*args).as_text()

    ((loss_ref, logits_ref), grads_ref), _ = run()
    mesh, rules = sharding.make_mesh({"expert": 4, "fsdp": 2}), sharding.rules_from_config()
    ((loss, logits), grads), hlo = run(mesh, rules)
    assert "all_to_all" in hlo
    np.testing.assert_allclose(np.asarray(logits), np.asarray(logits_ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(loss), float(loss_ref), rtol=1e-6)
    for (name, g), (_, r) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(grads_ref)):
        np.testing.assert_allclose(np.asarray(g[...]), np.asarray(r[...]), rtol=1e-4, atol=1e-6, err_msg=str(name))
