"""Tiny random Hugging Face models saved locally (each family's config, the meshes the shardable one splits on), and
the torch reference forward with routing capture."""

from __future__ import annotations

import numpy as np

# A tiny Qwen2-MoE whose dims the sharding table can split on 8 devices (8 heads x 8, 4 kv heads x 8,
# 8 experts): shared by the sharding, train-step and checkpoint tests.
SHARDABLE_QWEN2_MOE = dict(
    architectures=["Qwen2MoeForCausalLM"],
    vocab_size=128,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    max_position_embeddings=64,
    rope_theta=10000.0,
)
# The tiny random models of each family cisjax supports: (transformers config class, model class, base config).
# Built and saved once per test session (per xdist worker) by the `tiny_hf_dir` fixture (tests/conftest.py), with
# per-test overrides; a test that needs another shape passes its differences, not a copy of the whole config.
TINY_FAMILIES = {
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            architectures=["Qwen2ForCausalLM"],
            vocab_size=97,
            hidden_size=32,
            intermediate_size=56,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=128,
        ),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            architectures=["Qwen2MoeForCausalLM"],
            vocab_size=97,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=48,
            num_experts=8,
            num_experts_per_tok=2,
            max_position_embeddings=128,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            architectures=["Qwen3MoeForCausalLM"],
            vocab_size=97,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,  # explicit, != hidden_size // num_attention_heads
            moe_intermediate_size=24,
            num_experts=8,
            num_experts_per_tok=2,
            max_position_embeddings=128,
        ),
    ),
    "deepseek_v2": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(
            architectures=["DeepseekV2ForCausalLM"],
            vocab_size=97,
            hidden_size=48,
            intermediate_size=40,
            num_hidden_layers=3,
            num_attention_heads=4,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=6,
            n_routed_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=12,
            n_shared_experts=2,
            max_position_embeddings=512,
        ),
    ),
}
# The Qwen2-MoE the rollout-server tests run on transformers (and `cisjax score`'s tests): its own head and MoE sizes.
SERVER_QWEN2_MOE = dict(
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=24,
    shared_expert_intermediate_size=40,
    norm_topk_prob=False,
)
# The vLLM CPU engine's test model: hidden and MoE sizes multiples of 32 (vLLM's CPU MoE kernel pads others), head_dim 32.
VLLM_QWEN2_MOE = dict(
    hidden_size=64,
    intermediate_size=64,
    num_attention_heads=2,
    num_key_value_heads=1,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=64,
    norm_topk_prob=False,
)


def tiny_hf_config(family: str, **overrides) -> dict:
    """The HF config dict of a TINY_FAMILIES model with `overrides`."""
    return {**TINY_FAMILIES[family][2], **overrides}


# Mesh shapes the sharded tests run on (8 fake CPU devices, tests/conftest.py).
MESHES = {
    "fsdp8": {"fsdp": 8},
    "data2_fsdp2_tensor2": {"data": 2, "fsdp": 2, "tensor": 2},
    "fsdp2_tensor2_expert2": {"fsdp": 2, "tensor": 2, "expert": 2},
}


def save_tiny_hf(
    path, config_cls_name: str, model_cls_name: str, seed: int = 0, dtype: str = "float32", **config
) -> str:
    """Build a tiny random transformers model, save_pretrained it to `path`, return the path."""
    import torch
    import transformers

    torch.manual_seed(seed)
    # At HF's default 0.02 the logits of a tiny model are nearly the embedding alone, so a wrong
    # attention or rope detail would hide under the tolerance; 0.1 makes every layer matter.
    config.setdefault("initializer_range", 0.1)
    cfg = getattr(transformers, config_cls_name)(**config)
    model = getattr(transformers, model_cls_name)(cfg).eval()
    # Random init leaves some params (norms, biases) at trivial values; perturb everything so a
    # wrong mapping of any tensor shows up in the logits.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.to(getattr(torch, dtype)).save_pretrained(path)
    return str(path)


def _replayed_router_output(module, output, ids_NxK):
    """A transformers router's (logits, weights, ids) with the ids forced: the weights as the family's own code
    weighs its top-k (fp32 softmax over all experts, gathered; Qwen: renormalised over the k when norm_topk_prob;
    DeepSeek-V2: times routed_scaling_factor), at the given ids instead."""
    import torch

    logits = output[0]
    ids = torch.as_tensor(ids_NxK, dtype=torch.int64).reshape(-1, output[2].shape[-1])
    w = torch.softmax(logits.float(), dim=-1).gather(-1, ids)
    if getattr(module, "norm_topk_prob", False):
        w = w / w.sum(dim=-1, keepdim=True)
    w = w * getattr(module, "routed_scaling_factor", 1.0)
    return logits, w.to(output[1].dtype), ids


def hf_forward(model_dir: str, tokens_BxL: np.ndarray, attention_mask=None, position_ids=None, replay_XxBxLxK=None):
    """fp32 torch reference: (logits [B, L, V], selected expert ids per MoE layer [X, B, L, k] sorted
    along k — DeepSeek's router returns them unsorted). replay_XxBxLxK: expert ids each MoE layer uses instead of
    its router's (routing replay; the returned ids are then these, sorted)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():  # own, aligned memory: a tensor memory-mapped at another offset of its file can take another
        for t in model.parameters():  # CPU kernel path (seen on AMD EPYC: 1-ulp logits apart for identical weights)
            t.data = t.data.clone()
    captured = []

    def hook(module, _inputs, output):
        if replay_XxBxLxK is not None:
            output = _replayed_router_output(module, output, replay_XxBxLxK[len(captured)])
        captured.append(output[2].detach().numpy())
        return output

    handles = [
        m.register_forward_hook(hook) for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")
    ]
    kwargs = {}
    if attention_mask is not None:
        kwargs["attention_mask"] = torch.as_tensor(attention_mask)
    if position_ids is not None:
        kwargs["position_ids"] = torch.as_tensor(position_ids)
    with torch.no_grad():
        logits = model(torch.as_tensor(tokens_BxL), **kwargs).logits.numpy()
    for h in handles:
        h.remove()
    b, l = tokens_BxL.shape
    routing = np.sort(np.stack([c.reshape(b, l, -1) for c in captured]), axis=-1) if captured else None
    return logits, routing


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def perturbed_export(model_dir, out_dir, seed: int) -> None:
    """The model at model_dir (fp32) with every parameter moved by 0.05 x N(0, 1) (keys from `seed`), saved to
    out_dir: new weights for a server's UpdateWeights, as a trainer's publish."""
    import flax.nnx as nnx
    import jax

    from cisjax.models import hf_io

    model, _, hf = hf_io.load(model_dir, dtype="float32", param_dtype="float32")
    leaves, tree = jax.tree.flatten(nnx.state(model, nnx.Param))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    nnx.update(
        model, jax.tree.unflatten(tree, [x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
    )
    hf_io.save(model, out_dir, hf)
