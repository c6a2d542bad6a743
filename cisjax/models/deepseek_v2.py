"""DeepSeek-V2 (MLA attention, shared + routed experts), with the semantics of transformers' DeepseekV2ForCausalLM."""

from __future__ import annotations

import dataclasses
import math

import flax.nnx as nnx
import jax
import jax.numpy as jnp

from cisjax import sharding
from cisjax.models import hf_config, qwen2_moe
from cisjax.models.attention import Segments, attention
from cisjax.models.layers import MLP, RMSNorm, apply_rope, dense, param, rope_cos_sin, rope_frequencies
from cisjax.models.moe import MoE
from cisjax.models.transformer import CausalLM, decoder_layers

ARCHITECTURE = "DeepseekV2ForCausalLM"
TOPK_METHODS = ("greedy", "group_limited_greedy")
# The latent norms (q_a_layernorm, kv_a_layernorm) are built without an eps argument in HF, so they
# use the RMSNorm default, not config.rms_norm_eps.
LATENT_NORM_EPS = 1e-6

_ABSENT = object()


@dataclasses.dataclass(frozen=True)
class Config(hf_config.DecoderConfig):
    # (DecoderConfig: intermediate_size is the dense MLP of the first `first_k_dense_replace` layers;
    # head_dim is the rotary part, qk_rope_head_dim, as HF sets it; kv heads == heads.)
    max_position_embeddings: int = 2048
    attention_bias: bool = False
    # multi-head latent attention
    q_lora_rank: int | None = 1536  # None: plain q_proj
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # MoE
    first_k_dense_replace: int = 0
    num_experts: int = 64
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 1407
    n_shared_experts: int = 2
    topk_method: str = "greedy"
    n_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0

    @classmethod
    def from_hf(cls, hf: dict, **runtime) -> Config:
        """Missing DeepSeek-specific fields take DeepseekV2Config's defaults (as HF does). HF ignores
        `norm_topk_prob` and `moe_layer_freq` for this architecture, and so do we."""
        r = hf_config.Reader(hf, ARCHITECTURE)
        d = Config()
        heads = r.int("num_attention_heads")
        if r.int("num_key_value_heads", heads) != heads:
            raise hf_config.CheckpointError(
                f"{ARCHITECTURE}: num_key_value_heads must equal num_attention_heads ({heads}), as in HF"
            )
        if r.bool("mlp_bias", False):
            raise ValueError(f"{ARCHITECTURE}: mlp_bias=true is not supported")
        q_lora = hf.get("q_lora_rank", _ABSENT)  # absent -> HF default; explicit null -> no q LoRA
        q_lora = d.q_lora_rank if q_lora is _ABSENT else (None if q_lora is None else r.int("q_lora_rank"))
        has_experts = any(hf.get(k) is not None for k in ("num_local_experts", "num_experts", "n_routed_experts"))
        rope_dim = r.int("qk_rope_head_dim", d.qk_rope_head_dim)
        cfg = cls(
            **{**r.decoder_fields(max_positions=d.max_position_embeddings), "head_dim": rope_dim},
            attention_bias=r.bool("attention_bias", False),
            q_lora_rank=q_lora,
            kv_lora_rank=r.int("kv_lora_rank", d.kv_lora_rank),
            qk_nope_head_dim=r.int("qk_nope_head_dim", d.qk_nope_head_dim),
            qk_rope_head_dim=rope_dim,
            v_head_dim=r.int("v_head_dim", d.v_head_dim),
            first_k_dense_replace=r.int("first_k_dense_replace", d.first_k_dense_replace),
            num_experts=r.num_experts() if has_experts else d.num_experts,
            num_experts_per_tok=r.int("num_experts_per_tok"),
            moe_intermediate_size=r.int("moe_intermediate_size", d.moe_intermediate_size),
            n_shared_experts=r.int("n_shared_experts", d.n_shared_experts),
            topk_method=r.get("topk_method", d.topk_method),
            n_group=r.int("n_group") if r.get("n_group") is not None else None,
            topk_group=r.int("topk_group") if r.get("topk_group") is not None else None,
            routed_scaling_factor=r.float("routed_scaling_factor", d.routed_scaling_factor),
            **runtime,
        )
        if cfg.topk_method not in TOPK_METHODS:
            raise ValueError(f"{ARCHITECTURE}: topk_method {cfg.topk_method!r} is not supported; one of {TOPK_METHODS}")
        if cfg.topk_method == "group_limited_greedy":
            if not cfg.n_group or not cfg.topk_group or cfg.num_experts % cfg.n_group:
                raise hf_config.CheckpointError(
                    f"{ARCHITECTURE}: group_limited_greedy needs n_group dividing n_routed_experts and topk_group"
                )
        return cfg

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def attention_dims(self) -> tuple[int, int, int]:
        return self.num_attention_heads, self.qk_head_dim, self.v_head_dim

    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 for scaled rope (HF yarn_apply_mscale)."""
        scale = self.qk_head_dim**-0.5
        rope = dict(self.rope)
        if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
            factor = rope["factor"]
            m = 1.0 if factor <= 1 else 0.1 * rope["mscale_all_dim"] * math.log(factor) + 1.0
            scale = scale * m * m
        return scale


def absorbs(l: int, s: int, n: int, nope: int, rope: int, c: int, v: int) -> bool:
    """Whether L queries over S cached slots cost fewer FLOPs absorbed (absorbed_attention) than with each slot's
    keys and values expanded from its latent: expanded, S x C x N x (nope + v) to expand and L x S x N x (nope + rope
    + v) to attend; absorbed, L x N x C x (nope + v) to move the queries in and the outputs out, L x S x N x (2 C +
    rope) to attend. One decode token over S slots is absorbed; a prefill of L = S tokens is not (C > nope)."""
    expanded = s * c * n * (nope + v) + l * s * n * (nope + rope + v)
    absorbed = l * n * c * (nope + v) + l * s * n * (2 * c + rope)
    return absorbed < expanded


def absorbed_attention(
    q_nope_BxLxNxE, q_pe_BxLxNxP, latent_BxSxC, k_pe_BxSxP, w_uk_CxNxE, w_uv_CxNxV, mask_BxLxS, scale: float
) -> jax.Array:
    """MLA in the latent space (DeepSeek-V2's inference form) -> [B, L, N, V]. The per-head key of a slot is
    latent @ W_UK, so q_nope . k_nope = (q_nope @ W_UK^T) . latent: the queries move into the latent space and
    attend over the cached latents themselves, plus the shared rotary key; the output, a mix of latents, is mapped
    out by W_UV. Equal to attending over the expanded keys and values in exact arithmetic; scores and softmax in
    fp32, probabilities in the latent's dtype (as einsum_attention)."""
    q_BxLxNxC = jnp.einsum("blne,cne->blnc", q_nope_BxLxNxE, w_uk_CxNxE)
    q_BxLxNxC = sharding.constrain(q_BxLxNxC, ("batch", "length", "act_heads", None))
    s_BxNxLxS = jnp.einsum("blnc,bsc->bnls", q_BxLxNxC, latent_BxSxC, preferred_element_type=jnp.float32)
    s_BxNxLxS += jnp.einsum("blnp,bsp->bnls", q_pe_BxLxNxP, k_pe_BxSxP, preferred_element_type=jnp.float32)
    s_BxNxLxS = jnp.where(mask_BxLxS[:, None], s_BxNxLxS * scale, jnp.finfo(jnp.float32).min)
    p_BxNxLxS = jax.nn.softmax(s_BxNxLxS, axis=-1).astype(latent_BxSxC.dtype)
    o_BxLxNxC = jnp.einsum("bnls,bsc->blnc", p_BxNxLxS, latent_BxSxC)
    return jnp.einsum("blnc,cnv->blnv", o_BxLxNxC, w_uv_CxNxV)


class MLAttention(nnx.Module):
    """Multi-head latent attention: q (optionally through a normed LoRA bottleneck), keys/values
    expanded from a normed kv latent, plus a decoupled rope part (interleaved pairs) whose key is
    shared by all heads.

    Shape letters: N heads, R q_lora_rank, C kv_lora_rank, P qk_rope_head_dim, Q = N*(nope+P),
    A = C+P, K = N*(nope+v), V = N*v.
    """

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        d, n, pd = cfg.hidden_size, cfg.num_attention_heads, cfg.param_dtype
        c, p = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        zeros = jax.nn.initializers.zeros
        self.cfg = cfg
        if cfg.q_lora_rank is None:
            self.wq_DxQ = param(rngs, (d, n * cfg.qk_head_dim), ("embed", "heads"), pd)
        else:
            r = cfg.q_lora_rank
            self.wq_a_DxR = param(rngs, (d, r), ("embed", "q_lora"), pd)
            if cfg.attention_bias:
                self.bq_a_R = param(rngs, (r,), ("q_lora",), pd, zeros)
            self.q_a_norm = RMSNorm(r, LATENT_NORM_EPS, param_dtype=pd, axes=("q_lora",))
            self.wq_b_RxQ = param(rngs, (r, n * cfg.qk_head_dim), ("q_lora", "heads"), pd)
        self.wkv_a_DxA = param(rngs, (d, c + p), ("embed", "kv_lora"), pd)
        if cfg.attention_bias:
            self.bkv_a_A = param(rngs, (c + p,), ("kv_lora",), pd, zeros)
        self.kv_a_norm = RMSNorm(c, LATENT_NORM_EPS, param_dtype=pd, axes=("kv_lora",))
        self.wkv_b_CxK = param(rngs, (c, n * (cfg.qk_nope_head_dim + cfg.v_head_dim)), ("kv_lora", "heads"), pd)
        self.wo_VxD = param(rngs, (n * cfg.v_head_dim, d), ("heads", "embed"), pd)
        if cfg.attention_bias:
            self.bo_D = param(rngs, (d,), ("embed",), pd, zeros)

    def cache_shapes(self) -> tuple[tuple, ...]:
        """Per row, the shapes of what a KV cache keeps (kv), None where the slots go: the normed latent [S, C] and
        the rotary key shared by the heads [S, 1, P] (the per-head keys and values are re-expanded from the latent, as
        in training, or the queries absorbed into the latent space)."""
        return ((None, self.cfg.kv_lora_rank), (None, 1, self.cfg.qk_rope_head_dim))

    def decode_needs_phases(self) -> bool:
        """A decode step's absorbed attention reads every slot it is given (masked): the sampler bounds them."""
        return True

    def _rope(self, positions_BxL):
        p = self.cfg.qk_rope_head_dim
        inv_freq, rope_scale = rope_frequencies(dict(self.cfg.rope), p, self.cfg.max_position_embeddings)
        return rope_cos_sin(positions_BxL, inv_freq, rope_scale, jnp.float32)

    def kv(self, x_BxLxD, positions_BxL):
        """What a KV cache keeps of these tokens: (the normed kv latent [B, L, C], the rotary key [B, L, 1, P])."""
        cfg, dt = self.cfg, self.cfg.dtype
        c = cfg.kv_lora_rank
        bias = lambda name: getattr(self, name) if cfg.attention_bias else None  # noqa: E731
        kv_BxLxA = dense(x_BxLxD, self.wkv_a_DxA, dt, bias("bkv_a_A"))
        latent_BxLxC, k_pe_BxLx1xP = self.kv_a_norm(kv_BxLxA[..., :c]), kv_BxLxA[..., None, c:]
        # Rotary in fp32 (HF: complex multiply of the float-cast pairs, then cast back).
        cos, sin = self._rope(positions_BxL)
        return latent_BxLxC, apply_rope(k_pe_BxLx1xP.astype(jnp.float32), cos, sin, interleaved=True).astype(dt)

    def query(self, x_BxLxD):
        """These tokens' queries [B, L, N, nope + P], before rotary."""
        cfg, dt = self.cfg, self.cfg.dtype
        b, l, _ = x_BxLxD.shape
        if cfg.q_lora_rank is None:
            q_BxLxQ = dense(x_BxLxD, self.wq_DxQ, dt)
        else:
            bias = self.bq_a_R if cfg.attention_bias else None
            q_BxLxQ = dense(self.q_a_norm(dense(x_BxLxD, self.wq_a_DxR, dt, bias)), self.wq_b_RxQ, dt)
        return q_BxLxQ.reshape(b, l, -1, cfg.qk_head_dim)

    def attend(self, q_BxLxNxH, positions_BxL, kv, mask):
        """Queries (query()) over `kv` (latent [B, S, C], rotary key [B, S, 1, P]: kv() of the same tokens, or a
        cache's). A full-sequence pass (mask: Segments) expands the keys and values per head from the latent and runs
        the platform's attention kernel; a KV-cache pass (mask: [B, L, S]) attends in the latent space instead
        (absorbed_attention) where that costs fewer FLOPs (absorbs: decoding, a few new tokens over many slots)."""
        cfg, dt = self.cfg, self.cfg.dtype
        b, l = positions_BxL.shape
        nope, p = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        q_nope_BxLxNxE, q_pe_BxLxNxP = q_BxLxNxH[..., :nope], q_BxLxNxH[..., nope:]
        cos, sin = self._rope(positions_BxL)
        q_pe_BxLxNxP = apply_rope(q_pe_BxLxNxP.astype(jnp.float32), cos, sin, interleaved=True).astype(dt)

        latent_BxSxC, k_pe_BxSx1xP = kv
        s = latent_BxSxC.shape[1]
        n = q_BxLxNxH.shape[2]
        if not isinstance(mask, Segments) and absorbs(l, s, n, nope, p, cfg.kv_lora_rank, cfg.v_head_dim):
            w_CxNxW = self.wkv_b_CxK[...].reshape(cfg.kv_lora_rank, n, nope + cfg.v_head_dim).astype(dt)
            o_BxLxNxV = absorbed_attention(
                q_nope_BxLxNxE.astype(dt),
                q_pe_BxLxNxP,
                latent_BxSxC.astype(dt),
                k_pe_BxSx1xP[:, :, 0].astype(dt),
                w_CxNxW[..., :nope],
                w_CxNxW[..., nope:],
                mask,
                cfg.softmax_scale(),
            )
            return dense(o_BxLxNxV.reshape(b, l, -1), self.wo_VxD, dt, self.bo_D if cfg.attention_bias else None)
        kv_BxSxNxW = dense(latent_BxSxC, self.wkv_b_CxK, dt).reshape(b, s, -1, nope + cfg.v_head_dim)
        k_nope_BxSxNxE, v_BxSxNxV = kv_BxSxNxW[..., :nope], kv_BxSxNxW[..., nope:]

        q_BxLxNxH = jnp.concatenate([q_nope_BxLxNxE, q_pe_BxLxNxP], axis=-1)
        k_BxSxNxH = jnp.concatenate([k_nope_BxSxNxE, jnp.broadcast_to(k_pe_BxSx1xP, (b, s, n, p))], axis=-1)
        q_BxLxNxH = sharding.constrain(q_BxLxNxH, ("batch", "length", "act_heads", None))
        o_BxLxNxV = attention(q_BxLxNxH, k_BxSxNxH, v_BxSxNxV, mask, cfg.softmax_scale(), cfg.attention_impl)
        return dense(o_BxLxNxV.reshape(b, l, -1), self.wo_VxD, dt, self.bo_D if cfg.attention_bias else None)

    def __call__(self, x_BxLxD, positions_BxL, mask):
        q_BxLxNxH = self.query(x_BxLxD)  # first: the backward sums x's gradients in the order q, kv
        return self.attend(q_BxLxNxH, positions_BxL, self.kv(x_BxLxD, positions_BxL), mask)


class MoeBlock(nnx.Module):
    """Routed experts (softmax top-k, greedy or group-limited, scaled) + ungated shared experts."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        d, pd, dt = cfg.hidden_size, cfg.param_dtype, cfg.dtype
        self.moe = MoE(
            d,
            cfg.moe_intermediate_size,
            cfg.num_experts,
            cfg.num_experts_per_tok,
            rngs=rngs,
            param_dtype=pd,
            dtype=dt,
            method=cfg.topk_method,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            scaling=cfg.routed_scaling_factor,
            router_dtype=cfg.router_dtype,
            impl=cfg.moe_impl,
            tile=cfg.moe_tile,
        )
        self.has_shared = bool(cfg.n_shared_experts)
        if self.has_shared:
            self.shared = MLP(d, cfg.moe_intermediate_size * cfg.n_shared_experts, rngs=rngs, param_dtype=pd, dtype=dt)

    def __call__(self, x_BxLxD, replay_BxLxK=None):
        y_BxLxD, ids_BxLxK = self.moe(x_BxLxD, replay_BxLxK)
        if self.has_shared:
            y_BxLxD = y_BxLxD + self.shared(x_BxLxD)
        return y_BxLxD, ids_BxLxK


def build(cfg: Config, rngs: nnx.Rngs) -> CausalLM:
    return CausalLM(cfg, decoder_layers(cfg, rngs, attention=MLAttention, moe_block=MoeBlock), rngs=rngs)


# HF tensor name -> our parameter path -> kind (see qwen2_moe.WEIGHTS); rows for parameters a model
# lacks (q LoRA vs q_proj, biases, dense vs MoE layers, tied head) are dropped by hf_io.
ATTENTION_WEIGHTS = (
    ("model.layers.{i}.self_attn.q_proj.weight", "layers.{i}.attn.wq_DxQ", "T"),
    ("model.layers.{i}.self_attn.q_a_proj.weight", "layers.{i}.attn.wq_a_DxR", "T"),
    ("model.layers.{i}.self_attn.q_a_proj.bias", "layers.{i}.attn.bq_a_R", "id"),
    ("model.layers.{i}.self_attn.q_a_layernorm.weight", "layers.{i}.attn.q_a_norm.weight", "id"),
    ("model.layers.{i}.self_attn.q_b_proj.weight", "layers.{i}.attn.wq_b_RxQ", "T"),
    ("model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight", "layers.{i}.attn.wkv_a_DxA", "T"),
    ("model.layers.{i}.self_attn.kv_a_proj_with_mqa.bias", "layers.{i}.attn.bkv_a_A", "id"),
    ("model.layers.{i}.self_attn.kv_a_layernorm.weight", "layers.{i}.attn.kv_a_norm.weight", "id"),
    ("model.layers.{i}.self_attn.kv_b_proj.weight", "layers.{i}.attn.wkv_b_CxK", "T"),
    ("model.layers.{i}.self_attn.o_proj.weight", "layers.{i}.attn.wo_VxD", "T"),
    ("model.layers.{i}.self_attn.o_proj.bias", "layers.{i}.attn.bo_D", "id"),
)
# Layer norms and the dense MLP are named as in Qwen2-MoE.
_SHARED_LAYER_WEIGHTS = tuple(row for row in qwen2_moe.ATTENTION_WEIGHTS if ".self_attn." not in row[0])
WEIGHTS = (
    hf_config.LM_WEIGHTS
    + _SHARED_LAYER_WEIGHTS
    + ATTENTION_WEIGHTS
    + qwen2_moe.EXPERT_WEIGHTS
    + (
        ("model.layers.{i}.mlp.shared_experts.gate_proj.weight", "layers.{i}.mlp.shared.wg_DxF", "T"),
        ("model.layers.{i}.mlp.shared_experts.up_proj.weight", "layers.{i}.mlp.shared.wu_DxF", "T"),
        ("model.layers.{i}.mlp.shared_experts.down_proj.weight", "layers.{i}.mlp.shared.wo_FxD", "T"),
    )
)
