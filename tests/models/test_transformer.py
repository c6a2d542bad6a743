"""The shared decoder shell: rematerialisation (model.remat) and scanned layers (model.scan_layers) change what is
compiled and stored, not the results."""

import functools
import re

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cisjax import errors
from cisjax.models import hf_io, transformer

REMAT = re.compile(r"\b(?:remat2?|checkpoint)\[")  # jax.checkpoint's primitive in a printed jaxpr


# Two kinds of decoder block in both: DeepSeek-V2 a dense first layer, then MoE layers (stacks [0], [1, 2]); Qwen2-MoE
# a dense middle layer (stacks [0], [1], [2]), attention with biases.
MULTI_STACK = {
    "deepseek_v2": dict(first_k_dense_replace=1),
    "qwen2_moe": dict(num_hidden_layers=3, mlp_only_layers=[1]),
}


def _loss_and_grads(model_dir, remat, scan):
    """value_and_grad of sum(logits * ct) w.r.t. every parameter, and the jaxpr of that function."""
    model, _, _ = hf_io.load(model_dir, remat=remat, scan_layers=scan)
    graphdef, params = nnx.split(model, nnx.Param)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, model.cfg.vocab_size, (2, 12)), jnp.int32)
    ct = jnp.asarray(rng.standard_normal((2, 12, model.cfg.vocab_size)), jnp.float32)

    def loss(p):
        # one row at a time under lax.map, the model merged inside the body, as the loop's rescoring does
        def row(args):
            tokens_1xL, ct_1xLxV = args
            m = nnx.merge(graphdef, p)
            return jnp.sum(m.logits(m(tokens_1xL).hidden_BxLxD) * ct_1xLxV)

        return jnp.sum(jax.lax.map(row, (tokens[:, None], ct[:, None])))

    fn = jax.value_and_grad(loss)
    value, grads = jax.jit(fn)(params)
    return float(value), jax.tree.leaves(grads), str(jax.make_jaxpr(fn)(params))


@functools.cache
def _reference(model_dir):
    """_loss_and_grads of the unscanned model without remat, once per model per process (the cases share it)."""
    return _loss_and_grads(model_dir, "none", False)


# The fast tier (make test-fast) runs qwen2_moe scanned with full remat; CI every case.
@pytest.mark.parametrize(
    "family, remat, scan",
    [
        pytest.param(f, r, s, marks=() if (f, r, s) == ("qwen2_moe", "full", True) else pytest.mark.slow)
        for f in ("deepseek_v2", "qwen2_moe")
        for r in ("none", "minimal", "full")
        for s in (True, False)
        if (r, s) != ("none", False)
    ],
)
def test_remat_and_scan_give_the_same_loss_and_gradients(tiny_hf_dir, family, remat, scan):
    """Against the unscanned model without remat (a Python loop over the layers, everything stored)."""
    model_dir = tiny_hf_dir(family, **MULTI_STACK[family])
    ref_value, ref_grads, ref_jaxpr = _reference(model_dir)
    assert not REMAT.findall(ref_jaxpr)
    value, grads, jaxpr = _loss_and_grads(model_dir, remat, scan)
    layers = hf_io.read_hf_config(model_dir)["num_hidden_layers"]
    if remat != "none":  # a rematerialised block per decoder layer, or per scanned stack
        assert len(REMAT.findall(jaxpr)) >= (1 if scan else layers)
    assert value == pytest.approx(ref_value, rel=1e-6)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6 * np.abs(r).max())


@pytest.mark.parametrize("scan", [True, False])
def test_one_scan_per_stack(tiny_hf_dir, scan):
    """Scanned: the forward's top level is one lax.scan per stack, of the stack's length (the layers inside it);
    unscanned: no top-level loop (the layers inlined one after another)."""
    model, _, _ = hf_io.load(tiny_hf_dir("deepseek_v2", **MULTI_STACK["deepseek_v2"]), scan_layers=scan)
    jaxpr = jax.make_jaxpr(lambda t: model(t).hidden_BxLxD)(jnp.zeros((1, 6), jnp.int32))
    scans = [e.params for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert [p["length"] for p in scans] == ([1, 2] if scan else [])
    # on CPU the scans are unrolled (XLA:CPU runs a rolled one slower); on a TPU/GPU mesh they stay rolled
    assert all(p["unroll"] == p["length"] for p in scans)


def test_scan_stays_rolled_for_tpu(tiny_hf_dir, monkeypatch):
    from cisjax import sharding

    model, _, _ = hf_io.load(tiny_hf_dir("deepseek_v2", **MULTI_STACK["deepseek_v2"]))
    monkeypatch.setattr(sharding, "current_platform", lambda: "tpu")
    jaxpr = jax.make_jaxpr(lambda t: model(t).hidden_BxLxD)(jnp.zeros((1, 6), jnp.int32))
    assert [e.params["unroll"] for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"] == [1, 1]


def test_layer_runs_group_consecutive_layers_of_one_kind():
    """Stacks are maximal runs of same-kind layers, in layer order (hand-written expectations)."""

    class Cfg:
        def __init__(self, n, moe):
            self.num_hidden_layers, self.moe = n, moe

        def is_moe_layer(self, i):
            return i in self.moe

    assert transformer.layer_runs(Cfg(4, {0, 1, 2, 3})) == ((0, 1, 2, 3),)
    assert transformer.layer_runs(Cfg(4, {1, 2, 3})) == ((0,), (1, 2, 3))  # DeepSeek first_k_dense_replace=1
    assert transformer.layer_runs(Cfg(4, {1, 3})) == ((0,), (1,), (2,), (3,))  # decoder_sparse_step=2
    assert transformer.layer_runs(Cfg(5, {0, 1, 3, 4})) == ((0, 1), (2,), (3, 4))  # mlp_only_layers=[2]
    assert transformer.layer_runs(Cfg(3, set())) == ((0, 1, 2),)  # dense


def test_stacked_parameters_and_layer_slices(tiny_hf_dir):
    """Stacked parameters carry a leading "layers" axis; layer(i) is layer i's slice, as loaded from the HF file."""
    model_dir = tiny_hf_dir("deepseek_v2", **MULTI_STACK["deepseek_v2"])
    model, cfg, _ = hf_io.load(model_dir)
    assert [transformer.stack_size(s) for s in model.stacks] == [1, 2]
    wq = model.stacks[1].attn.wkv_a_DxA
    assert wq.get_metadata()["axes"][0] == "layers" and wq.shape[0] == 2
    files = hf_io.SafetensorsDir(model_dir)
    hf_w = np.asarray(files["model.layers.2.self_attn.kv_a_proj_with_mqa.weight"])
    np.testing.assert_array_equal(np.asarray(model.layer(2).attn.wkv_a_DxA[...]), hf_w.T)
    assert model.layer(2).attn.wkv_a_DxA.get_metadata()["axes"][0] != "layers"
    with pytest.raises(IndexError):
        model.layer(cfg.num_hidden_layers)


def test_unknown_remat_policy_is_named(tiny_hf_dir):
    model, _, _ = hf_io.load(tiny_hf_dir("qwen2_moe"), remat="some")
    with pytest.raises(errors.UserError, match="model.remat='some'"):
        model(jnp.zeros((1, 4), jnp.int32))
