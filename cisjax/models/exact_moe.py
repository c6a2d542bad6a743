"""The exact path's MoE block on a row tile: router, routed experts per token, combine in slot order, shared experts.

Each token's experts run on that token alone: its k experts' weights gathered ([T, k, D, F]) and applied by matmuls
batched over (token, slot), so a token's output does not depend on which other tokens chose the same expert, nor on
how many did (the grouped kernels' tiles follow the groups: moe_tiled.py). `impl="dense"` computes every expert on
every token of the tile and picks each token's k ([T, D] x [D, E F]: E / k times the FLOPs, no weight gathers); both
are per-row fixed-shape programs. The k outputs are summed in fp32 in slot order, as routing.combine.

`impl="tiles"`, the scalable form (`expert_tiles`): over ALL the program's tokens, not a row tile, each token's k
assignments sorted by expert and each expert's rows cut into expert tiles of one fixed height (EXPERT_TILE); one loop
body ([H, D] x [D, F] of the tile's expert, padding rows masked) runs every tile, full or not. A token's row of a tile
is computed as in any other tile of that height (the row tiles' premise, exact.tiled), so its result does not depend
on which tokens share its tile; the FLOPs are the assignments' plus at most (H - 1) padding rows per expert, and each
tile reads one expert's weights (not E / k times the FLOPs of dense, nor k experts' weights per token of gather)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from cisjax.models import cpu_bits, deepseek_v2, qwen2_moe, qwen3_moe
from cisjax.models.layers import dense
from cisjax.models.routing import route

IMPLS = ("gather", "dense")  # per row tile (routed, block); "tiles": expert tiles over all tokens (expert_tiles)
EXPERT_TILE = 16  # rows per expert tile of impl="tiles": the same in the sampler and the train step


def route_tile(moe, h_TxD):
    """The router on a tile: (weights [T, k] fp32, expert ids [T, k]), as moe.MoE (its router dtype, route())."""
    rd = moe.router_dtype
    logits_TxE = jnp.einsum("td,de->te", h_TxD.astype(rd), moe.router_DxE[...].astype(rd))
    return route(logits_TxE, k=moe.k, **dict(moe.route_kw))


def combine(y_TxKxD, w_TxK, dtype):
    """A token's k expert outputs weighted and summed in fp32 in slot order (as routing.combine) -> [T, D]."""
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
    return combine(y_TxKxD, w_TxK, x_TxD.dtype)


def experts_dense(x_TxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, ids_TxK, w_TxK):
    """Every expert on every token, then each token's k picked: [T, D]."""
    g_TxExF = jnp.einsum("td,edf->tef", x_TxD, wg_ExDxF)
    u_TxExF = jnp.einsum("td,edf->tef", x_TxD, wu_ExDxF)
    y_TxExD = jnp.einsum("tef,efd->ted", jax.nn.silu(g_TxExF) * u_TxExF, wo_ExFxD)
    y_TxKxD = jnp.take_along_axis(y_TxExD, ids_TxK[:, :, None], axis=1)
    return combine(y_TxKxD, w_TxK, x_TxD.dtype)


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
    return with_shared(mlp, h_TxD, y_TxD)


def with_shared(mlp, h_TxD, y_TxD):
    """The routed experts' y [T, D] plus the family's shared experts on the tile's normed inputs h -> [T, D]."""
    if isinstance(mlp, qwen2_moe.SparseMoeBlock):  # the shared expert, sigmoid-gated
        gate_Tx1 = jax.nn.sigmoid(dense(h_TxD, mlp.shared_gate_Dx1, mlp.dtype))
        return y_TxD + gate_Tx1 * mlp.shared(h_TxD[:, None])[:, 0]
    if isinstance(mlp, deepseek_v2.MoeBlock):  # ungated shared experts, where it has them
        return y_TxD + mlp.shared(h_TxD[:, None])[:, 0] if mlp.has_shared else y_TxD
    if isinstance(mlp, qwen3_moe.SparseMoeBlock):  # routed experts only
        return y_TxD
    raise TypeError(f"exact path: no MoE block of type {type(mlp).__name__}")


def tile_count(assignments: int, experts: int, tile: int) -> int:
    """The expert tiles `assignments` (token, slot) pairs need at most: sum over experts of ceil(n_e / tile) <=
    (assignments + (tile - 1) x the experts that have any) / tile."""
    return (assignments + min(experts, assignments) * (tile - 1)) // tile


def expert_tiles(moe, h_NxD, ids_NxK, tile: int | None = None):
    """Each of the N tokens through its k experts (ids_NxK), in expert tiles of `tile` rows -> y [N, k, D] in the
    compute dtype (not yet weighted). Tile j holds rows [i_j H, (i_j + 1) H) of its expert e_j's assignments (in
    token order); the loop's trip count is tile_count's bound, rows past an expert's count are zeros, dropped. tile:
    EXPERT_TILE (read at the call) unless given."""
    tile = tile or EXPERT_TILE
    dt = moe.dtype
    wg_ExDxF, wu_ExDxF, wo_ExFxD = (getattr(moe, n)[...].astype(dt) for n in ("wg_ExDxF", "wu_ExDxF", "wo_ExFxD"))
    n, k = ids_NxK.shape
    e, a = wg_ExDxF.shape[0], n * k
    e_A = ids_NxK.reshape(-1).astype(jnp.int32)
    order_A = jnp.argsort(e_A, stable=True)  # assignments by expert, token order within one
    n_E = jnp.bincount(e_A, length=e)
    t_E = (n_E + tile - 1) // tile
    tend_E = jnp.cumsum(t_E)
    j_J = jnp.arange(tile_count(a, e, tile), dtype=jnp.int32)
    e_J = jnp.minimum(jnp.searchsorted(tend_E, j_J, side="right"), e - 1).astype(jnp.int32)
    r_JxH = (j_J - (tend_E - t_E)[e_J])[:, None] * tile + jnp.arange(tile, dtype=jnp.int32)  # row in its expert
    valid_JxH = r_JxH < n_E[e_J][:, None]  # tiles past the last used: r >= n_e, all masked
    at_JxH = order_A[jnp.clip((jnp.cumsum(n_E) - n_E)[e_J][:, None] + r_JxH, 0, a - 1)]  # assignment index
    x_JxHxD = jnp.where(valid_JxH[..., None], jnp.take(h_NxD.astype(dt), at_JxH // k, axis=0), 0).astype(dt)

    weights = (wg_ExDxF, wu_ExDxF, wo_ExFxD)
    w_dtypes = cpu_bits.dtypes_of(weights)
    weights = cpu_bits.to_bits(weights)  # sliced in the loop as bits (cpu_bits.to_bits: XLA:CPU's cost)

    def body(xs):
        x_HxD, ex = lax.optimization_barrier((cpu_bits.from_bits(xs[0], jnp.dtype(dt)), xs[1]))  # the same loop body
        # in every program: nothing fuses into it; the expert's weights sliced before the barrier too (a slice
        # fused into a dot changes its kernel)
        w = cpu_bits.from_bits(tuple(a[ex] for a in weights), w_dtypes)
        x_HxD, wg_DxF, wu_DxF, wo_FxD = lax.optimization_barrier((x_HxD, *w))
        g_HxF = jnp.einsum("hd,df->hf", x_HxD, wg_DxF)
        u_HxF = jnp.einsum("hd,df->hf", x_HxD, wu_DxF)
        y_HxD = lax.optimization_barrier(jnp.einsum("hf,fd->hd", jax.nn.silu(g_HxF) * u_HxF, wo_FxD))
        return cpu_bits.to_bits(y_HxD)

    y_JxHxD = cpu_bits.from_bits(lax.map(body, (cpu_bits.to_bits(x_JxHxD), e_J)), jnp.dtype(dt))
    dest = jnp.where(valid_JxH, at_JxH, a).reshape(-1)
    y_AxD = cpu_bits.to_bits(jnp.zeros((a, h_NxD.shape[1]), dt))  # scattered as bits (cpu_bits.to_bits)
    y_AxD = y_AxD.at[dest].set(cpu_bits.to_bits(y_JxHxD.reshape(-1, y_JxHxD.shape[-1])), mode="drop")
    return cpu_bits.from_bits(y_AxD, jnp.dtype(dt)).reshape(n, k, -1)
