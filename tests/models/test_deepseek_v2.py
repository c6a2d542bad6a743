"""DeepSeek-V2 parity with transformers' DeepseekV2ForCausalLM: logits, log-probs and routing."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from cisjax.models import deepseek_v2, hf_io
from tests.models.parity import assert_matches_hf

# Each config below overrides tests.support.hf.TINY_FAMILIES["deepseek_v2"] (hidden 48, 3 layers, kv LoRA 16, 8 routed experts
# top 3, 2 shared; save_tiny_hf's initializer_range 0.1 is large enough that attention visibly moves the logits).
YARN = dict(
    rope_type="yarn",
    rope_theta=1000.0,
    factor=4.0,
    original_max_position_embeddings=128,
    mscale=0.9,
    mscale_all_dim=0.7,
)

CONFIGS = {
    # q LoRA, yarn with mscale/mscale_all_dim, group-limited routing, a leading dense layer, biases,
    # rms_norm_eps != the latent norms' fixed 1e-6
    "lora_yarn_group": dict(
        q_lora_rank=24,
        rope_parameters=YARN,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        attention_bias=True,
        rms_norm_eps=1e-5,
    ),
    # no q LoRA, default rope, greedy, all layers MoE, tied head; HF ignores norm_topk_prob here
    "plain_greedy_tied": dict(
        q_lora_rank=None,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        topk_method="greedy",
        first_k_dense_replace=0,
        tie_word_embeddings=True,
        norm_topk_prob=True,
        n_shared_experts=1,
    ),
    # yarn without mscale_all_dim (no softmax-scale correction), legacy rope_scaling spelling
    "nolora_yarn_plain_scale": dict(
        q_lora_rank=None,
        rope_scaling=dict(type="yarn", factor=8.0, original_max_position_embeddings=64),
        rope_theta=500.0,
        topk_method="group_limited_greedy",
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=0.5,
        num_hidden_layers=2,
    ),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tiny_hf_dir):
    path = tiny_hf_dir("deepseek_v2", seed=1, **CONFIGS[request.param])
    model, cfg, hf = hf_io.load(path)
    return path, model, cfg, hf


@pytest.mark.parametrize("length", [1, 9, 33])
def test_parity_with_hf(tiny, length):
    path, model, cfg, _ = tiny
    assert model.moe_layers == [i for i in range(cfg.num_hidden_layers) if i >= cfg.first_k_dense_replace]
    tokens_BxL = np.random.default_rng(length).integers(0, cfg.vocab_size, (2, length), dtype=np.int32)
    assert_matches_hf(path, model, tokens_BxL)  # logits, log-probs, routing of every MoE layer


def test_save_round_trip(tiny, tmp_path):
    path, model, _, hf = tiny
    before, after = hf_io.SafetensorsDir(path), hf_io.SafetensorsDir(hf_io.save(model, tmp_path, hf))
    assert sorted(after.names()) == sorted(before.names())
    for name in before.names():
        np.testing.assert_array_equal(after.array(name), before.array(name))


def test_config_spellings_and_defaults():
    new = dict(
        vocab_size=10,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        max_position_embeddings=163840,
        num_attention_heads=2,
        num_experts_per_tok=1,
        n_routed_experts=4,
        q_lora_rank=None,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=40.0,
            original_max_position_embeddings=4096,
            mscale=0.707,
            mscale_all_dim=0.707,
        ),
    )
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old.update(
        num_experts=old.pop("n_routed_experts"),
        rope_theta=10000.0,
        rope_scaling=dict(
            type="yarn", factor=40.0, original_max_position_embeddings=4096, mscale=0.707, mscale_all_dim=0.707
        ),
    )
    a, b = deepseek_v2.Config.from_hf(new), deepseek_v2.Config.from_hf(old)
    assert a == b and a.q_lora_rank is None and a.num_experts == 4
    # DeepSeek-V2-Lite's softmax scale: (0.1 * 0.707 * ln 40 + 1)^2 / sqrt(192)
    assert a.softmax_scale() == pytest.approx((0.1 * 0.707 * np.log(40) + 1) ** 2 / np.sqrt(192))
    absent = {k: v for k, v in new.items() if k != "q_lora_rank"}
    assert deepseek_v2.Config.from_hf(absent).q_lora_rank == 1536  # HF default when the field is absent
    with pytest.raises(ValueError, match="num_key_value_heads"):
        deepseek_v2.Config.from_hf({**new, "num_key_value_heads": 1})
    with pytest.raises(ValueError, match="topk_method"):
        deepseek_v2.Config.from_hf({**new, "topk_method": "noaux_tc"})


# ----------------------------------------------------------------------------- absorbed (latent-space) decode


def test_absorbs_decoding_not_prefill_by_hand():
    """DeepSeek-V2-Lite's attention (16 heads, nope 128, rope 64, latent 512, v 128): one decode token over 1,024
    slots costs 16 x 512 x 256 + 1,024 x 16 x 1,088 = 1.99e7 FLOPs absorbed against 1,024 x 512 x 16 x 256 + 1,024 x
    16 x 320 = 2.15e9 expanded; a prefill of 512 tokens over 512 slots costs 5.63e9 absorbed against 2.41e9."""
    lite = dict(n=16, nope=128, rope=64, c=512, v=128)
    assert deepseek_v2.absorbs(1, 1024, **lite)
    assert not deepseek_v2.absorbs(512, 512, **lite)


def test_absorbed_attention_equals_attending_over_the_expanded_keys():
    """q_nope . (latent @ W_UK) = (q_nope @ W_UK^T) . latent and sum_s p_s (latent_s @ W_UV) = (sum_s p_s latent_s)
    @ W_UV: in fp32, absorbed_attention equals einsum_attention over the expanded per-head keys [k_nope, k_pe] and
    values, under a cache mask with padding (to fp32 rounding)."""
    from cisjax.models.attention import cache_mask, einsum_attention

    rng = np.random.default_rng(0)
    b, l, s, n, e, p, c, v = 2, 3, 7, 4, 8, 4, 16, 6
    f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    q_nope, q_pe, latent, k_pe, w_uk, w_uv = (
        f(b, l, n, e),
        f(b, l, n, p),
        f(b, s, c),
        f(b, s, p),
        f(c, n, e),
        f(c, n, v),
    )
    valid_BxS = jnp.asarray(np.arange(s)[None] >= np.array([[0], [2]]))  # row 1: two slots of left padding
    mask = cache_mask(valid_BxS, 4, l)  # the new tokens at slots 4..6
    got = deepseek_v2.absorbed_attention(q_nope, q_pe, latent, k_pe, w_uk, w_uv, mask, 0.3)
    k = jnp.concatenate(
        [jnp.einsum("bsc,cne->bsne", latent, w_uk), jnp.broadcast_to(k_pe[:, :, None], (b, s, n, p))], -1
    )
    want = einsum_attention(
        jnp.concatenate([q_nope, q_pe], -1), k, jnp.einsum("bsc,cnv->bsnv", latent, w_uv), mask, 0.3
    )
    assert got.shape == (b, l, n, v)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["lora_yarn_group", "plain_greedy_tied"])
def test_a_decode_step_absorbed_equals_it_expanded(name, tiny_hf_dir, monkeypatch):
    """A layer's attention on one new token over a cache of 9 slots (the decode step the sampler runs): absorbed, and
    with the absorption turned off (expanded keys and values), equal in fp32 to the parity tolerance."""
    from cisjax.models.attention import cache_mask

    model, cfg, _ = hf_io.load(tiny_hf_dir("deepseek_v2", seed=1, **CONFIGS[name]))
    attn = model.layer(0).attn
    rng = np.random.default_rng(3)
    b, slots = 2, 9
    x = jnp.asarray(rng.normal(size=(b, 1, cfg.hidden_size)), jnp.float32)
    positions = jnp.full((b, 1), 6, jnp.int32)
    ctx = jnp.asarray(rng.normal(size=(b, slots, cfg.hidden_size)), jnp.float32)
    kv = attn.kv(ctx, jnp.broadcast_to(jnp.arange(slots), (b, slots)))
    mask = cache_mask(jnp.ones((b, slots), bool).at[0, :3].set(False), 6, 1)[..., :slots]
    q = attn.query(x)
    assert deepseek_v2.absorbs(
        1, slots, q.shape[2], cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
    )
    absorbed = attn.attend(q, positions, kv, mask)
    monkeypatch.setattr(deepseek_v2, "absorbs", lambda *a: False)
    expanded = attn.attend(q, positions, kv, mask)
    np.testing.assert_allclose(np.asarray(absorbed), np.asarray(expanded), rtol=1e-5, atol=1e-5)
