"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B), with the semantics of transformers' Qwen3MoeForCausalLM."""

from __future__ import annotations

import dataclasses

import flax.nnx as nnx
import jax

from cisjax.models import hf_config, qwen2_moe
from cisjax.models.layers import param
from cisjax.models.moe import MoE
from cisjax.models.transformer import CausalLM, decoder_layers

ARCHITECTURE = "Qwen3MoeForCausalLM"


@dataclasses.dataclass(frozen=True)
class Config(hf_config.DecoderConfig):
    attention_bias: bool = False  # bias on q/k/v *and* o_proj
    # MoE (no shared expert)
    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple = ()

    @property
    def qkv_bias(self) -> bool:  # read by the shared qwen2_moe.Attention
        return self.attention_bias

    @classmethod
    def from_hf(cls, hf: dict, **runtime) -> Config:
        r = hf_config.Reader(hf, ARCHITECTURE)
        window = hf.get("sliding_window", 4096)  # Qwen3MoeConfig: used on every layer iff use_sliding_window
        if r.bool("use_sliding_window", False) and window is not None:
            raise ValueError(f"{ARCHITECTURE}: use_sliding_window=true (sliding_window={window}) is not supported")
        return cls(
            **r.decoder_fields(kv_heads=4),  # Qwen3MoeConfig's default
            attention_bias=r.bool("attention_bias", False),
            num_experts=r.num_experts(),
            num_experts_per_tok=r.int("num_experts_per_tok"),
            moe_intermediate_size=r.int("moe_intermediate_size"),
            norm_topk_prob=r.bool("norm_topk_prob", False),
            decoder_sparse_step=r.int("decoder_sparse_step", 1),
            mlp_only_layers=r.int_list("mlp_only_layers"),
            **runtime,
        )

    def is_moe_layer(self, i: int) -> bool:
        return i not in self.mlp_only_layers and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0


class Attention(qwen2_moe.Attention):
    """Qwen2-MoE attention with per-head q/k RMSNorm; `attention_bias` also biases o_proj."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs, qk_norm=True)
        if cfg.attention_bias:
            self.bo_D = param(rngs, (cfg.hidden_size,), ("embed",), cfg.param_dtype, jax.nn.initializers.zeros)

    def attend(self, q_BxLxNxH, positions_BxL, kv, mask_BxLxS):
        y_BxLxD = super().attend(q_BxLxNxH, positions_BxL, kv, mask_BxLxS)
        if self.cfg.attention_bias:
            y_BxLxD = y_BxLxD + self.bo_D[...].astype(self.cfg.dtype)
        return y_BxLxD


class SparseMoeBlock(nnx.Module):
    """Routed SwiGLU experts only: fp32 softmax, top-k, optional renormalisation (no shared expert)."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.moe = MoE(
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            cfg.num_experts,
            cfg.num_experts_per_tok,
            rngs=rngs,
            param_dtype=cfg.param_dtype,
            dtype=cfg.dtype,
            norm_topk_prob=cfg.norm_topk_prob,
            router_dtype=cfg.router_dtype,
            impl=cfg.moe_impl,
            tile=cfg.moe_tile,
        )

    def __call__(self, x_BxLxD, replay_BxLxK=None):
        return self.moe(x_BxLxD, replay_BxLxK)  # (y [B, L, D], expert ids [B, L, k])


def build(cfg: Config, rngs: nnx.Rngs) -> CausalLM:
    return CausalLM(cfg, decoder_layers(cfg, rngs, attention=Attention, moe_block=SparseMoeBlock), rngs=rngs)


# Same names as Qwen2-MoE minus the shared expert, plus the optional o_proj bias (see qwen2_moe.WEIGHTS).
WEIGHTS = (
    hf_config.LM_WEIGHTS
    + qwen2_moe.ATTENTION_WEIGHTS
    + qwen2_moe.EXPERT_WEIGHTS
    + (("model.layers.{i}.self_attn.o_proj.bias", "layers.{i}.attn.bo_D", "id"),)
)
