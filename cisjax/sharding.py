"""Device mesh from config and the ONE table mapping logical axis names to mesh axes."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence

import flax.nnx as nnx
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from cisjax import errors

MESH_AXES = ("data", "fsdp", "tensor", "expert")

# Logical axis -> mesh axis (or tuple of mesh axes; None = replicated). Model code names only
# the left column. A mesh axis is used at most once per array; a dimension that the mesh axes do
# not divide evenly is replicated instead (tiny test models, odd head counts).
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # activations
    ("batch", ("data", "fsdp", "expert")),
    ("length", None),
    ("act_embed", None),
    ("act_heads", "tensor"),  # attention heads
    ("act_mlp", "tensor"),  # the MLP's hidden units (SwiGLU's product)
    # parameters
    ("layers", None),  # stacked decoder layers (transformer.stack_layers): every chip holds every layer
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),  # flattened (num_heads * head_dim) projections
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("expert", "expert"),
    ("expert_mlp", "tensor"),
    ("q_lora", None),
    ("kv_lora", None),
    ("norm", None),
    ("router_experts", None),  # router weight [embed, experts]: small, replicated
)

Rules = Mapping[str, "str | tuple[str, ...] | None"]


class FrozenRules(Mapping):
    """A resolved logical-axis table, frozen: immutable, hashable (a jit or cache key as it is), equal to any mapping
    with the same entries. rules_from_config makes the one table of a run, where its spec is built; every stage that
    shards takes that value, so the rules are resolved once."""

    __slots__ = ("_table", "_hash")

    def __init__(self, table: Mapping | Sequence = ()):
        items = table.items() if isinstance(table, Mapping) else table
        self._table = {str(k): tuple(v) if isinstance(v, list) else v for k, v in items}
        self._hash = hash(frozenset(self._table.items()))

    def __getitem__(self, name: str):
        return self._table[name]

    def __iter__(self):
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return isinstance(other, Mapping) and self._table == dict(other.items())

    def __repr__(self) -> str:
        return f"FrozenRules({self._table!r})"


def rules_from_config(overrides: Mapping | None = None) -> FrozenRules:
    """The default table with per-entry overrides (e.g. from `config.sharding.rules`), checked and frozen. Called where
    a spec is built (train.spec, score.ScoreSpec), not by the stages (tests/test_structure.py)."""
    rules = dict(DEFAULT_RULES)
    for name, target in (overrides or {}).items():
        if isinstance(target, list):
            target = tuple(target)
        if target in ("", "none", "None"):
            target = None
        rules[name] = target
    for name, target in rules.items():
        axes = (target,) if isinstance(target, str) or target is None else target
        for axis in axes:
            if axis is not None and axis not in MESH_AXES:
                raise errors.UserError(
                    f"sharding rule {name!r} -> unknown mesh axis {axis!r}; mesh axes are {MESH_AXES}"
                )
        if len(set(axes)) != len(axes):
            raise errors.UserError(f"sharding rule {name!r} -> {target!r} names a mesh axis twice")
    return FrozenRules(rules)


# What a library call given no rules shards by (hf_io.load, the JAX sampler, checkpoint.target_shardings).
DEFAULT_TABLE = FrozenRules(DEFAULT_RULES)


def parse_mesh(text: str) -> dict[str, int]:
    """A --mesh flag (`cisjax plan`, `cisjax serve`), AXIS=SIZE[,AXIS=SIZE...], as {axis: size}; UserError naming a
    malformed item (the axes and sizes themselves are make_mesh's to check)."""
    shape = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        axis, sep, size = item.partition("=")
        if not sep:
            raise errors.UserError(
                f"--mesh {text!r}: expected AXIS=SIZE[,AXIS=SIZE...], e.g. fsdp=-1 or data=2,tensor=4"
            )
        try:
            shape[axis.strip()] = int(size)
        except ValueError:
            raise errors.UserError(
                f"--mesh {text!r}: size {size.strip()!r} of axis {axis.strip()!r} is not an integer"
            ) from None
    return shape


def make_mesh(shape: Mapping[str, int], devices: Sequence | None = None) -> Mesh:
    """A mesh with axes (data, fsdp, tensor, expert); one size may be -1 to take the rest."""
    devices = list(devices if devices is not None else jax.devices())
    unknown = set(shape) - set(MESH_AXES)
    if unknown:
        raise errors.UserError(f"unknown mesh axes {sorted(unknown)}; valid: {MESH_AXES}")
    sizes = [int(shape.get(a, 1)) for a in MESH_AXES]
    if any(s < 1 and s != -1 for s in sizes):
        raise errors.UserError(f"mesh sizes must be positive or -1, got {dict(zip(MESH_AXES, sizes))}")
    if sizes.count(-1) > 1:
        raise errors.UserError("at most one mesh axis may be -1")
    if -1 in sizes:
        rest = math.prod(s for s in sizes if s != -1)
        if len(devices) % rest:
            raise errors.UserError(f"mesh {dict(zip(MESH_AXES, sizes))} does not divide {len(devices)} devices")
        sizes[sizes.index(-1)] = len(devices) // rest
    if math.prod(sizes) != len(devices):
        raise errors.UserError(
            f"mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, have {len(devices)}"
        )
    arr = np.asarray(devices).reshape(sizes)
    return Mesh(arr, MESH_AXES)


def logical_to_spec(
    axes: Sequence[str | None], rules: Rules, mesh: Mesh, shape: Sequence[int] | None = None
) -> PartitionSpec:
    """PartitionSpec for an array whose dimensions carry the logical names `axes`."""
    used: set[str] = set()
    out = []
    for i, name in enumerate(axes):
        target = rules.get(name) if name is not None else None
        if name is not None and name not in rules:
            raise KeyError(f"logical axis {name!r} has no entry in the sharding rules")
        targets = () if target is None else ((target,) if isinstance(target, str) else tuple(target))
        targets = tuple(t for t in targets if t not in used and mesh.shape.get(t, 1) > 1)
        if shape is not None and targets:
            # keep the longest prefix of mesh axes that divides the dimension
            while targets and shape[i] % math.prod(mesh.shape[t] for t in targets):
                targets = targets[:-1]
        used.update(targets)
        out.append(None if not targets else (targets[0] if len(targets) == 1 else targets))
    return PartitionSpec(*out)


def named_sharding(axes, rules: Rules, mesh: Mesh, shape=None) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(axes, rules, mesh, shape))


# Logical names of every [M, B, T] field of a TrainBatch: micro-batches replicated, rows split like activations.
BATCH_AXES = (None, "batch", "length")


def axis_multiple(mesh: Mesh, rules: Rules, name: str) -> int:
    """How many shards the logical axis `name` splits into on this mesh: a dimension so named must be a multiple of
    it to be split rather than replicated (the product of the mesh axes the rules map it to)."""
    spec = logical_to_spec((name,), rules, mesh)
    axes = spec[0] if len(spec) else None
    if axes is None:
        return 1
    return math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))


def batch_sharding(mesh: Mesh, rules: Rules) -> NamedSharding:
    """Sharding of every [M, B, T] field of a TrainBatch: M replicated, B over the "batch" mesh axes (B must be a
    multiple of axis_multiple(mesh, rules, "batch"))."""
    return named_sharding(BATCH_AXES, rules, mesh)


def place(tree, mesh: Mesh, rules: Rules, axes: Sequence[str | None] = ("batch", "length")):
    """Global arrays of a host pytree, each leaf sharded by the logical names of its leading dims (rest replicated).

    Multi-process safe: every process holds the same full host copy and contributes the shards its devices own
    (jax.make_array_from_callback), where a device_put of a host array would assume one process."""

    def one(x):
        x = np.asarray(x)
        names = tuple(axes[: x.ndim]) + (None,) * (x.ndim - len(axes))
        target = named_sharding(names, rules, mesh, x.shape)
        return jax.make_array_from_callback(x.shape, target, lambda index: x[index])

    return jax.tree.map(one, tree)


def freeze(rules: Rules) -> FrozenRules:
    """A rules table as a FrozenRules (a jit / cache key): the table itself when it is one."""
    return rules if isinstance(rules, FrozenRules) else FrozenRules(rules)


# --- activation constraints: model code calls `constrain(x, ("batch", "length", "act_embed"))`.
# A jax user context, not a plain contextvar: its value is part of jit's cache key, so a function
# traced without (or under another) mesh or rules table is re-traced instead of silently reused.
_CTX = jax.make_user_context(default_value=None)
# inside a shard_map body (`manual`): the arrays are each device's own, so `constrain` is the identity there
_MANUAL = jax.make_user_context(default_value=False)


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules: Rules | None = None):
    """Make `constrain` active (inside jit traces) for this mesh and rules table."""
    with _CTX((mesh, freeze(rules if rules is not None else DEFAULT_TABLE))):
        yield mesh


@contextlib.contextmanager
def manual():
    """A shard_map body's trace: `constrain` does nothing (the body's arrays are per device), while current_platform
    still follows the active mesh."""
    with _MANUAL(True):
        yield


def active() -> tuple[Mesh, FrozenRules] | None:
    """The (mesh, rules table) that use_mesh made active, or None."""
    return _CTX.value


GPU_PLATFORMS = ("gpu", "cuda")  # a GPU machine's devices, and cisjax plan's deviceless CUDA targets


def current_platform() -> str:
    """The platform of the program being traced: that of the active mesh's devices (use_mesh), else JAX's default
    backend. Hardware-dependent choices follow it, not the host: a CPU host compiling for a TPU mesh (cisjax plan)
    must trace the TPU program."""
    ctx = _CTX.value
    if ctx is not None:
        return mesh_platform(ctx[0])
    return jax.default_backend()


def mesh_platform(mesh: Mesh) -> str:
    """The platform of a mesh's devices (cpu, tpu, gpu; cuda for cisjax plan's deviceless GPU targets)."""
    return mesh.devices.flat[0].platform


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """Sharding constraint by logical names; identity when no mesh is active or inside a shard_map body (manual)."""
    ctx = _CTX.value
    if ctx is None or _MANUAL.value:
        return x
    mesh, rules = ctx
    return jax.lax.with_sharding_constraint(x, named_sharding(axes, rules, mesh, x.shape))


def param_shardings(abstract_state, mesh: Mesh, rules: Rules):
    """NamedSharding for every variable of an nnx state, from its `axes` metadata."""

    def one(v):
        axes = v.get_metadata().get("axes")
        if axes is None:
            raise ValueError(f"variable of shape {v.shape} has no logical `axes` metadata")
        return named_sharding(axes, rules, mesh, v.shape)

    return jax.tree.map(one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
