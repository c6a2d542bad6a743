"""exact_moe.expert_tiles (rollout.exact's scalable MoE): a token's expert outputs are the same bits whichever tokens
share its expert tiles, the experts' function, at most tile_count tiles; and the tile height is load-bearing: a
trainer on another height than the sampler's gets q != p. (q == p per family and dtype: tests/models/test_exact.py.)"""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cisjax.engines.jax import exact_engine
from cisjax.models import exact, exact_moe, hf_io


def _moe(tiny_hf_dir, family, dtype):
    model, _, _ = hf_io.load(tiny_hf_dir(family), dtype=dtype, param_dtype="float32")
    layer = next(layer for layer in exact.layers(model) if layer.is_moe)
    return model, layer.mlp.moe


def _tokens(moe, n, seed):
    """n random inputs [n, D] and k distinct experts per token [n, k]."""
    rng = np.random.default_rng(seed)
    e, d = moe.wg_ExDxF.shape[0], moe.wg_ExDxF.shape[1]
    ids = np.stack([rng.permutation(e)[: moe.k] for _ in range(n)]).astype(np.int32)
    return rng.standard_normal((n, d)).astype(np.float32), ids


@pytest.mark.parametrize(
    "family,dtype", [("qwen2_moe", "float32"), ("qwen2_moe", "bfloat16"), ("deepseek_v2", "float32")]
)
def test_a_tokens_output_does_not_depend_on_the_other_tokens(tiny_hf_dir, family, dtype):
    """Token x0 first of 4 tokens, and the 21st of 53 (36 tokens on its first expert: x0 row 4 of that expert's
    second tile, the others other tokens): its k outputs bit for bit the same, each program jitted at its shape."""
    _, moe = _moe(tiny_hf_dir, family, dtype)
    x, ids = _tokens(moe, 4, 0)
    y, ye = _tokens(moe, 53, 1)
    y[20], ye[20] = x[0], ids[0]
    ye[:36, 0] = ids[0, 0]
    ye[:36, 1:] = np.where(ye[:36, 1:] == ids[0, 0], ids[0, 1], ye[:36, 1:])  # k distinct experts per token
    run = jax.jit(functools.partial(exact_moe.expert_tiles, moe))
    alone, crowded = np.asarray(run(x, ids)), np.asarray(run(y, ye))
    assert (ye[:36, 0] == ids[0, 0]).all() and len(set(ye[20])) == moe.k
    np.testing.assert_array_equal(crowded[20], alone[0])


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "deepseek_v2"])
def test_expert_tiles_compute_the_experts(tiny_hf_dir, family):
    """Each token's k outputs equal its experts' SwiGLU MLP gathered per token (exact_moe.experts_gather's einsums)
    within fp32 rounding, and the combine equals the weighted sum."""
    _, moe = _moe(tiny_hf_dir, family, "float32")
    x, ids = _tokens(moe, 37, 2)
    got = np.asarray(exact_moe.expert_tiles(moe, jnp.asarray(x), jnp.asarray(ids)))
    wg, wu, wo = (np.asarray(getattr(moe, n)[...]) for n in ("wg_ExDxF", "wu_ExDxF", "wo_ExFxD"))
    g, u = np.einsum("td,tkdf->tkf", x, wg[ids]), np.einsum("td,tkdf->tkf", x, wu[ids])
    want = np.einsum("tkf,tkfd->tkd", g / (1 + np.exp(-g)) * u, wo[ids])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    w = np.random.default_rng(3).random(ids.shape).astype(np.float32)
    comb = np.asarray(exact_moe.combine(jnp.asarray(got), jnp.asarray(w), jnp.float32))
    np.testing.assert_allclose(comb, np.einsum("tkd,tk->td", got, w), rtol=1e-6, atol=1e-6)


def test_tile_count_by_hand():
    # 12 assignments over 8 experts: a tile per expert at most; 1000 over 4: 250 each, 16 tiles of 16 each (+1 bound)
    assert exact_moe.tile_count(12, 8, 16) == 8
    assert exact_moe.tile_count(1000, 4, 16) == (1000 + 4 * 15) // 16 == 66
    assert exact_moe.tile_count(3, 60, 16) == (3 + 3 * 15) // 16 == 3
    rng = np.random.default_rng(4)
    for _ in range(200):  # every draw of counts fits its bound
        e, a = int(rng.integers(1, 70)), int(rng.integers(1, 300))
        n = np.bincount(rng.integers(0, e, a), minlength=e)
        assert np.sum(-(-n // 16)) <= exact_moe.tile_count(a, e, 16)


def test_another_tile_height_in_the_trainer_breaks_q_equals_p(tiny_hf_dir, monkeypatch):
    """The sampler's q at EXPERT_TILE rows per expert tile; the trainer's p of the same samples at EXPERT_TILE (equal)
    and at 4 x it (most tokens an ulp or so off): the height must be the one constant of both sides. (On XLA:CPU at
    the tiny model's [H, 32] x [32, 24] the heights 2-32 happen to give the same bits, 64 other ones: measured.)"""
    model, _, _ = hf_io.load(tiny_hf_dir("qwen2_moe"), dtype="float32", param_dtype="float32")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 90, int(rng.integers(2, 12))).tolist() for _ in range(4)]
    toks, q, _ = exact_engine.sample(model, prompts, 8, jax.random.key(0), slots=32, moe_impl="tiles")
    toks, q = np.asarray(toks), np.asarray(q)
    t = 32
    tokens, targets = np.zeros((4, t), np.int32), np.zeros((4, t), np.int32)
    for b, p in enumerate(prompts):
        seq = p + toks[b].tolist()
        tokens[b, : len(seq)], targets[b, : len(seq) - 1] = seq, seq[1:]
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (4, t))

    def p_of_samples():
        forward = jax.jit(functools.partial(exact.exact_forward, moe_impl="tiles"), static_argnames=("slots",))
        p = np.asarray(forward(model, tokens, positions, targets, slots=32))
        return np.concatenate([p[b, len(pr) - 1 : len(pr) - 1 + 8] for b, pr in enumerate(prompts)])

    np.testing.assert_array_equal(p_of_samples(), q.reshape(-1))
    monkeypatch.setattr(exact_moe, "EXPERT_TILE", exact_moe.EXPERT_TILE * 4)
    other = p_of_samples()
    assert np.mean(other == q.reshape(-1)) < 0.9
    np.testing.assert_allclose(other, q.reshape(-1), rtol=0, atol=1e-5)


def test_moe_impl_takes_tiles_where_dense_would_cost_more_than_dense_max():
    """dense while E / k <= exact.DENSE_MAX (the demo's and the tests' 8 experts top-2: 4) and each expert matrix holds
    at most exact.DENSE_MAX_WEIGHTS (the demo's 64 x 32), expert tiles past either (Qwen1.5-MoE's 60 top-4: 15,
    Qwen3-30B-A3B's 128 top-8: 16; the benches' 8 top-2 of 256 x 256), no MoE: dense (unused)."""

    def pick(experts, k, d=64, f=32):
        cfg = types.SimpleNamespace(num_experts=experts, num_experts_per_tok=k, hidden_size=d, moe_intermediate_size=f)
        return exact.moe_impl(types.SimpleNamespace(cfg=cfg))

    assert (exact.DENSE_MAX, exact.DENSE_MAX_WEIGHTS) == (4, 8192)
    assert (pick(8, 2), pick(9, 2), pick(60, 4, 2048, 1408), pick(128, 8, 2048, 768), pick(16, 4)) == (
        "dense",
        "tiles",
        "tiles",
        "tiles",
        "dense",
    )
    assert (pick(8, 2, 128, 64), pick(8, 2, 128, 65), pick(8, 2, 256, 256)) == ("dense", "tiles", "tiles")
    assert exact.moe_impl(types.SimpleNamespace(cfg=types.SimpleNamespace())) == "dense"
