"""The exact path's MoE block on a row tile: router, routed experts per token, combine in slot order, shared experts.

Each token's experts run on that token alone: its k experts' weights gathered ([T, k, D, F]) and applied by matmuls
batched over (token, slot), so a token's output does not depend on which other tokens chose the same expert, nor on
how many did (the grouped kernels' tiles follow the groups: moe_tiled.py). `impl="dense"` computes every expert on
every token of the tile and picks each token's k ([T, D] x [D, E F]: E / k times the FLOPs, no weight gathers); both
are per-row fixed-shape programs. The k outputs are summed in fp32 in slot order, as routing.combine."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cisjax.models import deepseek_v2, qwen2_moe, qwen3_moe
from cisjax.models.layers import dense
from cisjax.models.routing import route

IMPLS = ("gather", "dense")


def route_tile(moe, h_TxD):
    """The router on a tile: (weights [T, k] fp32, expert ids [T, k]), as moe.MoE (its router dtype, route())."""
    rd = moe.router_dtype
    logits_TxE = jnp.einsum("td,de->te", h_TxD.astype(rd), moe.router_DxE[...].astype(rd))
    return route(logits_TxE, k=moe.k, **dict(moe.route_kw))


def _combine(y_TxKxD, w_TxK, dtype):
    y32, w32 = y_TxKxD.astype(jnp.float32), w_TxK.astype(jnp.float32)
    acc_TxD = y32[:, 0] * w32[:, 0, None]
    for j in range(1, w_TxK.shape[1]):  # slot order
        acc_TxD = acc_TxD + y32[:, j] * w32[:, j, None]
    return acc_TxD.astype(dtype)


def experts_gather(x_TxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, ids_TxK, w_TxK):
    """Each token through its own k experts (weights gathered per token): [T, D]."""
    g_TxKxF = jnp.einsum("td,tkdf->tkf", x_TxD, wg_ExDxF[ids_TxK])
    u_TxKxF = jnp.einsum("td,tkdf->tkf", x_TxD, wu_ExDxF[ids_TxK])
    y_TxKxD = jnp.einsum("tkf,tkfd->tkd", jax.nn.silu(g_TxKxF) * u_TxKxF, wo_ExFxD[ids_TxK])
    return _combine(y_TxKxD, w_TxK, x_TxD.dtype)


def experts_dense(x_TxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, ids_TxK, w_TxK):
    """Every expert on every token, then each token's k picked: [T, D]."""
    g_TxExF = jnp.einsum("td,edf->tef", x_TxD, wg_ExDxF)
    u_TxExF = jnp.einsum("td,edf->tef", x_TxD, wu_ExDxF)
    y_TxExD = jnp.einsum("tef,efd->ted", jax.nn.silu(g_TxExF) * u_TxExF, wo_ExFxD)
    y_TxKxD = jnp.take_along_axis(y_TxExD, ids_TxK[:, :, None], axis=1)
    return _combine(y_TxKxD, w_TxK, x_TxD.dtype)


def routed(moe, h_TxD, impl: str = "gather"):
    """moe.MoE on a tile -> (y [T, D] in the compute dtype, expert ids [T, k])."""
    if impl not in IMPLS:
        raise ValueError(f"exact moe impl {impl!r}; one of {IMPLS}")
    dt = moe.dtype
    w_TxK, ids_TxK = route_tile(moe, h_TxD)
    weights = tuple(getattr(moe, name)[...].astype(dt) for name in ("wg_ExDxF", "wu_ExDxF", "wo_ExFxD"))
    fn = experts_gather if impl == "gather" else experts_dense
    return fn(h_TxD.astype(dt), *weights, ids_TxK, w_TxK), ids_TxK


def block(mlp, h_TxD, impl: str = "gather"):
    """A family's MoE block (its routed experts and shared experts) on a tile of normed inputs -> [T, D]."""
    y_TxD, _ = routed(mlp.moe, h_TxD, impl)
    if isinstance(mlp, qwen2_moe.SparseMoeBlock):  # the shared expert, sigmoid-gated
        gate_Tx1 = jax.nn.sigmoid(dense(h_TxD, mlp.shared_gate_Dx1, mlp.dtype))
        return y_TxD + gate_Tx1 * mlp.shared(h_TxD[:, None])[:, 0]
    if isinstance(mlp, deepseek_v2.MoeBlock):  # ungated shared experts, where it has them
        return y_TxD + mlp.shared(h_TxD[:, None])[:, 0] if mlp.has_shared else y_TxD
    if isinstance(mlp, qwen3_moe.SparseMoeBlock):  # routed experts only
        return y_TxD
    raise TypeError(f"exact path: no MoE block of type {type(mlp).__name__}")
