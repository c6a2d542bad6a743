"""AdamW's moments in host memory (train.offload_optimizer): their shardings, and the update a layer at a time."""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from cisjax import errors
from cisjax.train import optim

HOST, DEVICE = "pinned_host", "device"  # JAX's memory kinds: page-locked host memory, the accelerator's own
_STACKS = jax.tree_util.DictKey("stacks")  # the model's stacked layers in its param tree (CausalLM.stacks)
_REST, _NOT_PARAM = -1, -2  # tags: a parameter outside the stacks; an optimizer leaf that is no parameter (counts)


def host_memory_kinds(mesh) -> list[str]:
    """The memory kinds the mesh's devices offer (compile-only GPU devices offer none)."""
    try:
        return sorted({m.kind for m in mesh.devices.flat[0].addressable_memories()})
    except Exception:  # a compile-only device without memories
        return []


def check_mesh(mesh) -> None:
    """Refuse train.offload_optimizer on devices without page-locked host memory, naming what they have."""
    kinds = host_memory_kinds(mesh)
    if HOST not in kinds:
        platform = mesh.devices.flat[0].platform
        raise errors.UserError(
            f"train.offload_optimizer: the mesh's {platform} devices have no {HOST!r} memory (they offer "
            f"{kinds or 'none'}), so the optimizer state cannot live in host memory there; set "
            "train.offload_optimizer=false"
        )


def offloaded(param, tag: int) -> bool:
    """Whether a parameter's moments live in host memory: those outside the stacks, and the stacked matrices. The
    stacked vectors and degenerate matrices ([layers, D], [layers, D, 1]: norm weights, biases, a shared-expert gate),
    a few KiB per layer, stay on the device: XLA:TPU lays such a host array out with the layers on a packed minor
    dimension and cannot then copy one layer of it ("sublane slicing size must be multiple of element packing
    factor")."""
    return tag == _REST or (len(param.shape) >= 3 and min(param.shape[1:]) > 1)


def shardings(tx, opt_shardings, params):
    """`opt_shardings` (the optimizer state's, moments like their params) with the moments in host memory (those
    `offloaded` says); the counts stay on the device."""
    return optax.tree_utils.tree_map_params(
        tx,
        lambda s, p, t: s.with_memory_kind(HOST) if offloaded(p, t) else s,
        opt_shardings,
        params,
        _tags(params),
        transform_non_params=lambda s: s,
    )


def moment_bytes(tx, opt_state, params=None) -> int:
    """Bytes of the moments one device holds (abstract or concrete state, each leaf with its sharding); with
    `params`, of those train.offload_optimizer keeps in host memory (`offloaded`): what crosses the host link each way
    per step."""
    size = lambda x: jnp.dtype(x.dtype).itemsize * math.prod(x.sharding.shard_shape(x.shape))  # noqa: E731
    if params is None:
        sizes = optax.tree_utils.tree_map_params(tx, size, opt_state, transform_non_params=lambda _: 0)
    else:
        sizes = optax.tree_utils.tree_map_params(
            tx,
            lambda x, p, t: size(x) if offloaded(p, t) else 0,
            opt_state,
            params,
            _tags(params),
            transform_non_params=lambda _: 0,
        )
    return int(sum(jax.tree.leaves(sizes)))


def update(tx_parts, grads, opt_state, params, ok, opt_shardings, count):
    """(new params, new optimizer state): make_optimizer's update (optim.make_parts: clipping, then AdamW) with the
    moments in host memory, brought to the device one layer at a time.

    Clipping scales the whole gradient first (it needs the global norm). AdamW is elementwise, so it is applied to
    parts of the tree: each stack's layers in a loop, each layer's moments copied to the device, updated with that
    layer's gradient and weights, and written back into the host arrays in place; then the parameters outside the
    stacks (embeddings, final norm, head) in one call, which also advances the counts. Where `ok` is false every
    leaf keeps its old value, as in the step's other path. `count`: the step, for bf16 master weights' rounding
    (optim.apply_updates). Equal to the whole-tree update to fp32 rounding (the same elementwise arithmetic); with
    bfloat16 moments each layer rounds with its own random bits."""
    clip, adamw = tx_parts
    inner, inner_sh = (opt_state[1], opt_shardings[1]) if clip is not None else (opt_state, opt_shardings)
    if clip is not None:
        grads, _ = clip.update(grads, opt_state[0])
    tags = _tags(params)
    stags = optax.tree_utils.tree_map_params(
        adamw, lambda _, t: t, inner, tags, transform_non_params=lambda _: _NOT_PARAM
    )
    keep = lambda new, old: jnp.where(ok, new, old)  # noqa: E731

    layers_of = {}  # stack -> its layers (the leading dimension of its leaves)
    for leaf, tag in zip(jax.tree.leaves(params), jax.tree.leaves(tags)):
        if tag >= 0:
            layers_of.setdefault(tag, leaf.shape[0])
    parts = _Parts(adamw, grads, tags, stags, inner_sh, keep, count)
    salt = 0
    for r, layers in sorted(layers_of.items()):
        params, inner = lax.fori_loop(0, layers, functools.partial(_layer, parts, r, salt), (params, inner))
        salt += layers

    # the rest in one call; the counts advance here (the layers' calls above started from the same counts)
    g_r = jax.tree.map(lambda g, t: g if t == _REST else _empty(g), grads, tags)
    p_r = jax.tree.map(lambda p, t: p if t == _REST else _empty(p), params, tags)
    s_r = jax.tree.map(
        lambda m, t, sh: (
            jax.device_put(m, sh.with_memory_kind(DEVICE)) if t == _REST else (m if t == _NOT_PARAM else _empty(m))
        ),
        inner,
        stags,
        inner_sh,
    )
    u_r, s_new = adamw.update(g_r, s_r, p_r)
    p_new = jax.tree.map(keep, optim.apply_updates(p_r, u_r, count), p_r)
    s_new = jax.tree.map(keep, s_new, s_r)
    params = jax.tree.map(lambda p, pn, t: pn if t == _REST else p, params, p_new, tags)
    inner = jax.tree.map(
        lambda m, mn, t, sh: jax.device_put(mn, sh) if t == _REST else (mn if t == _NOT_PARAM else m),
        inner,
        s_new,
        stags,
        inner_sh,
    )
    return params, ((opt_state[0], inner) if clip is not None else inner)


class _Parts(NamedTuple):
    """What each layer's update reads besides the carried params and moments."""

    adamw: Any
    grads: Any
    tags: Any  # params-shaped: each parameter's stack, or _REST
    stags: Any  # AdamW-state-shaped: each moment's stack, _REST, or _NOT_PARAM (the counts)
    inner_sh: Any  # AdamW's state's shardings (moments in host memory)
    keep: Any  # (new, old) -> new where the gradient is finite, else old
    count: Any  # the step (bf16 master weights' rounding)


def _layer(parts: _Parts, r: int, salt: int, i, carry):
    """Layer i of stack r: its moments to the device, AdamW with its gradient and weights, its params and moments
    written back in place (the moments into their host arrays)."""
    params, inner = carry
    g_i = jax.tree.map(lambda g, t: g[i] if t == r else _empty(g), parts.grads, parts.tags)
    p_i = jax.tree.map(lambda p, t: p[i] if t == r else _empty(p), params, parts.tags)
    s_i = jax.tree.map(
        lambda m, t, sh: jax.device_put(m[i], _slice(sh, DEVICE)) if t == r else (m if t == _NOT_PARAM else _empty(m)),
        inner,
        parts.stags,
        parts.inner_sh,
    )
    u_i, s_new = parts.adamw.update(g_i, s_i, p_i, rounding_salt=salt + 1 + i)
    p_new = jax.tree.map(parts.keep, optim.apply_updates(p_i, u_i, parts.count, salt=salt + 1 + i), p_i)
    s_new = jax.tree.map(parts.keep, s_new, s_i)
    params = jax.tree.map(
        lambda p, pn, t: lax.dynamic_update_index_in_dim(p, pn, i, 0) if t == r else p, params, p_new, parts.tags
    )
    inner = jax.tree.map(
        lambda m, mn, t, sh: (
            lax.dynamic_update_index_in_dim(m, jax.device_put(mn, _slice(sh, sh.memory_kind)), i, 0) if t == r else m
        ),
        inner,
        s_new,
        parts.stags,
        parts.inner_sh,
    )
    return params, inner


def _empty(x):
    """A leaf outside the part being updated: an empty array, so AdamW does no work on it."""
    return jnp.zeros((0,), x.dtype)


def _tags(params):
    """Each parameter's stack (its index), or _REST: a tree like `params`."""
    return jax.tree_util.tree_map_with_path(lambda path, _: _tag(path), params)


def _tag(path) -> int:
    """The stack a parameter belongs to (its index), or _REST."""
    if len(path) > 1 and path[0] == _STACKS and isinstance(path[1], jax.tree_util.DictKey):
        return int(path[1].key)
    return _REST


def _slice(sh: NamedSharding, kind: str) -> NamedSharding:
    """The sharding of one layer of a stacked leaf (its leading layers dimension dropped), in memory `kind`."""
    return NamedSharding(sh.mesh, P(*tuple(sh.spec)[1:]), memory_kind=kind)
