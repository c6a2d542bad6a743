"""The demo's model: a tiny Qwen2-MoE config within vLLM's CPU constraints, and its random init written to disk."""

from __future__ import annotations

from pathlib import Path

MAX_POSITIONS = 512  # prompt (~90 tokens) + response, with room for the RL phase's max_new_tokens


def model_config(vocab_size: int, eos_id: int, pad_id: int) -> dict:
    """A tiny Qwen1.5-MoE layout within vLLM's CPU constraints: hidden and expert sizes multiples of 32, head_dim 32
    (2 heads, 1 kv head), 8 experts top-2 plus the sigmoid-gated shared expert, untied head."""
    return dict(
        architectures=["Qwen2MoeForCausalLM"],
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        initializer_range=0.02,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )


def write_random_model(out: Path, tokenizer, seed: int) -> dict:
    """A randomly initialised transformers Qwen2MoeForCausalLM (fp32) and the tokenizer, saved in `out`."""
    import torch  # lazy: torch
    import transformers  # lazy: torch

    kwargs = model_config(len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**kwargs)).eval()
    model.to(torch.float32).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return kwargs
