"""The decoder-only shell shared by every family: embedding, the pre-norm decoder block, final norm, unembedding."""

from __future__ import annotations

from typing import NamedTuple

import flax.nnx as nnx
import jax
import jax.numpy as jnp

from cisjax import errors, sharding
from cisjax.models.layers import MLP, RMSNorm, attention_mask, param

# model.remat: what the backward pass keeps of each decoder layer's forward; the rest it recomputes from the layer's
# input. "minimal": the matmuls without dot batch dimensions (jax's dots_with_no_batch_dims_saveable), i.e. the
# projections; not the attention scores (batched over heads) nor the MoE kernels' outputs. "full": the input only.
REMAT_POLICIES = {
    "none": None,
    "minimal": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}


def _call_layer(layer, x_BxLxD, positions_BxL, mask_BxLxL, *, remat: str = "none"):
    """layer(x, positions, mask), under jax.checkpoint with the `remat` policy unless "none". A pure function of the
    layer's split state, not nnx.remat: a decoder layer mutates nothing, and nnx.remat's write-back fails on a model
    merged inside another transform's body (the rescoring's lax.map over micro-batches)."""
    if remat == "none":
        return layer(x_BxLxD, positions_BxL, mask_BxLxL)
    graphdef, state = nnx.split(layer)

    def pure(state, x_BxLxD, positions_BxL, mask_BxLxL):
        return nnx.merge(graphdef, state)(x_BxLxD, positions_BxL, mask_BxLxL)

    return jax.checkpoint(pure, policy=REMAT_POLICIES[remat])(state, x_BxLxD, positions_BxL, mask_BxLxL)


class ModelOutput(NamedTuple):
    hidden_BxLxD: jax.Array  # after the final norm, before the unembedding
    # Routing capture: selected expert ids per MoE layer, [X, B, L, k] (X = number of MoE layers,
    # in layer order; see CausalLM.moe_layers), or None for dense models.
    expert_ids_XxBxLxK: jax.Array | None


class DecoderLayer(nnx.Module):
    """The pre-norm residual block of every family: x + attn(attn_norm(x)), then x + mlp(mlp_norm(x)).

    `attn(x_BxLxD, positions_BxL, mask_BxLxL) -> y_BxLxD` is the family's attention; `mlp` is the family's MoE block,
    `mlp(x_BxLxD) -> (y_BxLxD, expert_ids_BxLxK)`, on a MoE layer, and a dense SwiGLU MLP otherwise.
    """

    def __init__(self, cfg, attn: nnx.Module, mlp: nnx.Module, *, is_moe: bool):
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=cfg.param_dtype)
        self.attn = attn
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=cfg.param_dtype)
        self.mlp = mlp
        self.is_moe = is_moe

    def attention_block(self, x_BxLxD, positions_BxL, mask_BxLxL):
        """The attention half's residual branch: attn(attn_norm(x))."""
        return self.attn(self.attn_norm(x_BxLxD), positions_BxL, mask_BxLxL)

    def mlp_block(self, x_BxLxD):
        """The MLP half's residual branch, (mlp(mlp_norm(x)), expert ids or None on a dense layer)."""
        if self.is_moe:
            return self.mlp(self.mlp_norm(x_BxLxD))
        return self.mlp(self.mlp_norm(x_BxLxD)), None

    def __call__(self, x_BxLxD, positions_BxL, mask_BxLxL):
        x_BxLxD = x_BxLxD + self.attention_block(x_BxLxD, positions_BxL, mask_BxLxL)
        y_BxLxD, ids = self.mlp_block(x_BxLxD)
        return sharding.constrain(x_BxLxD + y_BxLxD, ("batch", "length", "act_embed")), ids


def decoder_layers(cfg, rngs: nnx.Rngs, *, attention, moe_block=None) -> list[DecoderLayer]:
    """cfg.num_hidden_layers blocks: `attention(cfg, rngs=rngs)` in each, `moe_block(cfg, rngs=rngs)` where
    cfg.is_moe_layer(i), a SwiGLU MLP of cfg.intermediate_size elsewhere."""
    layers = []
    for i in range(cfg.num_hidden_layers):
        attn = attention(cfg, rngs=rngs)
        is_moe = cfg.is_moe_layer(i)
        if is_moe:
            mlp = moe_block(cfg, rngs=rngs)
        else:
            mlp = MLP(cfg.hidden_size, cfg.intermediate_size, rngs=rngs, param_dtype=cfg.param_dtype, dtype=cfg.dtype)
        layers.append(DecoderLayer(cfg, attn, mlp, is_moe=is_moe))
    return layers


class CausalLM(nnx.Module):
    """tokens -> hidden states; each family supplies its decoder layers.

    A layer is called as `layer(x_BxLxD, positions_BxL, mask_BxLxL)` and returns
    `(x_BxLxD, expert_ids_BxLxK or None)`.
    """

    def __init__(self, cfg, layers: list, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed_VxD = param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), cfg.param_dtype)
        self.layers = nnx.List(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=cfg.param_dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head_DxV = param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), cfg.param_dtype)

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(len(self.layers)) if self.cfg.is_moe_layer(i)]

    def __call__(
        self, tokens_BxL: jax.Array, positions_BxL: jax.Array | None = None, segment_ids_BxL: jax.Array | None = None
    ) -> ModelOutput:
        """positions default to 0..L-1; segment_ids (0 = padding) default to one segment per row.
        Packed rows carry per-segment positions and distinct segment ids."""
        b, l = tokens_BxL.shape
        if positions_BxL is None:
            positions_BxL = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
        if segment_ids_BxL is None:
            segment_ids_BxL = jnp.ones((b, l), jnp.int32)
        mask_BxLxL = attention_mask(segment_ids_BxL)
        x_BxLxD = jnp.take(self.embed_VxD[...], tokens_BxL, axis=0).astype(self.cfg.dtype)
        x_BxLxD = sharding.constrain(x_BxLxD, ("batch", "length", "act_embed"))
        routing = []
        remat = self.cfg.remat
        if remat not in REMAT_POLICIES:
            raise errors.UserError(f"model.remat={remat!r}; one of {tuple(REMAT_POLICIES)}")
        for layer in self.layers:
            x_BxLxD, ids = _call_layer(layer, x_BxLxD, positions_BxL, mask_BxLxL, remat=remat)
            if ids is not None:
                routing.append(ids)
        hidden = self.norm(x_BxLxD)
        return ModelOutput(hidden, jnp.stack(routing) if routing else None)

    def unembedding_DxV(self) -> jax.Array:
        """The output projection [D, V] (the transposed embedding when tied)."""
        if self.cfg.tie_word_embeddings:
            return self.embed_VxD[...].T
        return self.lm_head_DxV[...]

    def logits(self, hidden_BxLxD: jax.Array) -> jax.Array:
        """Full logits in fp32 — for tests and small inputs; training uses cisjax.logprobs (chunked)."""
        w = self.unembedding_DxV().astype(self.cfg.dtype)
        return jnp.einsum("bld,dv->blv", hidden_BxLxD.astype(self.cfg.dtype), w, preferred_element_type=jnp.float32)
