"""cisjax.models.cpu_bits: 16-bit floats as their bits on the CPU only (the traced program's platform), back bit for
bit; the plain KV cache's writes go through it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cisjax import sharding
from cisjax.models import cpu_bits, transformer

HALF = (jnp.bfloat16, jnp.float16)


@pytest.mark.parametrize("dtype", HALF)
def test_half_floats_round_trip_bit_for_bit(dtype):
    x = jnp.asarray([0.0, -0.0, 1.5, -3.25e-3, jnp.inf, -jnp.inf, jnp.nan, 6.0e4], dtype)
    tree = {"x": x, "f": jnp.ones(3, jnp.float32), "i": jnp.arange(3)}
    bits = cpu_bits.to_bits(tree)
    assert bits["x"].dtype == jnp.uint16 and bits["f"].dtype == jnp.float32 and bits["i"].dtype == tree["i"].dtype
    back = cpu_bits.from_bits(bits, cpu_bits.dtypes_of(tree))
    assert back["x"].dtype == dtype
    np.testing.assert_array_equal(np.asarray(back["x"]).view(np.uint16), np.asarray(x).view(np.uint16))


def test_other_platforms_keep_their_program(monkeypatch):
    """Traced for a TPU or GPU mesh (cisjax plan on this host) nothing is bitcast: there the bitcasts would cost
    copies."""
    x = jnp.ones(4, jnp.bfloat16)
    assert cpu_bits.active() and cpu_bits.to_bits(x).dtype == jnp.uint16
    for platform in ("tpu", "cuda", "gpu"):
        monkeypatch.setattr(sharding, "current_platform", lambda p=platform: p)
        assert not cpu_bits.active() and cpu_bits.to_bits(x) is x


def _write_dtypes(cache, new, index, axis, layer=None):
    """The dtypes of the arrays the cache write's scatter / dynamic-update-slice writes into, and its output."""
    jaxpr = jax.make_jaxpr(lambda c, n: transformer.write_cache(c, n, index, axis, layer))(cache, new)
    writes = [
        e.invars[0].aval.dtype for e in jaxpr.jaxpr.eqns if e.primitive.name in ("scatter", "dynamic_update_slice")
    ]
    return writes, jaxpr.out_avals[0].dtype


@pytest.mark.parametrize("per_row", [False, True])
def test_the_kv_cache_is_written_as_bits_on_the_cpu(per_row, monkeypatch):
    """A bf16 cache's write (one slot for all rows: dynamic-update-slice; each row's own slot: scatter) writes uint16
    on the CPU, bf16 for another platform; the values land alike."""
    b, s, d = 3, 8, 4
    cache = jnp.zeros((b, s, d), jnp.bfloat16)
    new = jnp.asarray(np.random.default_rng(0).standard_normal((b, 1, d)), jnp.float32)
    index = jnp.asarray([1, 5, 7], jnp.int32) if per_row else 2
    writes, out = _write_dtypes(cache, new, index, 1)
    assert writes == [jnp.uint16] and out == jnp.bfloat16
    got = transformer.write_cache(cache, new, index, 1)
    monkeypatch.setattr(cpu_bits, "active", lambda: False)
    writes, _ = _write_dtypes(cache, new, index, 1)
    assert writes == [jnp.bfloat16]
    want = transformer.write_cache(cache, new, index, 1)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))
    slots = np.asarray(index).reshape(-1) if per_row else [index] * b
    for r, slot in enumerate(slots):
        np.testing.assert_array_equal(
            np.asarray(got[r, slot], np.float32), np.asarray(new[r, 0].astype(jnp.bfloat16), np.float32)
        )
