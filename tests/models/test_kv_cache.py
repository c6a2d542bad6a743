"""CausalLM.cached: a prefill of left-padded prompts then one token at a time through a KV cache gives the full
forward's logits and routing at every position, for every family (GQA and MLA caches)."""

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cisjax.models import hf_io, transformer
from cisjax.models.attention import cache_mask
from cisjax.models.transformer import layer_runs
from tests.models import parity
from tests.support.hf import TINY_FAMILIES, tiny_hf_config


def test_cache_mask_by_hand():
    valid_BxS = jnp.array([[0, 1, 1, 1, 0], [1, 1, 1, 1, 0]], bool)  # row 0: one slot of left padding
    m = np.asarray(cache_mask(valid_BxS, 2, 2))  # the tokens at slots 2 and 3
    assert m.shape == (2, 2, 5)
    np.testing.assert_array_equal(m[0], [[0, 1, 1, 0, 0], [0, 1, 1, 1, 0]])
    np.testing.assert_array_equal(m[1], [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])


@nnx.jit
def _cached(model, tokens_BxL, positions_BxL, cache, index, valid_BxS):
    out, cache = model.cached(tokens_BxL, positions_BxL, cache, index, valid_BxS)
    ids = out.expert_ids_XxBxLxK
    return model.logits(out.hidden_BxLxD), (None if ids is None else jnp.sort(ids, axis=-1)), cache


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_prefill_then_decode_equals_the_full_forward(family):
    hf = tiny_hf_config(family)
    cfg = hf_io.model_config(hf)
    model = hf_io.family_module(hf).build(cfg, nnx.Rngs(0))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 97, 6).tolist(), rng.integers(0, 97, 3).tolist()]  # padded to 6 on the left
    forced = rng.integers(0, 97, (2, 4))  # the tokens fed back one at a time
    p, steps = 6, forced.shape[1]
    slots = p + steps
    tokens_BxP = np.zeros((2, p), np.int32)
    valid_BxS = np.zeros((2, slots), bool)
    for r, prompt in enumerate(prompts):
        tokens_BxP[r, p - len(prompt) :] = prompt
        valid_BxS[r, p - len(prompt) : p] = True
    positions_BxP = np.maximum(np.cumsum(valid_BxS[:, :p], axis=1) - 1, 0)

    cache = model.init_cache(2, slots)
    # per stack: [layers, rows, ...] per kept array, its slots on its slot axis (GQA's heads before them)
    for entries, run, axes in zip(cache, layer_runs(cfg), model.cache_slot_axes()):
        assert [(a.shape[:2], a.shape[ax]) for a, ax in zip(entries, axes)] == [((len(run), 2), slots)] * len(entries)
        assert axes == ((2, 2) if family == "deepseek_v2" else (3, 3))
    logits, ids, cache = _cached(model, jnp.asarray(tokens_BxP), jnp.asarray(positions_BxP), cache, 0, valid_BxS)
    got = [[logits[r, -1]] for r in range(2)]  # per row: the logits that predict each next token
    got_ids = [[None if ids is None else ids[:, r, p - len(prompts[r]) :]] for r in range(2)]
    for t in range(steps):
        valid_BxS[:, p + t] = True
        positions_Bx1 = np.array([[len(prompts[0]) + t], [len(prompts[1]) + t]])
        logits, ids, cache = _cached(
            model, jnp.asarray(forced[:, t : t + 1], jnp.int32), jnp.asarray(positions_Bx1), cache, p + t, valid_BxS
        )
        for r in range(2):
            got[r].append(logits[r, 0])
            got_ids[r].append(None if ids is None else ids[:, r])

    for r, prompt in enumerate(prompts):
        seq = np.array([prompt + forced[r].tolist()])
        ref_logits, ref_ids = parity.run(model, seq)
        want = ref_logits[0, len(prompt) - 1 :]  # the logits after the prompt and after each fed-back token
        np.testing.assert_allclose(np.stack(got[r]), want, atol=parity.LOGITS_TOL, rtol=0, err_msg=f"row {r}")
        if ref_ids is None:
            assert got_ids[r][0] is None
        else:
            parity.assert_same_routing(np.concatenate(got_ids[r], axis=1)[:, None], ref_ids, f"row {r}")


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v2"])
@pytest.mark.parametrize("index", [0, 5])  # a prefill's static slot, a decode step's traced one
def test_the_two_forms_of_a_cached_stack_agree(family, index):
    """run_stack_cached's scanned slices (TPU, GPU) and its carried cache (CPU): the same outputs and cache, bitwise."""
    hf = tiny_hf_config(family)
    cfg = hf_io.model_config(hf)
    model = hf_io.family_module(hf).build(cfg, nnx.Rngs(0))
    rng = np.random.default_rng(2)
    b, l, slots = 2, 3 if index == 0 else 1, 9
    x_BxLxD = jnp.asarray(rng.normal(size=(b, l, cfg.hidden_size)), jnp.float32)
    positions_BxL = jnp.broadcast_to(index + jnp.arange(l), (b, l))
    cache = [tuple(jnp.asarray(rng.normal(size=a.shape), a.dtype) for a in e) for e in model.init_cache(b, slots)]
    valid_BxS = jnp.arange(slots)[None].repeat(b, 0) < index + l
    seen = index + l if index == 0 else slots
    mask_BxLxS = cache_mask(valid_BxS[:, :seen], index if index == 0 else jnp.int32(index), l)
    outs = [
        transformer.run_stack_cached(model.stacks[0], x_BxLxD, positions_BxL, cache[0], index, mask_BxLxS, carried=c)
        for c in (False, True)
    ]
    for a, c in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


def test_a_gpu_decode_reads_each_layers_cache_and_experts_in_the_stacks(monkeypatch):
    """A decode step traced for a GPU (the Pallas interpreter on the CPU): run_stack_cached carries the stack's cache,
    and the decode attention and the Triton grouped matmuls take the stacked cache and expert weights with the layer
    index (stacked.LayerOf), no layer sliced out of them; the same outputs and cache as the scanned slices."""
    from cisjax import sharding
    from cisjax.models import gpu_decode, moe, stacked
    from tests.support.programs import jaxpr_eqns

    hf = tiny_hf_config("qwen2_moe", moe_intermediate_size=32)  # multiples of 16: the grouped matmuls pad nothing
    cfg = hf_io.model_config(hf, attention_impl="triton", moe_impl="triton")
    model = hf_io.family_module(hf).build(cfg, nnx.Rngs(0))
    rng = np.random.default_rng(3)
    b, slots, index = 2, 16, 5
    x_BxLxD = jnp.asarray(rng.normal(size=(b, 1, cfg.hidden_size)), jnp.float32)
    positions_BxL = jnp.full((b, 1), index)
    cache = [tuple(jnp.asarray(rng.normal(size=a.shape), a.dtype) for a in e) for e in model.init_cache(b, slots)]
    valid_BxS = jnp.arange(slots)[None].repeat(b, 0) < index + 1
    mask_BxLxS = cache_mask(valid_BxS, jnp.int32(index), 1)
    run = lambda carried: transformer.run_stack_cached(  # noqa: E731
        model.stacks[0], x_BxLxD, positions_BxL, cache[0], jnp.int32(index), mask_BxLxS, carried=carried
    )
    monkeypatch.setattr(sharding, "current_platform", lambda: "gpu")
    for module, name in ((gpu_decode, "attend"), (moe, "triton_swiglu")):  # the kernels in the interpreter
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, interpret, _k=kernel, **kw: _k(*a, interpret=True, **kw))
    got = run(None)
    kernels = [
        eqn for eqn, _ in jaxpr_eqns(jax.make_jaxpr(lambda: run(None))().jaxpr) if eqn.primitive.name == "pallas_call"
    ]
    n = transformer.stack_size(model.stacks[0])
    stack_shapes = {a.shape for a in cache[0]} | {model.stacks[0].mlp.moe.wg_ExDxF.shape}
    names = [str(eqn.params.get("name_and_src_info", eqn.params.get("name"))).split()[0] for eqn in kernels]
    assert sorted(set(names)) == ["cisjax_decode_attention", "cisjax_gmm"], names
    for eqn in kernels:  # the keys and values, or the expert weights: whole stacks of n layers
        assert {v.aval.shape for v in eqn.invars} & stack_shapes, [v.aval.shape for v in eqn.invars]
    sliced = [
        eqn
        for eqn, _ in jaxpr_eqns(jax.make_jaxpr(lambda: run(None))().jaxpr)
        if eqn.primitive.name == "dynamic_slice" and eqn.invars[0].aval.shape in stack_shapes
    ]
    assert not sliced and n == 2
    want = run(False)  # the scanned slices: each layer's cache and experts sliced out for the kernels
    for a, c in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(c), np.asarray(a), atol=1e-5, rtol=0)
    assert isinstance(stacked.LayerOf(cache[0][0], 1)[...], jax.Array)
