"""Dense Qwen2 parity with transformers' Qwen2ForCausalLM: logits and log-probs, no routing."""

import numpy as np
import pytest

from cisjax.models import hf_io, qwen2
from tests.models.parity import assert_matches_hf
from tests.support.hf import tiny_hf_config

BASE = tiny_hf_config("qwen2")  # vocab 97, hidden 32, 4 heads, 4 kv heads, 2 layers
CASES = {
    "untied_mha": dict(),
    "tied_gqa": dict(tie_word_embeddings=True, num_key_value_heads=2),
    "untied_mqa_headdim_rope": dict(
        num_hidden_layers=3,
        num_key_value_heads=1,
        head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    ),
}
LENGTHS = (1, 7, 33)


@pytest.fixture(scope="module")
def saved(tiny_hf_dir):
    """name -> (model_dir, model, cfg), each tiny HF model saved and loaded once."""
    cache = {}

    def get(name):
        if name not in cache:
            model_dir = tiny_hf_dir("qwen2", seed=list(CASES).index(name), **CASES[name])
            cache[name] = (model_dir, *hf_io.load(model_dir)[:2])
        return cache[name]

    return get


@pytest.mark.parametrize("name,length", [(n, length) for n in CASES for length in LENGTHS])
def test_parity(saved, name, length):
    model_dir, model, cfg = saved(name)
    assert model.moe_layers == []
    tokens_BxL = np.random.default_rng(length).integers(
        0, cfg.vocab_size, (3 if length == 1 else 2, length), dtype=np.int32
    )
    assert_matches_hf(model_dir, model, tokens_BxL)  # also: expert ids None on both sides


def test_config_defaults():
    cfg = qwen2.Config.from_hf({**BASE, "num_key_value_heads": None})
    assert cfg.num_key_value_heads == 4  # explicit null -> num_attention_heads (Qwen2Config.__post_init__)
    assert cfg.head_dim == 8 and cfg.qkv_bias and not cfg.tie_word_embeddings


def test_sliding_window_rejected():
    with pytest.raises(ValueError, match="sliding"):
        qwen2.Config.from_hf({**BASE, "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1})
    # Window on, but max_window_layers covers every layer: all full attention, as in transformers.
    qwen2.Config.from_hf({**BASE, "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2})
    with pytest.raises(ValueError, match="sliding"):
        qwen2.Config.from_hf({**BASE, "layer_types": ["full_attention", "sliding_attention"]})
