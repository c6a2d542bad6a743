"""Gradient accumulation in place: an identity whose backward adds a layer's parameter cotangents into a carried sum."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from cisjax.rounding import round_to_bf16


class Sums(NamedTuple):
    """The train step's running gradient sums passed through the model (CausalLM's grad_acc): one tree per stack (its
    params' tree, leading layer axis), in the sum's dtype, and for a bfloat16 sum the raw key data of its stochastic
    rounding (None: an fp32 sum, added as such)."""

    trees: list
    key: jax.Array | None = None


def add(sum_, grad, key=None):
    """sum_ + grad in sum_'s dtype. A bfloat16 sum takes the fp32 sum by stochastic rounding (cisjax.rounding), its
    random bits from `key` (raw uint32 key data, jax.random.key_data): rounding to nearest would drop every gradient
    under half of bf16's gap at the sum (2^-9 of it), and each micro-batch's gradient is a fraction of the sum."""
    if key is None or jnp.dtype(sum_.dtype) != jnp.bfloat16:
        return sum_ + grad.astype(sum_.dtype)
    return round_to_bf16(sum_.astype(jnp.float32) + grad.astype(jnp.float32), jax.random.wrap_key_data(key))


def fold(key, *data):
    """Raw key data folded with `data` (ints or int scalars), or None for None: one stream per stack, layer, leaf."""
    if key is None:
        return None
    k = jax.random.wrap_key_data(key)
    for d in data:
        k = jax.random.fold_in(k, d)
    return jax.random.key_data(k)


@jax.custom_vjp
def _into_slice(w, acc_nx, j, key):
    return w, acc_nx


def _into_slice_fwd(w, acc_nx, j, key):
    return (w, acc_nx), (j, key)


def _into_slice_bwd(res, cts):
    j, key = res
    ct_w, ct_acc_nx = cts
    row = add(lax.dynamic_index_in_dim(ct_acc_nx, j, keepdims=False), ct_w, key)
    # w's own cotangent: zero (the caller differentiates the accumulator, not the weights it holds as constants)
    return jnp.zeros_like(ct_w), lax.dynamic_update_index_in_dim(ct_acc_nx, row, j, 0), None, None


_into_slice.defvjp(_into_slice_fwd, _into_slice_bwd)


def into_layer(state_j, acc_n, j, key=None):
    """(state_j, acc_n) unchanged; backward: layer j's parameter cotangents are added into row j of acc_n's cotangent.

    state_j: one layer's parameters (a slice of a stack); acc_n: the stack's accumulator, the same tree with the
    leading layer axis n, carried through the layers' scan. Differentiating a loss with respect to acc_n, its output
    cotangent seeded with the sum so far, gives that sum plus this loss's gradient: each layer's gradient lands in
    the carried buffer as the backward scan reaches it (an in-place update of the loop's carry), where the gradient
    of the stacked weights as such would be a new [n, ...] buffer beside the sum.

    key: the stack's raw key data for a bfloat16 sum's stochastic rounding (add), folded with j and the leaf's
    position; None for an fp32 sum."""
    leaves, treedef = jax.tree.flatten(state_j)
    acc_leaves = treedef.flatten_up_to(acc_n)
    pairs = [_into_slice(w, a, j, fold(key, j, i)) for i, (w, a) in enumerate(zip(leaves, acc_leaves))]
    return treedef.unflatten([w for w, _ in pairs]), treedef.unflatten([a for _, a in pairs])
