"""Qwen2-MoE parity with transformers' Qwen2MoeForCausalLM: logits, log-probs and routing over a config matrix."""

import json
import shutil

import numpy as np
import pytest

from cisjax.models import hf_io
from tests.models.parity import LOGITS_TOL, assert_matches_hf, run
from tests.support.hf import hf_forward

# name -> (HF config overrides, lengths to test). Every length is covered by the base case; the
# other cases take one length each (each new shape is a compile).
CASES = {
    "top2_gqa": (dict(), (1, 7, 33)),
    "top1": (dict(num_experts_per_tok=1), (7,)),
    "top4_norm_mha_headdim": (
        dict(num_experts_per_tok=4, norm_topk_prob=True, num_key_value_heads=4, head_dim=16),
        (33,),
    ),
    "sparse_step2": (dict(num_hidden_layers=4, decoder_sparse_step=2), (7,)),
    "mlp_only_layers": (dict(num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True), (33,)),
    "tied_nobias_mqa_rope": (
        dict(
            tie_word_embeddings=True,
            qkv_bias=False,
            num_key_value_heads=1,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        ),
        (33,),
    ),
}


@pytest.fixture(scope="module")
def saved(tiny_hf_dir):
    """name -> (model_dir, model, cfg), each tiny HF model saved and loaded once."""
    cache = {}

    def get(name):
        if name not in cache:
            model_dir = tiny_hf_dir("qwen2_moe", seed=list(CASES).index(name), **CASES[name][0])
            cache[name] = (model_dir, *hf_io.load(model_dir)[:2])
        return cache[name]

    return get


@pytest.mark.parametrize("name,length", [(n, length) for n, (_, lengths) in CASES.items() for length in lengths])
def test_parity(saved, name, length):
    model_dir, model, cfg = saved(name)
    tokens_BxL = np.random.default_rng(length).integers(
        0, cfg.vocab_size, (3 if length == 1 else 2, length), dtype=np.int32
    )
    assert_matches_hf(model_dir, model, tokens_BxL)


def test_layer_kinds(saved):
    """decoder_sparse_step / mlp_only_layers pick the same MoE layers as transformers."""
    _, model, _ = saved("sparse_step2")
    assert model.moe_layers == [1, 3]
    _, model, _ = saved("mlp_only_layers")
    assert model.moe_layers == [0, 2]
    _, model, cfg = saved("tied_nobias_mqa_rope")
    assert (
        cfg.tie_word_embeddings
        and not cfg.qkv_bias
        and dict(cfg.rope) == {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}
    )


def test_legacy_config_spellings(saved, tmp_path):
    """rope_theta + rope_scaling (instead of rope_parameters) and num_local_experts (instead of
    num_experts) describe the same model: same config, identical logits."""
    model_dir, model, cfg = saved("tied_nobias_mqa_rope")
    legacy = tmp_path / "legacy"
    shutil.copytree(model_dir, legacy)
    hf = json.loads((legacy / "config.json").read_text())
    rope = hf.pop("rope_parameters")
    assert rope["rope_type"] == "linear"
    hf["rope_theta"] = rope["rope_theta"]
    hf["rope_scaling"] = {"type": "linear", "factor": rope["factor"]}
    hf["num_local_experts"] = hf.pop("num_experts")
    (legacy / "config.json").write_text(json.dumps(hf))

    legacy_model, legacy_cfg, _ = hf_io.load(legacy)
    assert legacy_cfg == cfg
    tokens_BxL = np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 33), dtype=np.int32)
    logits, ids = run(legacy_model, tokens_BxL)
    ref_logits, ref_ids = hf_forward(model_dir, tokens_BxL)
    assert np.abs(logits - ref_logits).max() <= LOGITS_TOL
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_array_equal(logits, run(model, tokens_BxL)[0])
