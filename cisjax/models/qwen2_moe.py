"""Qwen2-MoE (Qwen1.5-MoE-A2.7B), with the semantics of transformers' Qwen2MoeForCausalLM."""

from __future__ import annotations

import dataclasses

import flax.nnx as nnx
import jax

from cisjax import sharding
from cisjax.models import decode_attention, hf_config
from cisjax.models.attention import Segments, attention
from cisjax.models.layers import MLP, RMSNorm, apply_rope, dense, param, rope_cos_sin, rope_frequencies
from cisjax.models.moe import MoE
from cisjax.models.transformer import CausalLM, decoder_layers

ARCHITECTURE = "Qwen2MoeForCausalLM"


@dataclasses.dataclass(frozen=True)
class Config(hf_config.DecoderConfig):
    qkv_bias: bool = True
    # MoE
    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple = ()

    @classmethod
    def from_hf(cls, hf: dict, **runtime) -> Config:
        r = hf_config.Reader(hf, ARCHITECTURE)
        if r.bool("use_sliding_window", False):
            raise ValueError(f"{ARCHITECTURE}: use_sliding_window=true is not supported")
        return cls(
            **r.decoder_fields(),
            qkv_bias=r.bool("qkv_bias", True),
            num_experts=r.num_experts(),
            num_experts_per_tok=r.int("num_experts_per_tok"),
            moe_intermediate_size=r.int("moe_intermediate_size"),
            shared_expert_intermediate_size=r.int("shared_expert_intermediate_size"),
            norm_topk_prob=r.bool("norm_topk_prob", False),
            decoder_sparse_step=r.int("decoder_sparse_step", 1),
            mlp_only_layers=r.int_list("mlp_only_layers"),
            **runtime,
        )

    def is_moe_layer(self, i: int) -> bool:
        return i not in self.mlp_only_layers and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0


class Attention(nnx.Module):
    """Grouped-query attention with optional q/k/v bias and rotate-half rotary."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs, qk_norm: bool = False):
        d, n, kv, h, pd = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.param_dtype,
        )
        self.cfg, self.qk_norm = cfg, qk_norm
        self.wq_DxQ = param(rngs, (d, n * h), ("embed", "heads"), pd)
        self.wk_DxK = param(rngs, (d, kv * h), ("embed", "kv_heads"), pd)
        self.wv_DxK = param(rngs, (d, kv * h), ("embed", "kv_heads"), pd)
        self.wo_QxD = param(rngs, (n * h, d), ("heads", "embed"), pd)
        if cfg.qkv_bias:
            zeros = jax.nn.initializers.zeros
            self.bq_Q = param(rngs, (n * h,), ("heads",), pd, zeros)
            self.bk_K = param(rngs, (kv * h,), ("kv_heads",), pd, zeros)
            self.bv_K = param(rngs, (kv * h,), ("kv_heads",), pd, zeros)
        if qk_norm:  # Qwen3: RMSNorm over each head's dims, before rotary
            self.q_norm = RMSNorm(h, cfg.rms_norm_eps, param_dtype=pd, axes=("head_dim",))
            self.k_norm = RMSNorm(h, cfg.rms_norm_eps, param_dtype=pd, axes=("head_dim",))

    def cache_shapes(self) -> tuple[tuple, ...]:
        """Per row, the shapes of what a KV cache keeps (kv), None where the slots go: keys and values, [K, S, H]
        each (heads-major: a decode step's batched matmuls over (row, head) read them in place)."""
        return ((self.cfg.num_key_value_heads, None, self.cfg.head_dim),) * 2

    def reads_stacked_cache(self) -> bool:
        """Whether a decode step's kernel reads its layer of the stack's cache in place (stacked.LayerOf:
        decode_attention.reads_stack)."""
        return decode_attention.reads_stack(self.cfg.attention_impl, self.cfg.dtype)

    def decode_needs_phases(self) -> bool:
        """Whether the sampler's decode should bound the slots a step attends over (decode_attention.skips_phases:
        not with the GPU's kernel, which stops at each row's last written slot itself)."""
        return not decode_attention.skips_phases(self.cfg.attention_impl, self.cfg.dtype)

    def _rope(self, positions_BxL):
        h = self.cfg.head_dim
        inv_freq, rope_scale = rope_frequencies(dict(self.cfg.rope), h, self.cfg.max_position_embeddings)
        return rope_cos_sin(positions_BxL, inv_freq, rope_scale, self.cfg.dtype)

    def kv(self, x_BxLxD, positions_BxL):
        """What a KV cache keeps of these tokens: (keys [B, L, K, H], rotary applied; values [B, L, K, H])."""
        cfg, dt = self.cfg, self.cfg.dtype
        b, l, _ = x_BxLxD.shape
        bias = lambda name: getattr(self, name) if cfg.qkv_bias else None  # noqa: E731
        k_BxLxKxH = dense(x_BxLxD, self.wk_DxK, dt, bias("bk_K")).reshape(b, l, -1, cfg.head_dim)
        v_BxLxKxH = dense(x_BxLxD, self.wv_DxK, dt, bias("bv_K")).reshape(b, l, -1, cfg.head_dim)
        if self.qk_norm:
            k_BxLxKxH = self.k_norm(k_BxLxKxH)
        cos, sin = self._rope(positions_BxL)
        return apply_rope(k_BxLxKxH, cos, sin), v_BxLxKxH

    def query(self, x_BxLxD):
        """These tokens' queries [B, L, N, H], before rotary."""
        cfg = self.cfg
        b, l, _ = x_BxLxD.shape
        q_BxLxQ = dense(x_BxLxD, self.wq_DxQ, cfg.dtype, self.bq_Q if cfg.qkv_bias else None)
        q_BxLxNxH = q_BxLxQ.reshape(b, l, -1, cfg.head_dim)
        return self.q_norm(q_BxLxNxH) if self.qk_norm else q_BxLxNxH

    def attend(self, q_BxLxNxH, positions_BxL, kv, mask):
        """Queries (query()) over `kv` under `mask`: kv() of the same tokens (keys, values [B, S, K, H]) under their
        attention.Segments, or a cache's arrays ([B, K, S, H], cache_shapes()) under its [B, L, S] bool mask."""
        cfg, dt = self.cfg, self.cfg.dtype
        b, l = positions_BxL.shape
        cos, sin = self._rope(positions_BxL)
        q_BxLxNxH = sharding.constrain(apply_rope(q_BxLxNxH, cos, sin), ("batch", "length", "act_heads", None))
        if isinstance(mask, Segments):
            o_BxLxNxH = attention(q_BxLxNxH, *kv, mask, cfg.head_dim**-0.5, cfg.attention_impl)
        else:
            o_BxLxNxH = decode_attention.attend(q_BxLxNxH, *kv, mask, cfg.head_dim**-0.5, cfg.attention_impl)
        return dense(o_BxLxNxH.reshape(b, l, -1), self.wo_QxD, dt)

    def __call__(self, x_BxLxD, positions_BxL, mask):
        q_BxLxNxH = self.query(x_BxLxD)  # first: the backward sums x's gradients in the order q, k, v
        return self.attend(q_BxLxNxH, positions_BxL, self.kv(x_BxLxD, positions_BxL), mask)


class SparseMoeBlock(nnx.Module):
    """Routed experts + a shared expert scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        d, pd, dt = cfg.hidden_size, cfg.param_dtype, cfg.dtype
        self.dtype = dt
        self.moe = MoE(
            d,
            cfg.moe_intermediate_size,
            cfg.num_experts,
            cfg.num_experts_per_tok,
            rngs=rngs,
            param_dtype=pd,
            dtype=dt,
            norm_topk_prob=cfg.norm_topk_prob,
            router_dtype=cfg.router_dtype,
            impl=cfg.moe_impl,
            tile=cfg.moe_tile,
        )
        self.shared = MLP(d, cfg.shared_expert_intermediate_size, rngs=rngs, param_dtype=pd, dtype=dt)
        self.shared_gate_Dx1 = param(rngs, (d, 1), ("embed", None), pd)

    def __call__(self, x_BxLxD, replay_BxLxK=None):
        y_BxLxD, ids_BxLxK = self.moe(x_BxLxD, replay_BxLxK)
        gate_BxLx1 = jax.nn.sigmoid(dense(x_BxLxD, self.shared_gate_Dx1, self.dtype))
        return y_BxLxD + gate_BxLx1 * self.shared(x_BxLxD), ids_BxLxK


def build(cfg: Config, rngs: nnx.Rngs) -> CausalLM:
    return CausalLM(cfg, decoder_layers(cfg, rngs, attention=Attention, moe_block=SparseMoeBlock), rngs=rngs)


# HF tensor name -> our parameter path; kinds: "id" (same layout), "T" (HF [out, in] -> [in, out]),
# "experts_T" (per-expert HF tensors {e} stacked into [E, in, out]). Rows whose parameter does not
# exist in a given model (dense vs MoE layers, tied head, no bias) are dropped by hf_io.
ATTENTION_WEIGHTS = (
    ("model.layers.{i}.input_layernorm.weight", "layers.{i}.attn_norm.weight", "id"),
    ("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.mlp_norm.weight", "id"),
    ("model.layers.{i}.self_attn.q_proj.weight", "layers.{i}.attn.wq_DxQ", "T"),
    ("model.layers.{i}.self_attn.k_proj.weight", "layers.{i}.attn.wk_DxK", "T"),
    ("model.layers.{i}.self_attn.v_proj.weight", "layers.{i}.attn.wv_DxK", "T"),
    ("model.layers.{i}.self_attn.o_proj.weight", "layers.{i}.attn.wo_QxD", "T"),
    ("model.layers.{i}.self_attn.q_proj.bias", "layers.{i}.attn.bq_Q", "id"),
    ("model.layers.{i}.self_attn.k_proj.bias", "layers.{i}.attn.bk_K", "id"),
    ("model.layers.{i}.self_attn.v_proj.bias", "layers.{i}.attn.bv_K", "id"),
    ("model.layers.{i}.self_attn.q_norm.weight", "layers.{i}.attn.q_norm.weight", "id"),
    ("model.layers.{i}.self_attn.k_norm.weight", "layers.{i}.attn.k_norm.weight", "id"),
    ("model.layers.{i}.mlp.gate_proj.weight", "layers.{i}.mlp.wg_DxF", "T"),
    ("model.layers.{i}.mlp.up_proj.weight", "layers.{i}.mlp.wu_DxF", "T"),
    ("model.layers.{i}.mlp.down_proj.weight", "layers.{i}.mlp.wo_FxD", "T"),
)
EXPERT_WEIGHTS = (
    ("model.layers.{i}.mlp.gate.weight", "layers.{i}.mlp.moe.router_DxE", "T"),
    ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight", "layers.{i}.mlp.moe.wg_ExDxF", "experts_T"),
    ("model.layers.{i}.mlp.experts.{e}.up_proj.weight", "layers.{i}.mlp.moe.wu_ExDxF", "experts_T"),
    ("model.layers.{i}.mlp.experts.{e}.down_proj.weight", "layers.{i}.mlp.moe.wo_ExFxD", "experts_T"),
)
WEIGHTS = (
    hf_config.LM_WEIGHTS
    + ATTENTION_WEIGHTS
    + EXPERT_WEIGHTS
    + (
        ("model.layers.{i}.mlp.shared_expert.gate_proj.weight", "layers.{i}.mlp.shared.wg_DxF", "T"),
        ("model.layers.{i}.mlp.shared_expert.up_proj.weight", "layers.{i}.mlp.shared.wu_DxF", "T"),
        ("model.layers.{i}.mlp.shared_expert.down_proj.weight", "layers.{i}.mlp.shared.wo_FxD", "T"),
        ("model.layers.{i}.mlp.shared_expert_gate.weight", "layers.{i}.mlp.shared_gate_Dx1", "T"),
    )
)
