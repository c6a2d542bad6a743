"""MoE routing, pure functions: the fp32 router's top-k, gate weights of replayed ids, assignments sorted by expert
and the rows moved into and out of that order."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def route(
    logits_NxE: jax.Array,
    *,
    k: int,
    method: str = "greedy",
    n_group: int | None = None,
    topk_group: int | None = None,
    norm_topk_prob: bool = False,
    scaling: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """Softmax router -> (weights [N, k] fp32, expert ids [N, k] int32), as the HF reference.

    method: "greedy" (top-k of all experts) or "group_limited_greedy" (DeepSeek-V2: keep the
    `topk_group` groups with the highest max-score, zero the others, then top-k).
    """
    probs_NxE = jax.nn.softmax(logits_NxE.astype(jnp.float32), axis=-1)
    scores_NxE = probs_NxE
    if method == "group_limited_greedy":
        n, e = probs_NxE.shape
        if not n_group or not topk_group or e % n_group:
            raise ValueError(
                f"group_limited_greedy needs n_group dividing {e} experts and topk_group; got {n_group}, {topk_group}"
            )
        group_NxG = probs_NxE.reshape(n, n_group, e // n_group).max(axis=-1)
        _, gidx_NxT = jax.lax.top_k(group_NxG, topk_group)
        keep_NxG = jnp.zeros_like(group_NxG, dtype=bool).at[jnp.arange(n)[:, None], gidx_NxT].set(True)
        keep_NxE = jnp.repeat(keep_NxG, e // n_group, axis=-1)
        scores_NxE = jnp.where(keep_NxE, probs_NxE, 0.0)
    elif method != "greedy":
        raise ValueError(f"unknown topk method {method!r} (greedy, group_limited_greedy)")
    w_NxK, ids_NxK = jax.lax.top_k(scores_NxE, k)
    if norm_topk_prob:
        w_NxK = w_NxK / jnp.sum(w_NxK, axis=-1, keepdims=True)
    return w_NxK * scaling, ids_NxK.astype(jnp.int32)


def replay_weights(
    logits_NxE: jax.Array, ids_NxK: jax.Array, *, norm_topk_prob: bool = False, scaling: float = 1.0
) -> jax.Array:
    """Gate weights [N, k] fp32 of given (replayed) expert ids: the router's fp32 softmax over all experts gathered
    at `ids`, renormalised over the k when `norm_topk_prob`, times `scaling` -- what `route` gives its own top-k ids,
    now at ids chosen elsewhere (the rollout engine's). Group limiting does not apply: it only chooses ids. The
    weights stay a function of the router's logits, so the router still gets a gradient."""
    probs_NxE = jax.nn.softmax(logits_NxE.astype(jnp.float32), axis=-1)
    w_NxK = jnp.take_along_axis(probs_NxE, ids_NxK.astype(jnp.int32), axis=-1)
    if norm_topk_prob:
        w_NxK = w_NxK / jnp.sum(w_NxK, axis=-1, keepdims=True)
    return w_NxK * scaling


def sort_by_expert(ids_NxK: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """(order_R, sizes_E): the R = N*K (token, slot) assignments sorted by expert (stable: token order within a
    group), and each expert's group size."""
    flat_ids_R = ids_NxK.reshape(-1)
    order_R = jnp.argsort(flat_ids_R, stable=True).astype(jnp.int32)
    return order_R, jnp.bincount(flat_ids_R, length=num_experts).astype(jnp.int32)


def inverse_permutation(order_R: jax.Array) -> jax.Array:
    """inv_R with inv[order[r]] = r (order a permutation of 0..R-1): where each assignment went in the sorted order.
    An integer scatter of R indices (unique: no two write one place)."""
    r = order_R.shape[0]
    return jnp.zeros_like(order_R).at[order_R].set(jnp.arange(r, dtype=order_R.dtype), unique_indices=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def sorted_rows(x_NxD: jax.Array, order_R: jax.Array, inv_R: jax.Array, k: int) -> jax.Array:
    """xs[r] = x[order[r] // k]: each token's row once per assignment (k per token), in the sorted order (a gather).
    Its gradient gathers the rows back by the inverse permutation and sums each token's k rows in fp32, rounding once:
    no scatter-add (which a GPU runs with atomics, in the rows' dtype and in no fixed order)."""
    return x_NxD[order_R // k]


def _sorted_rows_fwd(x_NxD, order_R, inv_R, k):
    return sorted_rows(x_NxD, order_R, inv_R, k), inv_R


def _sorted_rows_bwd(k, inv_R, dxs_RxD):
    dx_NxKxD = dxs_RxD[inv_R].astype(jnp.float32).reshape(-1, k, dxs_RxD.shape[1])
    return jnp.sum(dx_NxKxD, axis=1).astype(dxs_RxD.dtype), None, None


sorted_rows.defvjp(_sorted_rows_fwd, _sorted_rows_bwd)


@jax.custom_vjp
def unsorted_rows(ys_RxD: jax.Array, order_R: jax.Array, inv_R: jax.Array) -> jax.Array:
    """y[order[r]] = ys[r]: the sorted rows back in (token, slot) order, as a gather by the inverse permutation; its
    gradient the gather by order. Neither direction scatters."""
    return ys_RxD[inv_R]


def _unsorted_rows_fwd(ys_RxD, order_R, inv_R):
    return unsorted_rows(ys_RxD, order_R, inv_R), order_R


def _unsorted_rows_bwd(order_R, dy_RxD):
    return dy_RxD[order_R], None, None


unsorted_rows.defvjp(_unsorted_rows_fwd, _unsorted_rows_bwd)


def through_sorted(fn, x_NxD: jax.Array, order_R: jax.Array, w_NxK: jax.Array) -> jax.Array:
    """sum_k w[n, k] * fn(xs)[slot (n, k)]: each token's row once per assignment (k per token) in `order` (sorted
    by expert: sort_by_expert), fn on those sorted rows ([R, D] -> [R, D], the experts and any exchange between),
    the rows back in (token, slot) order and each token's k outputs summed with its routing weights. The rows move
    by gathers both ways, forward and backward (sorted_rows / unsorted_rows)."""
    n, d = x_NxD.shape
    k = w_NxK.shape[1]
    inv_R = inverse_permutation(order_R)
    ys_RxD = fn(sorted_rows(x_NxD, order_R, inv_R, k))
    y_RxD = unsorted_rows(ys_RxD, order_R, inv_R)
    return jnp.einsum("nkd,nk->nd", y_RxD.reshape(n, k, d), w_NxK)
