"""MoE routing, pure functions: the fp32 router's top-k, gate weights of replayed ids, assignments sorted by expert."""

from __future__ import annotations

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
