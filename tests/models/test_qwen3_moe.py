"""Qwen3-MoE parity with transformers' Qwen3MoeForCausalLM: logits, log-probs and routing over a config matrix."""

import numpy as np
import pytest

from cisjax.models import hf_io, qwen3_moe
from tests.models.parity import assert_matches_hf
from tests.support.hf import tiny_hf_config

BASE = tiny_hf_config("qwen3_moe")  # head_dim 16 != hidden_size // num_attention_heads
# name -> (HF config overrides, cisjax runtime options, lengths to test). Every length on two
# cases; the others take one length each (each new shape is a compile).
CASES = {
    "top1": (dict(num_experts_per_tok=1), {}, (1, 7, 33)),
    "top2_norm": (dict(norm_topk_prob=True), {}, (7,)),
    "top4_mqa": (dict(num_experts_per_tok=4, num_key_value_heads=1), {}, (33,)),
    "sparse_step2": (dict(num_hidden_layers=4, decoder_sparse_step=2), {}, (7,)),
    "mlp_only_layers": (dict(num_hidden_layers=3, mlp_only_layers=[0, 2], norm_topk_prob=True), {}, (33,)),
    "tied_top4_norm": (dict(tie_word_embeddings=True, num_experts_per_tok=4, norm_topk_prob=True), {}, (1, 7, 33)),
    "attention_bias": (
        dict(attention_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 1000.0}),
        {},
        (7,),
    ),
    "dense_impl": (dict(norm_topk_prob=True), dict(moe_impl="dense"), (33,)),
    "ragged_impl": (dict(num_experts_per_tok=4), dict(moe_impl="ragged"), (7,)),
}


@pytest.fixture(scope="module")
def saved(tiny_hf_dir):
    """name -> (model_dir, model, cfg), each tiny HF model saved and loaded once."""
    cache = {}

    def get(name):
        if name not in cache:
            overrides, runtime, _ = CASES[name]
            model_dir = tiny_hf_dir("qwen3_moe", seed=list(CASES).index(name), **overrides)
            cache[name] = (model_dir, *hf_io.load(model_dir, **runtime)[:2])
        return cache[name]

    return get


@pytest.mark.parametrize("name,length", [(n, length) for n, (_, _, lengths) in CASES.items() for length in lengths])
def test_parity(saved, name, length):
    model_dir, model, cfg = saved(name)
    assert len(model.moe_layers) == sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)) > 0
    tokens_BxL = np.random.default_rng(length).integers(
        0, cfg.vocab_size, (3 if length == 1 else 2, length), dtype=np.int32
    )
    assert_matches_hf(model_dir, model, tokens_BxL)  # also: routing captured for every MoE layer, identical


def test_layer_layout():
    cfg = qwen3_moe.Config.from_hf({**BASE, "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert [cfg.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    assert cfg.head_dim == 16 and not cfg.attention_bias and not cfg.norm_topk_prob and not cfg.tie_word_embeddings
    cfg = qwen3_moe.Config.from_hf({k: v for k, v in BASE.items() if k not in ("head_dim", "num_key_value_heads")})
    assert cfg.head_dim == 8 and cfg.num_key_value_heads == 4  # Qwen3MoeConfig's defaults


def test_sliding_window_rejected():
    with pytest.raises(ValueError, match="sliding"):
        qwen3_moe.Config.from_hf({**BASE, "use_sliding_window": True, "sliding_window": 16})
    # A window without use_sliding_window is dropped by Qwen3MoeConfig: full attention.
    qwen3_moe.Config.from_hf({**BASE, "use_sliding_window": False, "sliding_window": 16})
