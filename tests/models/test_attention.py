"""Attention cores: the einsum against hand-computed values, the flash kernels (Pallas interpreter) against the einsum."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cisjax import errors, sharding
from cisjax.models import attention, hf_io
from cisjax.models.attention import Segments

KERNELS = ("splash", "triton")


def test_einsum_by_hand():
    # one head, width 1: q = k = 1 everywhere, so every visible key scores the same and the output is the mean of
    # the values a token sees. Row: segment 1 (tokens 0-2), segment 2 (token 3), padding (token 4).
    q = jnp.ones((1, 5, 1, 1))
    v = jnp.array([1.0, 2.0, 6.0, 10.0, 7.0]).reshape(1, 5, 1, 1)
    ids = jnp.array([[1, 1, 1, 2, 0]])
    out = attention.attention(q, q, v, Segments(ids), 1.0, "einsum")
    np.testing.assert_allclose(out[0, :, 0, 0], [1.0, 1.5, 3.0, 10.0, 7.0], rtol=1e-6)
    # two keys scored log 3 apart: the softmax weighs them 1/4 and 3/4
    q2 = jnp.ones((1, 2, 1, 1))
    k2 = jnp.array([0.0, math.log(3.0)]).reshape(1, 2, 1, 1)
    v2 = jnp.array([4.0, 8.0]).reshape(1, 2, 1, 1)
    out2 = attention.attention(q2, k2, v2, Segments(jnp.ones((1, 2), jnp.int32)), 1.0, "einsum")
    np.testing.assert_allclose(out2[0, :, 0, 0], [4.0, 0.25 * 4.0 + 0.75 * 8.0], rtol=1e-6)


def test_grouped_heads_by_hand():
    # 2 query heads share 1 kv head; the first token sees itself alone: its output is its own value in both heads
    q = jnp.array([[[[1.0], [2.0]], [[3.0], [4.0]]]])  # [1, 2, 2, 1]
    k = jnp.zeros((1, 2, 1, 1))  # equal scores
    v = jnp.array([[[[5.0]], [[9.0]]]])  # [1, 2, 1, 1]
    out = attention.attention(q, k, v, Segments(jnp.ones((1, 2), jnp.int32)), 1.0, "einsum")
    np.testing.assert_allclose(out[0, :, :, 0], [[5.0, 5.0], [7.0, 7.0]], rtol=1e-6)


def _problem(seed, b=2, l=200, n=4, kv=2, h=32, v=32, dtype=jnp.float32):
    """Random q, k, v and a batch of packed rows: several segments, padding between and at the end."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, l, n, h)), dtype)
    k = jnp.asarray(rng.normal(size=(b, l, kv, h)), dtype)
    vv = jnp.asarray(rng.normal(size=(b, l, kv, v)), dtype)
    ids = np.ones((b, l), np.int32)
    ids[0, l // 3 :] = 2
    ids[0, l // 2 : l // 2 + 5] = 0
    ids[0, l // 2 + 5 :] = 3
    ids[-1, l - l // 4 :] = 0
    return q, k, vv, jnp.asarray(ids)


def _value_and_grads(impl, q, k, v, ids, scale):
    def loss(q, k, v):
        out = attention.attention(q, k, v, Segments(ids), scale, impl)
        return jnp.sum(jnp.sin(out.astype(jnp.float32))), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, grads


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize(
    "shape",
    [
        dict(n=4, kv=2, h=32, v=32),  # grouped query heads, a length no block divides
        dict(n=2, kv=2, h=24, v=16, l=130),  # MLA-like: value heads narrower than query heads
        # DeepSeek's widths (q.k 192, values 128): triton's head pads to 256 and takes its 64-row blocks
        dict(b=1, n=1, kv=1, h=192, v=128, l=130),
    ],
    ids=["gqa", "mla", "mla_wide"],
)
def test_kernel_matches_einsum_fp32(impl, shape):
    q, k, v, ids = _problem(0, **shape)
    scale = shape["h"] ** -0.5
    out, grads = _value_and_grads(impl, q, k, v, ids, scale)
    ref, ref_grads = _value_and_grads("einsum", q, k, v, ids, scale)
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, atol=5e-5, rtol=5e-5)


@pytest.mark.parametrize("impl", KERNELS)
def test_kernel_matches_einsum_bf16(impl):
    q, k, v, ids = _problem(1, l=136, dtype=jnp.bfloat16)
    out, grads = _value_and_grads(impl, q, k, v, ids, 32**-0.5)
    ref, ref_grads = _value_and_grads("einsum", q, k, v, ids, 32**-0.5)
    exact, exact_grads = _value_and_grads("einsum", *(a.astype(jnp.float32) for a in (q, k, v)), ids, 32**-0.5)
    # within the bf16 bound the einsum itself keeps against float32 (3x its own error, plus a bf16 ulp)
    bound = 3 * float(jnp.max(jnp.abs(ref.astype(jnp.float32) - exact))) + 2**-8
    assert float(jnp.max(jnp.abs(out.astype(jnp.float32) - exact))) <= bound
    for g, r, e in zip(grads, ref_grads, exact_grads):
        g_bound = 3 * float(jnp.max(jnp.abs(r.astype(jnp.float32) - e))) + 2**-8 * float(jnp.max(jnp.abs(e)))
        assert float(jnp.max(jnp.abs(g.astype(jnp.float32) - e))) <= g_bound


@pytest.mark.parametrize("impl", KERNELS)
def test_padding_never_leaks_into_real_tokens(impl):
    # what sits in padded positions (segment 0) must not change any real token's output
    q, k, v, ids = _problem(2, b=1, l=150)
    pad = ids == 0
    k2, v2 = (jnp.where(pad[..., None, None], 100.0, a) for a in (k, v))
    a = attention.attention(q, k, v, Segments(ids), 0.2, impl)
    b = attention.attention(q, k2, v2, Segments(ids), 0.2, impl)
    real = np.asarray(~pad[0])
    np.testing.assert_allclose(a[0][real], b[0][real], atol=1e-6)
    assert not np.allclose(a[0][~real], b[0][~real])  # the check can see a change: padding does move padding


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("mesh_shape", [{"fsdp": 2, "tensor": 4}, {"data": 2, "tensor": 2, "fsdp": 2}])
def test_kernel_on_a_mesh_matches_one_device(impl, mesh_shape):
    # tensor=4 splits the 4 query heads but not the 2 kv heads (they repeat); tensor=2 splits both
    q, k, v, ids = _problem(3, b=4, l=64)
    ref, ref_grads = _value_and_grads("einsum", q, k, v, ids, 0.3)
    mesh, rules = sharding.make_mesh(mesh_shape), sharding.rules_from_config()
    with sharding.use_mesh(mesh, rules):
        out, grads = jax.jit(lambda q, k, v: _value_and_grads(impl, q, k, v, ids, 0.3))(q, k, v)
    np.testing.assert_allclose(out, ref, atol=2e-5)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, atol=5e-5)


def test_cache_masks_take_the_einsum():
    # a KV-cache pass (a [B, L, S] bool mask) runs the einsum whatever the impl: the kernels are causal over one sequence
    q, k, v, _ = _problem(4, b=1, l=8)
    mask = attention.cache_mask(jnp.ones((1, 8), bool), 0, 8)
    ref = attention.einsum_attention(q, k, v, mask, 0.5)
    for impl in attention.IMPLS:
        np.testing.assert_array_equal(attention.attention(q, k, v, mask, 0.5, impl), ref)


def test_auto_follows_the_platform_and_dtype():
    assert attention.default_impl("tpu", jnp.bfloat16) == "splash"
    assert attention.default_impl("tpu", jnp.float32) == "splash"
    assert attention.default_impl("gpu", jnp.bfloat16) == "triton"
    assert attention.default_impl("cuda", jnp.float16) == "triton"
    assert attention.default_impl("gpu", jnp.float32) == "einsum"  # fp32 means fp32: no TF32 kernel
    assert attention.default_impl("cpu", jnp.bfloat16) == "einsum"
    with pytest.raises(errors.UserError, match="attention_impl"):
        attention.attention(*_problem(0, b=1, l=4)[:3], Segments(jnp.ones((1, 4), jnp.int32)), 1.0, "flash")


def test_kernel_flops_by_hand():
    # splash at 1024 tokens: two 512-blocks per side, three on or below the diagonal; widths pad to 128 lanes
    pairs = 3 * 512 * 512
    assert attention.kernel_flops("splash", 2, 1024, 4, 64, 64, backward=False) == 2 * 4 * 2 * pairs * (128 + 128)
    both = attention.kernel_flops("splash", 1, 1024, 1, 128, 128, backward=True)
    assert both == 2 * pairs * 256 + 2 * pairs * ((2 * 128 + 2 * 128) + (2 * 128 + 128))
    # triton at 256 tokens, width 192 -> 256: forward blocks of 64 (a wide head's: 10 of 16 computed), backward blocks
    # of 32 (36 of 64); width 64: forward blocks of 128 (3 of 4)
    fwd = 2 * 10 * 64 * 64 * (256 + 256)
    bwd = 2 * 36 * 32 * 32 * (4 * 256 + 3 * 256)
    assert attention.kernel_flops("triton", 1, 256, 1, 192, 128, backward=True) == fwd + bwd
    assert attention.kernel_flops("triton", 1, 256, 1, 64, 64, backward=False) == 2 * 3 * 128 * 128 * (64 + 64)
    assert attention.triton_block(128) == 128 and attention.triton_block(129) == attention.triton_block(192) == 64
    assert attention.kernel_flops("einsum", 1, 256, 1, 64, 64, backward=True) == 0.0
    # long sequences approach the causal half: 32k tokens in 512-blocks compute 1.6% more than the exact triangle
    ratio = attention.kernel_flops("splash", 1, 32768, 1, 128, 128, backward=False) / (32768**2 * 256)
    assert 1.0 < ratio < 1.02


@pytest.mark.parametrize("impl", KERNELS)
def test_model_forward_matches_einsum(impl, tiny_hf_dir):
    # a whole model (scanned layers, packed rows) with the kernel in every layer equals the einsum model
    model_dir = tiny_hf_dir("qwen2_moe")
    out = {}
    for name in ("einsum", impl):
        model, cfg, _ = hf_io.load(model_dir, attention_impl=name)
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 20)), jnp.int32)
        ids = jnp.asarray([[1] * 12 + [2] * 8, [1] * 15 + [0] * 5])
        positions = jnp.asarray([list(range(12)) + list(range(8)), list(range(15)) + [0] * 5])
        out[name] = model(tokens, positions, ids).hidden_BxLxD
    np.testing.assert_allclose(out[impl], out["einsum"], atol=2e-5)


def test_a_cache_mask_with_each_rows_own_slot():
    """Decode rows at different steps (index [B]): row 0 writes slot 1, row 1 slot 3; each sees its valid slots up to
    its own (row 1's slot 0 is a prompt pad)."""
    valid = jnp.array([[1, 1, 0, 0, 0], [0, 1, 1, 1, 0]], bool)
    got = attention.cache_mask(valid, jnp.array([1, 3]), 1)
    np.testing.assert_array_equal(got, [[[1, 1, 0, 0, 0]], [[0, 1, 1, 1, 0]]])
    got = attention.cache_mask(jnp.ones((2, 5), bool), jnp.array([0, 2]), 1)
    np.testing.assert_array_equal(got, [[[1, 0, 0, 0, 0]], [[1, 1, 1, 0, 0]]])
