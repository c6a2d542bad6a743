"""cisjax.models.decode_attention: JAX's Pallas Triton decode kernel and cisjax's TPU one (in Pallas's interpreters
on the CPU) against the einsum over the cache, reading each row's written slots only, under a mesh, compiled for an
H100 (for a v5p: tests/plan/test_hardware.py; the JAX sampler through them: tests/engines/jax/test_engine.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cisjax import sharding
from cisjax.models import decode_attention
from cisjax.models.attention import cache_attention
from tests.support.programs import fresh_process_json

KERNELS = ["triton", "splash"]  # the impls that ask for each kernel: the GPU's, the TPU's


def _inputs(b, n, kv, h, s, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, 1, n, h)), dtype)
    k, v = (jnp.asarray(rng.normal(size=(b, kv, s, h)), dtype) for _ in range(2))
    return q, k, v


def _mask(start, end, s):
    start, end = np.asarray(start)[:, None], np.asarray(end)[:, None]
    return jnp.asarray((np.arange(s)[None] >= start) & (np.arange(s)[None] < end))[:, None]


def test_split_of_by_hand():
    assert decode_attention.split_of(96) == 16  # 96 = 3 x 32: parts of 16 (96 / 16 = 6 slots aimed at: 16 at least)
    assert decode_attention.split_of(4096) == 256  # 16 parts
    assert decode_attention.split_of(1088) == 64  # 64 + 1,024: 17 parts of the largest power of two dividing it
    assert decode_attention.split_of(48) == 16
    assert decode_attention.split_of(20) is None  # no power of two of 16 or more divides it: the einsum


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("dtype, atol", [(jnp.float32, 1e-6), (jnp.bfloat16, 3e-2)])
@pytest.mark.parametrize("n, kv", [(4, 2), (2, 2)])
def test_kernel_equals_the_einsum(impl, dtype, atol, n, kv):
    """Rows whose intervals start at 0, mid-part and at a part's edge, end at the last slot, inside a part and one
    slot after their start."""
    b, h, s = 4, 16, 96
    q, k, v = _inputs(b, n, kv, h, s, dtype)
    start, end = [0, 10, 32, 50], [96, 40, 33, 51]
    mask = _mask(start, end, s)
    got = decode_attention.attend(q, k, v, mask, 0.25, impl)
    want = cache_attention(*(a.astype(jnp.float32) for a in (q, k, v)), mask, 0.25)
    assert got.dtype == dtype and got.shape == (b, 1, n, h)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=atol, rtol=0)


@pytest.mark.parametrize("impl, part", [("triton", 16), ("splash", 32)])
def test_parts_past_a_rows_last_slot_are_never_read(impl, part):
    """NaN in every part (Triton's parts of 16, the TPU kernel's blocks of 32 at 96 slots) past each row's interval:
    the kernel's output is that of clean inputs (the einsum reads every slot: NaN). Row 0 ends in its second part,
    row 1 in its first."""
    q, k, v = _inputs(2, 4, 2, 16, 96)
    mask = _mask([3, 0], [2 * part - 12, 9], 96)
    dirty_k = k.at[0, :, 2 * part :].set(jnp.nan).at[1, :, part:].set(jnp.nan)
    dirty_v = v.at[0, :, 2 * part :].set(jnp.nan).at[1, :, part:].set(jnp.nan)
    got = decode_attention.attend(q, dirty_k, dirty_v, mask, 0.25, impl)
    np.testing.assert_allclose(got, cache_attention(q, k, v, mask, 0.25), atol=1e-6, rtol=0)
    assert np.isnan(np.asarray(cache_attention(q, dirty_k, dirty_v, mask, 0.25))).all()


@pytest.mark.parametrize("impl", [*KERNELS, "auto"])  # "auto" on the CPU: the einsum
def test_a_layer_of_a_stacked_cache(impl):
    """Keys and values as stacked.LayerOf (a GPU decode's: a layer of the stack's cache [n, B, K, S, H]): the same as
    the layer sliced out. The Triton kernel takes the whole stack and the layer (read in place); the others slice."""
    from cisjax.models import stacked
    from tests.support.programs import jaxpr_eqns

    q, k, v = _inputs(4, 4, 2, 16, 96, seed=1)
    k_stack, v_stack = (jnp.stack([a * (i + 1) for i in range(3)]) for a in (k, v))
    mask = _mask([0, 10, 32, 50], [96, 40, 33, 51], 96)
    layer = jnp.int32(1)
    got = decode_attention.attend(q, stacked.LayerOf(k_stack, layer), stacked.LayerOf(v_stack, layer), mask, 0.25, impl)
    np.testing.assert_allclose(got, decode_attention.attend(q, 2 * k, 2 * v, mask, 0.25, impl), atol=1e-6, rtol=0)
    jaxpr = jax.make_jaxpr(
        lambda ks, vs: decode_attention.attend(
            q, stacked.LayerOf(ks, layer), stacked.LayerOf(vs, layer), mask, 0.25, impl
        )
    )(k_stack, v_stack)
    kernels = [e for e, _ in jaxpr_eqns(jaxpr.jaxpr) if e.primitive.name == "pallas_call"]
    assert len(kernels) == (impl != "auto")
    if impl == "triton":
        assert k_stack.shape in [x.aval.shape for x in kernels[0].invars]


def test_where_the_kernels_apply(monkeypatch):
    q, k, v = _inputs(2, 4, 2, 16, 96, jnp.bfloat16)
    assert decode_attention.kernel_fits(q, k, v, "triton") and decode_attention.kernel_fits(q, k, v, "splash")
    assert not decode_attention.kernel_fits(q, k, v, "auto")  # on the CPU: the einsum
    assert not decode_attention.kernel_fits(q, k, v, "einsum")
    for impl in KERNELS:
        assert not decode_attention.kernel_fits(jnp.concatenate([q, q], 1), k, v, impl)  # a prefill's L queries
        assert not decode_attention.kernel_fits(q, k, v[..., :8], impl)  # values narrower than the queries
        assert not decode_attention.kernel_fits(q, k[:, :, :20], v[:, :, :20], impl)  # 20 slots: blocks of 4
    assert decode_attention.tpu_block(96) == 32 and decode_attention.tpu_block(1536) == 512
    assert not decode_attention.kernel_fits(q[..., :12], k[..., :12], v[..., :12], "triton")  # width 12
    assert decode_attention.kernel_fits(q[..., :12], k[..., :12], v[..., :12], "splash")  # a block's whole width
    # "auto" on a GPU: the kernel in bf16, the einsum in fp32 (Triton's dots multiply fp32 in TF32); on a TPU the
    # einsum (the kernel's operands cost memory there: decode_attention.kernel_of)
    monkeypatch.setattr(sharding, "current_platform", lambda: "gpu")
    assert decode_attention.kernel_fits(q, k, v, "auto")
    assert not decode_attention.kernel_fits(*(a.astype(jnp.float32) for a in (q, k, v)), "auto")
    monkeypatch.setattr(sharding, "current_platform", lambda: "tpu")
    assert decode_attention.kernel_of("auto", jnp.bfloat16) is None
    assert decode_attention.kernel_of("splash", jnp.bfloat16) == "tpu"


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("mesh_shape", [{"fsdp": 4, "tensor": 2}, {"fsdp": 8}])
def test_under_a_mesh_each_device_takes_its_rows_and_heads(mesh_shape, impl):
    q, k, v = _inputs(8, 4, 2, 16, 64)
    mask = _mask(np.arange(8) * 3, 64 - np.arange(8) * 5, 64)
    mesh = sharding.make_mesh(mesh_shape)

    def run(q, k, v, mask):
        with sharding.use_mesh(mesh):
            return decode_attention.attend(q, k, v, mask, 0.25, impl)

    got = jax.jit(run)(q, k, v, mask)
    np.testing.assert_allclose(got, cache_attention(q, k, v, mask, 0.25), atol=1e-6, rtol=0)


def test_the_kernel_compiles_for_an_h100_without_one():
    """A CPU host compiling for a deviceless H100 (cisjax plan's targets, XLA's CUDA plugin; a fresh process: the
    plugin): "auto" in bf16 picks the kernel, and a decode step's attention over Qwen1.5-MoE's heads (16 of 128,
    as many kv heads) and 1,088 slots compiles to one Triton call."""
    out = fresh_process_json(
        """
        import json
        import jax, jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec as P
        from cisjax import sharding
        from cisjax.models import decode_attention
        from cisjax.plan import hardware

        mesh = sharding.make_mesh({"fsdp": 1}, hardware.target("h100x1").devices())
        spec = NamedSharding(mesh, P())
        b, n, kv, h, s = 8, 16, 16, 128, 1088
        shapes = [((b, 1, n, h), jnp.bfloat16), ((b, kv, s, h), jnp.bfloat16), ((b, kv, s, h), jnp.bfloat16),
                  ((b, 1, s), jnp.bool_)]
        args = [jax.ShapeDtypeStruct(shape, dt, sharding=spec) for shape, dt in shapes]

        def run(q, k, v, mask):
            with sharding.use_mesh(mesh):
                return decode_attention.attend(q, k, v, mask, h**-0.5)

        text = jax.jit(run).lower(*args).compile().as_text()
        print(json.dumps({"triton_calls": text.count("__gpu$xla.gpu.triton")}))
        """
    )
    assert out == {"triton_calls": 1}
