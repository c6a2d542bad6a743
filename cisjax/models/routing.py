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
    group), and each expert's group size. With every id in [0, E) (route's top-k; a replayed id outside it gets a NaN
    weight from replay_weights) every assignment is in a group: sum(sizes) = R."""
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


def _slots(ys_RxD: jax.Array, inv_R: jax.Array, k: int) -> jax.Array:
    """[N, k, D]: ys[inv[n * k + j]] at (n, j), each assignment's sorted row in (token, slot) order (a gather, which
    combine's passes fuse into their arithmetic: never stored)."""
    return ys_RxD[inv_R].reshape(-1, k, ys_RxD.shape[1])


@jax.custom_vjp
def combine(ys_RxD: jax.Array, w_NxK: jax.Array, order_R: jax.Array, inv_R: jax.Array) -> jax.Array:
    """y[n] = sum_j w[n, j] * ys[inv[n * k + j]]: the sorted rows back at their tokens and each token's k of them
    summed with its weights, in one pass (a gather by the inverse permutation read inside the sum), in fp32 in slot
    order, rounded once. Its gradient, also gathers only, one pass each: the rows' dys[r] = w[a] * dy[a // k] (a =
    order[r]) and the weights' dw[n, j] = <ys[inv[n * k + j]], dy[n]> (fp32). It keeps ys itself for the backward, not
    the un-sorted [N, k, D] copy (which autodiff of a gather and an einsum would keep: stored, under a scan)."""
    k = w_NxK.shape[1]
    y_NxKxD = _slots(ys_RxD, inv_R, k).astype(jnp.float32)
    w_NxK1 = w_NxK.astype(jnp.float32)[:, :, None]
    y_NxD = y_NxKxD[:, 0] * w_NxK1[:, 0]
    for j in range(1, k):  # in slot order: no reduction whose order the compiler picks
        y_NxD = y_NxD + y_NxKxD[:, j] * w_NxK1[:, j]
    return y_NxD.astype(jnp.result_type(ys_RxD, w_NxK))


def _combine_fwd(ys_RxD, w_NxK, order_R, inv_R):
    return combine(ys_RxD, w_NxK, order_R, inv_R), (ys_RxD, w_NxK, order_R, inv_R)


def _combine_bwd(res, dy_NxD):
    ys_RxD, w_NxK, order_R, inv_R = res
    k = w_NxK.shape[1]
    dy32_NxD = dy_NxD.astype(jnp.float32)
    w_R = w_NxK.reshape(-1)[order_R].astype(jnp.float32)
    dys_RxD = dy32_NxD[order_R // k] * w_R[:, None]
    dw_NxK = jnp.sum(_slots(ys_RxD, inv_R, k).astype(jnp.float32) * dy32_NxD[:, None], axis=-1)
    return dys_RxD.astype(ys_RxD.dtype), dw_NxK.astype(w_NxK.dtype), None, None


combine.defvjp(_combine_fwd, _combine_bwd)


def through_sorted(fn, x_NxD: jax.Array, order_R: jax.Array, w_NxK: jax.Array) -> jax.Array:
    """sum_k w[n, k] * fn(xs)[slot (n, k)]: each token's row once per assignment (k per token) in `order` (sorted
    by expert: sort_by_expert), fn on those sorted rows ([R, D] -> [R, D], the experts and any exchange between),
    then each token's k outputs gathered back and summed with its routing weights (combine). The rows move by gathers
    both ways, forward and backward (sorted_rows / combine)."""
    k = w_NxK.shape[1]
    inv_R = inverse_permutation(order_R)
    ys_RxD = fn(sorted_rows(x_NxD, order_R, inv_R, k))
    return combine(ys_RxD, w_NxK, order_R, inv_R)


@jax.custom_vjp
def sorted_weights(w_NxK: jax.Array, order_R: jax.Array, inv_R: jax.Array) -> jax.Array:
    """w_R[r] = w[order[r]]: each assignment's routing weight in the sorted order (a gather); its gradient gathers
    back by the inverse permutation (no scatter)."""
    return w_NxK.reshape(-1)[order_R]


def _sorted_weights_fwd(w_NxK, order_R, inv_R):
    return sorted_weights(w_NxK, order_R, inv_R), (inv_R, w_NxK.shape)


def _sorted_weights_bwd(res, dw_R):
    inv_R, shape = res
    return dw_R[inv_R].reshape(shape), None, None


sorted_weights.defvjp(_sorted_weights_fwd, _sorted_weights_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def gather_sum(ys_RxD: jax.Array, order_R: jax.Array, inv_R: jax.Array, k: int) -> jax.Array:
    """y[n] = sum_j ys[inv[n * k + j]]: combine without weights (rows already weighted), in fp32 in slot order,
    rounded once; its gradient is sorted_rows' forward (dys[r] = dy[order[r] // k], a gather) and keeps nothing of
    ys for the backward."""
    y_NxKxD = _slots(ys_RxD, inv_R, k).astype(jnp.float32)
    y_NxD = y_NxKxD[:, 0]
    for j in range(1, k):  # in slot order: no reduction whose order the compiler picks
        y_NxD = y_NxD + y_NxKxD[:, j]
    return y_NxD.astype(ys_RxD.dtype)


def _gather_sum_fwd(ys_RxD, order_R, inv_R, k):
    return gather_sum(ys_RxD, order_R, inv_R, k), order_R


def _gather_sum_bwd(k, order_R, dy_NxD):
    return dy_NxD[order_R // k], None, None  # y has ys's dtype, and so has its cotangent


gather_sum.defvjp(_gather_sum_fwd, _gather_sum_bwd)


def through_sorted_weighted(fn, x_NxD: jax.Array, order_R: jax.Array, w_NxK: jax.Array) -> jax.Array:
    """through_sorted with the routing weights applied by fn: fn(sorted rows, their weights w_R) -> the weighted
    rows ([R, D]; mgpu_ws multiplies them in its kernels and takes the weights' gradient there, from dh), then each
    token's k rows gathered back and summed (gather_sum). No copy of the experts' unweighted output is kept for the
    weights' gradient (combine keeps ys)."""
    k = w_NxK.shape[1]
    inv_R = inverse_permutation(order_R)
    ys_RxD = fn(sorted_rows(x_NxD, order_R, inv_R, k), sorted_weights(w_NxK, order_R, inv_R))
    return gather_sum(ys_RxD, order_R, inv_R, k)
