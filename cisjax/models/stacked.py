"""A layer of a stacked array left in its stack (LayerOf): kernels that take the stack index the layer themselves."""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.tree_util.register_pytree_node_class
class LayerOf:
    """Layer `layer` (an int32 scalar, traced: a scan's) of `stack` [n, ...], not sliced out: XLA copies a layer
    sliced out of a stack in a loop to hand it to a custom call (a Pallas kernel), a whole layer's buffer per step.
    A reader that takes the stack and the layer (the GPU's decode attention and grouped matmuls) reads it in place;
    any other reads `[...]` (or `array()`): the slice, as before. `dtype`: the dtype the reader computes in (astype
    records it; array() casts to it)."""

    def __init__(self, stack: jax.Array, layer, dtype=None):
        self.stack, self.layer = stack, layer
        self.dtype = jnp.dtype(dtype or stack.dtype)

    @property
    def shape(self) -> tuple:
        return tuple(self.stack.shape[1:])

    @property
    def ndim(self) -> int:
        return self.stack.ndim - 1

    def astype(self, dtype) -> LayerOf:
        return LayerOf(self.stack, self.layer, dtype)

    def array(self) -> jax.Array:
        """The layer sliced out of its stack, in `dtype`."""
        return jax.lax.dynamic_index_in_dim(self.stack, self.layer, keepdims=False).astype(self.dtype)

    def __getitem__(self, key):
        return self.array()[key]

    def tree_flatten(self):
        return (self.stack, self.layer), self.dtype

    @classmethod
    def tree_unflatten(cls, dtype, children):
        return cls(*children, dtype)


def array(x) -> jax.Array:
    """x as an array: a LayerOf's layer sliced out, anything else as it is."""
    return x.array() if isinstance(x, LayerOf) else x
