"""cisjax.engines.jax.programs compiled: the KV cache is written in place, never copied per decode step or rebuilt per
layer, and the prefill attends over the prompt's slots only (XLA's memory analysis of a bucket where the cache
dominates)."""

import flax.nnx as nnx
import jax
import numpy as np
import pytest

from cisjax import sharding
from cisjax.engines.jax import programs
from cisjax.models import hf_io
from tests.support.hf import tiny_hf_config
from tests.support.programs import fresh_process_json, jaxpr_dots


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "deepseek_v2"])  # K and V; MLA's latent, rotary key
def test_the_cache_is_held_once(tiny_hf_dir, family):
    model = hf_io.load(tiny_hf_dir(family), dtype="float32", param_dtype="float32")[0]
    graphdef, params = nnx.split(model)
    b, p, n, new = 8, 64, 4, 1024  # 32 rows x 1,088 slots: the cache outweighs everything else
    compiled = (
        jax.jit(programs.sample_fn(graphdef, n=n, max_new=new, top_n=0))
        .lower(params, *programs.abstract_inputs(b, p, n))
        .compile()
    )
    cache = jax.eval_shape(lambda: model.init_cache(b * n, p + new))
    cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
    temp = compiled.memory_analysis().temp_size_in_bytes
    # the cache once, the prompts' cache before expansion (1/n of it), a layer's attention temporaries; a copy of the
    # cache per step, a stack rebuilt per layer, a prefill attending over every slot, or MLA's decode re-expanding
    # every slot's latent into per-head keys and values (it attends in the latent space: absorbed) passes 1.8x
    assert cache_bytes < temp < 1.8 * cache_bytes, (temp / cache_bytes, temp, cache_bytes)


def test_fp32_sampling_on_a_gpu_is_full_precision(tiny_hf_dir, monkeypatch):
    """The sampler's program traced for a GPU in fp32: every matmul outside the kernels at HIGHEST (no TF32)."""
    monkeypatch.setattr(sharding, "current_platform", lambda: "gpu")
    model = hf_io.load(tiny_hf_dir("qwen2_moe"), dtype="float32", param_dtype="float32")[0]
    graphdef, params = nnx.split(model)
    run = programs.sample_fn(graphdef, n=2, max_new=16, top_n=0)
    dots = list(jaxpr_dots(jax.make_jaxpr(run)(params, *programs.abstract_inputs(2, 16, 2)).jaxpr))
    outside = [eqn.params["precision"] for eqn, inside in dots if not inside]
    assert len(outside) > 5 and any(inside for _, inside in dots)  # the model's matmuls, the Triton kernels'
    assert all(p == (jax.lax.Precision.HIGHEST,) * 2 for p in outside), outside


def test_a_gpu_decode_step_copies_no_layer_of_the_cache_or_the_experts():
    """The sampler's decode compiled for a deviceless H100 (bf16: the Triton decode attention and grouped matmuls; a
    fresh process: XLA's CUDA plugin). Inside its loops nothing copies, slices out or writes back a layer's keys or
    values or a layer's expert weights, nor copies the stacked cache: the kernels read the layer in its stack
    (stacked.LayerOf). Before, every step copied the cache's stacks and each layer's keys, values and expert weights
    (12 of 15.8 ms a step of Qwen1.5-MoE's 4-layer cut on an H200)."""
    out = fresh_process_json(
        """
        import json
        import flax.nnx as nnx, jax
        from jax.sharding import NamedSharding, PartitionSpec as P
        from cisjax import sharding
        from cisjax.models import hf_io
        from cisjax.plan import hardware
        from cisjax.engines.jax import programs
        from tests.support.hf import tiny_hf_config
        from tests.support.programs import loop_moves

        mesh = sharding.make_mesh({"fsdp": 1}, hardware.target("h100x1").devices())
        hf = tiny_hf_config("qwen2_moe", hidden_size=64, num_key_value_heads=4, moe_intermediate_size=64)
        cfg = hf_io.model_config(hf, dtype="bfloat16", param_dtype="bfloat16")
        graphdef, abstract = hf_io.abstract_model(hf, cfg)
        rep = NamedSharding(mesh, P())
        is_var = lambda v: isinstance(v, nnx.Variable)
        params = jax.tree.map(
            lambda v: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=rep)), abstract, is_leaf=is_var
        )
        b, p, n, new = 4, 16, 2, 16
        pre, dec = programs.split_fns(graphdef, n=n, max_new=new, mesh=mesh)
        tokens, valid, rows = programs.abstract_inputs(b, p, n)
        prompts = jax.eval_shape(pre, params, tokens, valid)
        text = jax.jit(dec).lower(params, prompts, rows).compile().as_text()
        moe = nnx.merge(graphdef, abstract).stacks[0].mlp.moe
        print(json.dumps({
            "kernels": sorted(k for k in ("cisjax_decode_attention", "cisjax_gmm") if k in text),
            "cache": [list(c.shape) for c in prompts.cache[0]],
            "experts": [list(w.shape) for w in (moe.wg_ExDxF, moe.wu_ExDxF, moe.wo_ExFxD)],
            "moves": [[name, kind, list(dims)] for name, kind, dims, _ in loop_moves(text)],
        }))
        """
    )
    assert out["kernels"] == ["cisjax_decode_attention", "cisjax_gmm"], out["kernels"]
    layers, rows, heads, slots, width = out["cache"][0]
    assert (layers, rows, heads, slots, width) == (2, 8, 4, 32, 16), out["cache"]
    cache_like = {(rows, heads, slots, width), (layers, rows, heads, slots, width)}  # a layer's, the stack's
    expert_like = {tuple(w[1:]) for w in out["experts"]} | {tuple(w) for w in out["experts"]}
    squeeze = lambda dims: tuple(dims[1:]) if dims[:1] == [1] else tuple(dims)  # noqa: E731  a slice's unit layer axis
    bad = [m for m in out["moves"] if squeeze(m[2]) in cache_like | expert_like]
    assert not bad and out["moves"], bad


def test_per_step_outputs_hold_the_steps_minor_and_split_over_the_batch_shards():
    """The buffers of several values per step (top ids and logprobs, the support, the routing) have the steps as their
    minor axis (a TPU pads a minor axis to 128 lanes: [Q, N, X, k] at k = 4 took 32x its bytes), and every per-sample
    buffer is split over the mesh's batch shards as the samples' rows are (whole on every chip, the routing buffer of
    Qwen1.5-MoE's 1,024 samples was 12 GiB per chip of v5p-16)."""
    x, b, k, v = 3, 16, 4, 50  # MoE layers, prompts, experts per token, vocabulary
    prompts = programs.Prompts(
        cache=[],
        valid_BxP=jax.ShapeDtypeStruct((b, 8), bool),
        logits_BxV=jax.ShapeDtypeStruct((b, v), jax.numpy.float32),
        ids_XxBxK=jax.ShapeDtypeStruct((x, b, k), jax.numpy.int32),
        prompt_ids_XxKxBxP=None,
    )
    q, new, top_n, mask_n = 2 * b, 12, 5, 7
    mesh = sharding.make_mesh({"fsdp": 8})

    def zeroed(prompts):
        with sharding.use_mesh(mesh):
            return programs.outputs(prompts, samples=q, max_new=new, top_n=top_n, mask_n=mask_n)

    out = jax.jit(zeroed)(jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), prompts))
    assert out.top_ids_BxTxN.shape == out.top_logprobs_BxTxN.shape == (q, top_n, new)
    assert out.support_ids_BxSxN.shape == (q, mask_n, new)
    assert out.routing_XxKxBxN.shape == (x, k, q, new)
    for name, buf in out._asdict().items():
        batch_axis = 2 if name == "routing_XxKxBxN" else 0
        shard = buf.sharding.shard_shape(buf.shape)
        assert shard[batch_axis] == q // 8 and shard[:batch_axis] + shard[batch_axis + 1 :] == (
            buf.shape[:batch_axis] + buf.shape[batch_axis + 1 :]
        ), (name, shard)


def test_phase_ends_split_the_steps_in_multiples_of_the_stop_check():
    assert programs.phase_ends(64) == [16, 32, 48, 64]
    assert programs.phase_ends(10) == [4, 6, 8, 10]  # STOP_EVERY = 4 does not divide 10: groups of 2
    assert programs.phase_ends(6, phases=4) == [2, 4, 6]  # a repeated end once
    assert programs.phase_ends(1) == [1]


def test_each_decode_phase_attends_over_the_slots_its_steps_can_have_written(tiny_hf_dir):
    """`whole` in four phases: the attention's scores span P + 4, P + 8, P + 12, P + 16 slots (one phase, or a phase
    reading every slot, would show P + 16 alone), and the samples are those of a one-phase decode."""
    model = hf_io.load(tiny_hf_dir("qwen2"), dtype="float32", param_dtype="float32")[0]
    graphdef, params = nnx.split(model)
    b, p, n, new = 2, 8, 2, 16
    tokens_BxP = jax.random.randint(jax.random.key(0), (b, p), 1, 50)
    valid_BxP = jax.numpy.arange(p)[None] >= jax.numpy.array([[2], [0]])  # left padding of two in the first
    rows = programs.Rows(
        prompt_len_B=jax.numpy.array([6, 6, 8, 8]),
        temperature_B=jax.numpy.ones(4),
        top_k_B=jax.numpy.zeros(4, int),
        top_p_B=jax.numpy.ones(4),
        greedy_B=jax.numpy.zeros(4, bool),
        key_data_Bx2=jax.random.key_data(jax.random.split(jax.random.key(1), 4)),
        max_new_B=jax.numpy.array([16, 16, 11, 3]),
        stop_ids_BxT=jax.numpy.full((4, programs.STOP_SLOTS), -1),
    )

    def run(phases):
        def fn(model, tokens_BxP, valid_BxP, rows):
            prompts = programs.prefill(model, tokens_BxP, valid_BxP, n=n, max_new=new)
            return programs.whole(model, prompts, rows, n=n, max_new=new, phases=phases)

        return programs.traced(graphdef, fn), (params, tokens_BxP, valid_BxP, rows)

    fn, args = run(4)
    widths = {
        eqn.invars[1].aval.shape[-2]  # the keys' slots: "blkgh,bksh->bkgls"'s second operand [B, K, S, H]
        for eqn, _ in jaxpr_dots(jax.make_jaxpr(fn)(*args).jaxpr)
        # a decode step's scores [B, K, G, 1, S] of queries [B, 1, K, G, H] and keys [B, K, S, H]
        if eqn.outvars[0].aval.ndim == 5 and eqn.outvars[0].aval.shape[3] == 1 and eqn.invars[1].aval.ndim == 4
    }
    assert widths == {p + 4, p + 8, p + 12, p + 16}, widths
    four = jax.jit(fn)(*args)
    one = jax.jit(run(1)[0])(*args)
    np.testing.assert_array_equal(four.tokens_BxN, one.tokens_BxN)
    np.testing.assert_array_equal(four.lengths_B, [16, 16, 11, 3])
    np.testing.assert_allclose(four.logprobs_BxN, one.logprobs_BxN, atol=1e-6, rtol=0)


@pytest.mark.parametrize("family, n", [("qwen2_moe", 3), ("qwen3_moe", 3), ("deepseek_v2", 3), ("qwen2_moe", 1)])
def test_a_prefill_straight_into_the_rows_gives_the_copied_rows_samples(tiny_hf_dir, family, n):
    """prefill(n, max_new) (each layer's prompt entries written into its n sample rows as computed) then `whole`
    gives the samples of the prompts' cache copied into the rows (_rows_of): tokens, lengths, logprobs. At n = 1 the
    two caches have as many rows (the prompts'): their slots tell them apart."""
    model = hf_io.load(tiny_hf_dir(family), dtype="float32", param_dtype="float32")[0]
    graphdef, params = nnx.split(model)
    b, p, new = 2, 8, 8
    tokens_BxP = jax.random.randint(jax.random.key(0), (b, p), 1, 50)
    valid_BxP = jax.numpy.arange(p)[None] >= jax.numpy.array([[3], [0]])
    rows = programs.Rows(
        prompt_len_B=jax.numpy.repeat(jax.numpy.array([5, 8]), n),
        temperature_B=jax.numpy.ones(b * n),
        top_k_B=jax.numpy.zeros(b * n, int),
        top_p_B=jax.numpy.ones(b * n),
        greedy_B=jax.numpy.zeros(b * n, bool),
        key_data_Bx2=jax.random.key_data(jax.random.split(jax.random.key(1), b * n)),
        max_new_B=jax.numpy.full(b * n, new),
        stop_ids_BxT=jax.numpy.full((b * n, programs.STOP_SLOTS), -1),
    )

    def run(straight):
        def fn(model, tokens_BxP, valid_BxP, rows):
            extra = dict(n=n, max_new=new) if straight else {}
            prompts = programs.prefill(model, tokens_BxP, valid_BxP, **extra)
            assert jax.tree.leaves(prompts.cache)[0].shape[1] == (b * n if straight else b)
            return programs.whole(model, prompts, rows, n=n, max_new=new)

        return jax.jit(programs.traced(graphdef, fn))(params, tokens_BxP, valid_BxP, rows)

    straight, copied = run(True), run(False)
    np.testing.assert_array_equal(straight.tokens_BxN, copied.tokens_BxN)
    np.testing.assert_array_equal(straight.lengths_B, [new] * (b * n))
    np.testing.assert_allclose(straight.logprobs_BxN, copied.logprobs_BxN, atol=1e-6, rtol=0)
    assert len({tuple(t) for t in np.asarray(straight.tokens_BxN).tolist()}) == b * n  # samples that differ


@pytest.mark.parametrize(
    "family, overrides, straight",
    [
        ("qwen2_moe", {}, True),  # keys and values: 2 kv heads x 8 x 2 = 32 values per token and layer, hidden 32
        ("qwen2_moe", dict(num_key_value_heads=1), False),  # 16 against 32
        ("deepseek_v2", {}, False),  # the latent 16 and the rotary key 8 against 48
    ],
)
def test_the_straight_prefill_where_a_tokens_cache_outweighs_its_hidden_state(family, overrides, straight):
    hf = tiny_hf_config(family, **overrides)
    cfg = hf_io.model_config(hf)
    model = nnx.eval_shape(lambda: hf_io.family_module(hf).build(cfg, nnx.Rngs(0)))
    per_token = sum(np.prod([d for d in s if d is not None]) for s in model.stacks[0].attn.cache_shapes())
    assert (per_token >= cfg.hidden_size) == straight, per_token
    assert programs.prefill_into_rows(model) == straight
