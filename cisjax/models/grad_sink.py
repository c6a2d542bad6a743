"""Gradient accumulation in place: an identity whose backward adds a layer's parameter cotangents into a carried sum."""

from __future__ import annotations

import jax
from jax import lax


@jax.custom_vjp
def _into_slice(w, acc_nx, j):
    return w, acc_nx


def _into_slice_fwd(w, acc_nx, j):
    return (w, acc_nx), j


def _into_slice_bwd(j, cts):
    ct_w, ct_acc_nx = cts
    row = lax.dynamic_index_in_dim(ct_acc_nx, j, keepdims=False) + ct_w.astype(ct_acc_nx.dtype)
    # w's own cotangent: zero (the caller differentiates the accumulator, not the weights it holds as constants)
    return jax.numpy.zeros_like(ct_w), lax.dynamic_update_index_in_dim(ct_acc_nx, row, j, 0), None


_into_slice.defvjp(_into_slice_fwd, _into_slice_bwd)


def into_layer(state_j, acc_n, j):
    """(state_j, acc_n) unchanged; backward: layer j's parameter cotangents are added into row j of acc_n's cotangent.

    state_j: one layer's parameters (a slice of a stack); acc_n: the stack's accumulator, the same tree with the
    leading layer axis n, carried through the layers' scan. Differentiating a loss with respect to acc_n, its output
    cotangent seeded with the sum so far, gives that sum plus this loss's gradient: each layer's gradient lands in
    the carried buffer as the backward scan reaches it (an in-place update of the loop's carry), where the gradient
    of the stacked weights as such would be a new [n, ...] buffer beside the sum."""
    leaves, treedef = jax.tree.flatten(state_j)
    acc_leaves = treedef.flatten_up_to(acc_n)
    pairs = [_into_slice(w, a, j) for w, a in zip(leaves, acc_leaves)]
    return treedef.unflatten([w for w, _ in pairs]), treedef.unflatten([a for _, a in pairs])
