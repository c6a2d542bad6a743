"""Controlled mismatch (cisjax.train.perturb): the grids and the noise against hand-computed values, per matrix,
deterministic from the seed, growing with the dial."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cisjax import errors
from cisjax.train import perturb


def _one(w, **kw):
    out, rel = perturb.perturb({"w": jnp.asarray(w, jnp.float32)}, **kw)
    return np.asarray(out["w"]), float(rel)


def test_int8_grid_by_hand():
    # max |w| 1.27 -> step 0.01: -0.5 is on the grid, 0.123 rounds to 0.12
    out, rel = _one([[1.27, -0.5], [0.123, 0.0]], kind="int8")
    np.testing.assert_allclose(out, [[1.27, -0.5], [0.12, 0.0]], atol=1e-6)
    np.testing.assert_allclose(rel, 0.003 / np.sqrt(1.27**2 + 0.25 + 0.123**2), rtol=1e-4)


def test_int4_grid_by_hand():
    # max |w| 0.7 over 7 levels -> step 0.1: -0.31 -> -0.3, 0.06 -> 0.1
    out, _ = _one([[0.7, -0.31], [0.06, 0.7]], kind="int4")
    np.testing.assert_allclose(out, [[0.7, -0.3], [0.1, 0.7]], atol=1e-6)


def test_fp8_grid_by_hand():
    # max |w| 448 -> scale 1; e4m3 has 3 mantissa bits: 17.5 -> 18 (step 2 in [16, 32)), -0.3 -> -0.3125 (step 1/32)
    out, _ = _one([[448.0, 17.5], [1.0, -0.3]], kind="fp8")
    np.testing.assert_allclose(out, [[448.0, 18.0], [1.0, -0.3125]], atol=1e-6)


def test_one_scale_per_matrix_of_a_stack_and_vectors_untouched():
    """A stack [2, 2, 2] (two layers' matrices) is quantised matrix by matrix, as two HF tensors would be; a 1-D leaf
    (a norm) passes unchanged."""
    small = np.array([[1.27, -0.5], [0.123, 0.0]], np.float32)
    stack = np.stack([small, 100 * small])
    norm = np.array([1.0, 0.123456], np.float32)
    out, _ = perturb.perturb({"stack": jnp.asarray(stack), "norm": jnp.asarray(norm)}, kind="int8")
    expect = np.array([[1.27, -0.5], [0.12, 0.0]], np.float32)
    np.testing.assert_allclose(np.asarray(out["stack"]), np.stack([expect, 100 * expect]), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(out["norm"]), norm)


def test_noise_is_seeded_relative_and_keeps_dtype():
    w = jax.random.normal(jax.random.PRNGKey(3), (256, 256), jnp.float32) * 0.02
    params = {"a": w, "b": w.astype(jnp.bfloat16)}
    one, rel = perturb.perturb(params, kind="noise", scale=0.05, seed=7)
    again, _ = perturb.perturb(params, kind="noise", scale=0.05, seed=7)
    other, _ = perturb.perturb(params, kind="noise", scale=0.05, seed=8)
    assert one["b"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(one["a"]), np.asarray(again["a"]))
    assert not np.array_equal(np.asarray(one["a"]), np.asarray(other["a"]))
    # each leaf its own noise (fold_in of the leaf index), not one pattern repeated
    da = np.asarray(one["a"]) - np.asarray(w)
    db = np.asarray(one["b"], np.float32) - np.asarray(w.astype(jnp.bfloat16), np.float32)
    assert abs(np.corrcoef(da.ravel(), db.ravel())[0, 1]) < 0.05
    # ||noise|| / ||w|| ~ scale for a matrix of 65k entries (the bf16 leaf adds its rounding: well under 1%)
    assert 0.049 < np.linalg.norm(da) / np.linalg.norm(np.asarray(w)) < 0.051
    assert 0.049 < rel < 0.051


def test_the_dial_grows():
    w = {"w": jax.random.normal(jax.random.PRNGKey(0), (64, 64), jnp.float32)}
    rel = {k: float(perturb.perturb(w, kind=k)[1]) for k in ("fp8", "int8", "int4")}
    noise = [float(perturb.perturb(w, kind="noise", scale=s)[1]) for s in (0.01, 0.03, 0.1)]
    assert rel["int8"] < rel["int4"] and rel["int8"] < rel["fp8"]
    assert noise[0] < noise[1] < noise[2]


@pytest.mark.parametrize(
    "kind, scale, msg",
    [("int3", 0.0, "one of"), ("noise", 0.0, "perturb_scale > 0"), ("int8", 0.1, "only for rollout.perturb=noise")],
)
def test_bad_settings_are_named(kind, scale, msg):
    with pytest.raises(errors.UserError, match=msg):
        perturb.check(kind, scale)


def test_export_copy_writes_the_perturbed_model_an_engine_starts_on(tiny_hf_dir, tmp_path):
    """export_copy: root/v000000 holds the int8 copy (each matrix on its own grid), its manifest the setting; a second
    call replaces the first copy (clear)."""
    import json

    import flax.nnx as nnx
    from safetensors.numpy import load_file

    from cisjax.models import hf_io

    model, _, hf = hf_io.load(tiny_hf_dir("qwen2_moe"), dtype="float32")
    graphdef, params = nnx.split(model)
    root = tmp_path / "engine_start"
    (root / "v000007").mkdir(parents=True)  # an earlier copy's leftover: cleared
    path, rel = perturb.export_copy(
        graphdef, params, hf, root, kind="int8", scale=0.0, seed=0, dtype="float32", source="test"
    )
    assert path == root / "v000000" and not (root / "v000007").exists()
    assert 0 < rel < 0.02  # int8: well under 1% of a Gaussian matrix's norm moves
    w = load_file(str(path / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"].astype(np.float64)
    steps = w / (np.abs(w).max() / 127)
    np.testing.assert_allclose(steps, np.round(steps), atol=1e-3)
    meta = json.loads((path / "manifest.json").read_text())["metadata"]
    assert meta == {"source": "test", "perturb": "int8", "scale": 0.0, "seed": 0, "rel_rms": rel}
