"""The benches' random Qwen2-MoE: its command-line flags, its transformers config, and a save of random weights."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np
import transformers


@dataclass(frozen=True)
class Sizes:
    """A bench's defaults for the model flags, in this order."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    experts: int
    top_k: int
    moe_intermediate: int
    shared_intermediate: int
    vocab: int


STOP_TOKENS = 8  # --lengths varied: the vocabulary's last tokens, made likelier, are the samples' stop tokens
# the flags of the model's sizes that must be positive
SIZE_FLAGS = ("hidden", "layers", "heads", "kv_heads", "experts", "top_k", "vocab")


def add_args(group: argparse._ActionsContainer, sizes: Sizes) -> None:
    """The model flags, with this bench's defaults."""
    group.add_argument("--hidden", type=int, default=sizes.hidden, help="model width (default: %(default)s)")
    group.add_argument(
        "--layers", type=int, default=sizes.layers, help="decoder layers, all MoE (default: %(default)s)"
    )
    group.add_argument("--heads", type=int, default=sizes.heads, help="attention heads (default: %(default)s)")
    group.add_argument("--kv-heads", type=int, default=sizes.kv_heads, help="key/value heads (default: %(default)s)")
    group.add_argument("--experts", type=int, default=sizes.experts, help="routed experts (default: %(default)s)")
    group.add_argument("--top-k", type=int, default=sizes.top_k, help="experts per token (default: %(default)s)")
    group.add_argument(
        "--moe-intermediate",
        type=int,
        default=sizes.moe_intermediate,
        help="routed expert width (default: %(default)s)",
    )
    group.add_argument(
        "--shared-intermediate",
        type=int,
        default=sizes.shared_intermediate,
        help="shared expert width (default: %(default)s)",
    )
    group.add_argument("--vocab", type=int, default=sizes.vocab, help="vocabulary (default: %(default)s)")


def hf_config(args: argparse.Namespace, *, max_positions: int) -> dict:
    """transformers' Qwen2MoeConfig of the flags as a config.json dict. Every layer is MoE, so intermediate_size (the
    dense MLP's width) is never used; it is set to the shared expert's."""
    cfg = transformers.Qwen2MoeConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.shared_intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.moe_intermediate,
        shared_expert_intermediate_size=args.shared_intermediate,
        norm_topk_prob=False,
        max_position_embeddings=max_positions,
        # wider than transformers' 0.02: a random model's logits spread out, so sampling and logprobs are not flat
        initializer_range=0.05,
        tie_word_embeddings=False,
    )
    hf = cfg.to_dict()
    hf["architectures"] = ["Qwen2MoeForCausalLM"]
    return hf


def save_random(
    args: argparse.Namespace, path, *, max_positions: int, dtype: str = "float32", stop_hazard: float = 0.0
) -> dict:
    """Random weights (torch seeded with args.seed) saved by transformers in `dtype` to `path`; returns the config.
    With a `stop_hazard`, the vocabulary's last STOP_TOKENS tokens are made likelier (stop_columns)."""
    import torch  # lazy: torch

    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(args.seed)
    hf = hf_config(args, max_positions=max_positions)
    model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**hf))
    if stop_hazard:
        with torch.no_grad():
            w_VxD = model.lm_head.weight
            w_VxD[-STOP_TOKENS:] = torch.from_numpy(stop_columns(w_VxD.numpy(), stop_hazard))
    model.to(getattr(torch, dtype)).save_pretrained(path)
    return hf


def stop_columns(w_VxD: np.ndarray, hazard: float) -> np.ndarray:
    """The unembedding rows of the last STOP_TOKENS tokens rescaled so that, at temperature 1, one of them comes out
    with about `hazard` chance per token. A logit h.w with the final norm's output h (norm about sqrt(D), any
    direction) is about normal with the variance |w|^2, so a token's mean weight is exp(|w|^2 / 2): the stop rows get
    the norm s with k exp(s^2 / 2) = hazard (V - k) exp(sigma^2 / 2), sigma^2 the other rows' mean squared norm."""
    k = STOP_TOKENS
    rest_sq = float(np.mean(np.sum(w_VxD[:-k].astype(np.float64) ** 2, axis=1)))
    target = np.sqrt(rest_sq + 2.0 * np.log(hazard * (len(w_VxD) - k) / k))
    rows = w_VxD[-k:].astype(np.float64)
    return (rows * (target / np.linalg.norm(rows, axis=1, keepdims=True))).astype(w_VxD.dtype)
