"""16-bit floats carried as their uint16 bits through loops and writes on XLA:CPU, where a bf16 write costs a convert
of the whole written array; every other platform's program is left as it is.

XLA:CPU has no bf16 arithmetic: its normalization rewrites a write into a bf16 array (a loop's stacked output, a KV
cache's scatter or dynamic-update-slice) as a convert of the whole array to fp32, the write, and a convert back. In a
loop that is at every trip (a lax.map of 512 [16, 1024] bf16 tiles: 203 ms, its bits 7 ms); in a decode, at every
step. A bitcast moves no value: the same bits come out. On a TPU or GPU the bitcasts cost copies (a v5p sampler
program: +11% temporaries), so they apply only where the traced program's platform is the CPU
(sharding.current_platform: the mesh's, not the host's)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from cisjax import sharding


def active() -> bool:
    """Whether the program being traced runs on XLA:CPU."""
    return sharding.current_platform() == "cpu"


def to_bits(tree):
    """On the CPU, 16-bit float leaves (bf16, fp16) as their uint16 bits; other leaves, and every leaf elsewhere, as
    they are."""
    if not active():
        return tree
    return jax.tree.map(lambda a: lax.bitcast_convert_type(a, jnp.uint16) if _half(a.dtype) else a, tree)


def from_bits(tree, dtypes):
    """to_bits undone: each uint16 leaf whose dtype in `dtypes` (a tree of dtypes of the same structure) is a 16-bit
    float, back to it."""
    back = lambda a, d: lax.bitcast_convert_type(a, d) if _half(d) and a.dtype == jnp.uint16 else a  # noqa: E731
    return jax.tree.map(back, tree, dtypes)


def dtypes_of(tree):
    """The tree of `tree`'s leaves' dtypes (from_bits' second argument)."""
    return jax.tree.map(lambda a: jnp.dtype(a.dtype), tree)


def _half(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize == 2
