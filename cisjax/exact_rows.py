"""The exact sampler's programs on a mesh: each device runs them on its own rows (shard_map over the "batch" axes), so
its KV cache and rows split over the chips like the plain sampler's, the weights gathered whole a layer at a time."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import NamedTuple

import flax.nnx as nnx
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from cisjax import runtime, sharding
from cisjax.models.transformer import CausalLM, layer_of, layer_runs


class Weights(NamedTuple):
    """What a program body computes with: the model (its weights outside the decoder layers whole) and its decoder
    layers in order, each whole (None: the exact path slices them out of the model's stacks, exact.layers)."""

    model: CausalLM
    layers: Iterable | None


def shards(mesh, rules) -> int:
    """How many parts the exact sampler splits its rows into on `mesh` (1: no mesh, or no batch axis over 1 device)."""
    return 1 if mesh is None else sharding.axis_multiple(mesh, rules, "batch")


def rows_spec(mesh, rules) -> P:
    """A per-row array's PartitionSpec: its leading (row) dimension over the mesh axes of "batch"."""
    return P(sharding.logical_to_spec(("batch",), rules, mesh)[0])


def apply(fn: Callable, graphdef, layer_graphdefs, mesh, rules, params, layers, rows: tuple, same: tuple = ()):
    """fn(Weights, *rows, *same) -> a pytree of per-row arrays. Without row shards (`shards` 1) called as it is; with
    them, on each device over its own rows of `rows` (every array [R, ...]; R padded to a multiple of the shards), `same`
    replicated: the params (and `layers`, ExactEngine's split layers) come in as their shards and are gathered inside,
    the weights outside the layers at once, each layer's as the program reaches it (so that a chip holds one layer's
    whole weights at a time, as the FSDP train step's all-gathers do). A row's values do not depend on the other rows
    (cisjax.models.exact): the same bits as one program over all rows."""
    n = shards(mesh, rules)
    if n == 1:
        with _model(graphdef, params, mesh, rules) as model:
            split = None if layers is None else [nnx.merge(g, st) for g, st in zip(layer_graphdefs, layers)]
            return fn(Weights(model, split), *rows, *same)
    r = jax.tree.leaves(rows)[0].shape[0]
    if r % n:  # rows of zeros up to a multiple of the shards (a row's values do not depend on the others)
        pad = lambda a: jnp.pad(a, [(0, n - r % n)] + [(0, 0)] * (a.ndim - 1))  # noqa: E731
        out = apply(fn, graphdef, layer_graphdefs, mesh, rules, params, layers, jax.tree.map(pad, rows), same)
        return jax.tree.map(lambda a: a[:r], out)
    pspecs = _specs(params, mesh, rules)
    lspecs = None if layers is None else [_specs(st, mesh, rules) for st in layers]
    row = rows_spec(mesh, rules)

    def body(params, layers, *args):
        with _model(graphdef, _gather(params, pspecs, skip="stacks"), mesh, rules, manual=True) as model:
            if layers is None:
                split = _stack_layers(model, pspecs)
            else:
                split = (nnx.merge(g, _gather(st, sp)) for g, st, sp in zip(layer_graphdefs, layers, lspecs))
            return fn(Weights(model, split), *args)

    in_specs = (pspecs, lspecs, *(jax.tree.map(lambda _: row, a) for a in rows), *(P() for _ in same))
    run = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=row, check_vma=False)
    return run(params, layers, *rows, *same)


def apply_rows(fn: Callable, mesh, rules, rows: tuple):
    """fn(*rows) -> per-row arrays, on each device over its own rows (as `apply`, without weights)."""
    if shards(mesh, rules) == 1:
        return fn(*rows)
    row = rows_spec(mesh, rules)

    def body(*args):
        with trace(mesh, rules, manual=True):
            return fn(*args)

    in_specs = tuple(jax.tree.map(lambda _: row, a) for a in rows)
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=row, check_vma=False)(*rows)


def split_rows(tree, mesh, rules):
    """Per-row arrays [R, ...] laid out with their rows over the batch axes (GSPMD moves them; no-op without shards)."""
    if shards(mesh, rules) == 1:
        return tree
    spec = NamedSharding(mesh, rows_spec(mesh, rules))
    return jax.tree.map(lambda a: lax.with_sharding_constraint(a, spec), tree)


@contextlib.contextmanager
def trace(mesh, rules, manual: bool = False):
    """A program body's trace context: the mesh and rules (with them, constraints off inside a shard_map body)."""
    with contextlib.ExitStack() as stack:
        if mesh is not None:
            stack.enter_context(sharding.use_mesh(mesh, rules))
        if manual:
            stack.enter_context(sharding.manual())
        yield


@contextlib.contextmanager
def _model(graphdef, params, mesh, rules, manual: bool = False):
    """The model of `params` under trace, in its compute dtype's matmul precision."""
    with trace(mesh, rules, manual):
        model = nnx.merge(graphdef, params)
        with runtime.matmul_precision(model.cfg.dtype):
            yield model


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def _specs(state, mesh, rules):
    """The PartitionSpec of every Variable of an nnx state (its `axes`, as the trainer shards it)."""
    return jax.tree.map(
        lambda s: s.spec,
        sharding.param_shardings(state, mesh, rules),
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )


def _whole(x, spec):
    """A shard's whole array: all_gather over each dimension's mesh axes."""
    for dim, axes in enumerate(spec):
        if axes is not None:
            x = lax.all_gather(x, axes, axis=dim, tiled=True)
    return x


def _gather(state, specs, skip: str | None = None):
    """Every Variable of `state` gathered whole, except those under its top-level key `skip`."""

    def one(path, v, spec):
        if skip is not None and getattr(path[0], "key", None) == skip:
            return v
        return v.replace(_whole(v[...], spec))

    return jax.tree_util.tree_map_with_path(one, state, specs, is_leaf=_is_var)


def _stack_layers(model: CausalLM, pspecs):
    """exact.layers(model) of a model whose stacks hold the device's shards: each layer sliced, then gathered whole
    when the program reaches it (a generator)."""
    for r, run in enumerate(layer_runs(model.cfg)):
        stack_specs = jax.tree.map(lambda s: P(*s[1:]), pspecs["stacks"][r], is_leaf=lambda x: isinstance(x, P))
        for j in range(len(run)):
            g, st = nnx.split(layer_of(model.stacks[r], j))
            yield nnx.merge(g, _gather(st, stack_specs))
