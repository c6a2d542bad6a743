"""Analytic FLOP counts against hand counts of tiny models (every number below is worked out by hand)."""

import flax.nnx as nnx
import pytest

from cisjax.models import hf_io
from cisjax.plan import flops

# D 64, 4 query heads of 16, 2 kv heads, 8 experts top-2 of width 32, a shared expert of 48, vocabulary 100.
QWEN2_MOE = dict(
    architectures=["Qwen2MoeForCausalLM"],
    vocab_size=100,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    max_position_embeddings=64,
    rope_theta=1e4,
)
# MLA: 4 heads, q width 8 + 4 (rope), v width 8, kv latent 16, no q LoRA; layer 0 dense (96), layer 1 MoE: 4 experts
# top-2 of width 16 and one shared expert of 16.
DEEPSEEK_V2 = dict(
    architectures=["DeepseekV2ForCausalLM"],
    vocab_size=100,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=None,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    first_k_dense_replace=1,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    n_shared_experts=1,
    max_position_embeddings=64,
    rope_theta=1e4,
)


def abstract(hf):
    cfg = hf_io.model_config(hf)
    return nnx.eval_shape(lambda: hf_io.family_module(hf).build(cfg, nnx.Rngs(0)))


def test_qwen2_moe_by_hand():
    model = abstract(QWEN2_MOE)
    rows, t = 2, 8  # 16 tokens
    # attention: q 64x64 + k 64x32 + v 64x32 + o 64x64 = 12288 MACs per token; causal core 2 * 8^2 * 4 heads * (16 + 16)
    attention = 2 * (16 * 2 * 12288 + 2 * 8**2 * 4 * 32)
    # MoE: router 64x8 = 512, shared 3 x 64 x 48 = 9216, shared gate 64, experts 2 of 8: 2 x 3 x 64 x 32 = 12288
    moe = 2 * 16 * 2 * (512 + 9216 + 64 + 12288)
    head = 16 * 2 * 64 * 100
    assert attention == 819_200 and moe == 1_413_120 and head == 204_800
    assert flops.forward_flops(model, rows, t) == {"attention": attention, "mlp": 0, "moe": moe, "head": head}
    assert flops.layer_counts(model) == {"attention": 2, "mlp": 0, "moe": 2, "head": 1}
    assert flops.train_flops(flops.forward_flops(model, rows, t), 3) == {
        "attention": 9 * attention,
        "mlp": 0,
        "moe": 9 * moe,
        "head": 12 * head,
    }  # head: 4 passes (recompute)
    assert flops.rescore_flops(flops.forward_flops(model, rows, t), 3)["moe"] == 3 * moe
    # parameters: embed and head 2 x 6400, final norm 64; per layer: projections 12288 + q/k/v biases 128 + 2 norms
    # 128 + router 512 + experts 8 x 3 x 64 x 32 = 49152 + shared 9216 + gate 64 = 71488
    assert flops.total_params(model) == 12_800 + 64 + 2 * 71_488 == 155_840
    assert flops.active_params(model) == 155_840 - 2 * 49_152 * 6 // 8 == 82_112


def test_deepseek_v2_by_hand():
    model = abstract(DEEPSEEK_V2)
    assert model.cfg.attention_dims() == (4, 12, 8)
    rows, t = 1, 4  # 4 tokens
    # MLA: q 64 x 4*12 = 3072, kv_a 64 x (16 + 4) = 1280, kv_b 16 x 4*(8 + 8) = 1024, o 4*8 x 64 = 2048 -> 7424 MACs;
    # causal core 1 * 4^2 * 4 heads * (12 + 8)
    attention = 2 * (4 * 2 * 7424 + 4**2 * 4 * 20)
    mlp = 4 * 2 * 3 * 64 * 96  # the dense first layer
    moe = 4 * 2 * (64 * 4 + 3 * 64 * 16 + 2 * 3 * 64 * 16)  # router, one shared expert, 2 of 4 routed
    assert flops.forward_flops(model, rows, t) == {
        "attention": attention,
        "mlp": mlp,
        "moe": moe,
        "head": 4 * 2 * 64 * 100,
    }
    assert flops.layer_counts(model) == {"attention": 2, "mlp": 1, "moe": 1, "head": 1}


# name -> (total, active) parameters: the model cards' 14.3B / 15.7B / 30.5B / 14.2B
PAPER_MODELS = {
    "qwen15_moe_a27b": (14_315_784_192, 2_689_173_504),
    "deepseek_v2_lite": (15_706_484_224, 2_661_150_208),
    "qwen3_30b_a3b": (30_532_122_624, 3_353_032_704),
    "qwen15_14b": (14_167_290_880, 14_167_290_880),
}


# one model in the fast tier (make test-fast): each abstract build traces every layer of a full-size model
@pytest.mark.parametrize(
    "name", [n if n == "qwen15_moe_a27b" else pytest.param(n, marks=pytest.mark.slow) for n in PAPER_MODELS]
)
def test_paper_models_active_parameters(name):
    """The shipped architecture files give the model cards' total and active parameter counts."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "configs" / "models"
    model = abstract(json.loads((root / f"{name}.json").read_text()))
    assert (flops.total_params(model), flops.active_params(model)) == PAPER_MODELS[name]


@pytest.mark.parametrize("size", [1, 7])
def test_matmul_params_skips_vectors(size):
    class Tiny(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(nnx.initializers.zeros(None, (3, size)))
            self.b = nnx.Param(nnx.initializers.zeros(None, (size,)))

    assert flops.matmul_params(Tiny()) == 3 * size
