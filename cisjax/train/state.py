"""The train state: a pytree of arrays (params, optimizer, counters) that the step maps to itself."""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from cisjax.train import offload as offload_lib
from cisjax.train import optim


class TrainState(NamedTuple):
    """Everything a run needs to continue exactly; every leaf is a jax array (checkpointable).

    The model's static structure (nnx graphdef) and the optax transformation are not state: they
    are rebuilt from the config.
    """

    step: jax.Array  # int32 optimizer steps taken (including skipped ones)
    params: Any  # nnx.State of the model's nnx.Param variables (fp32 master weights by default)
    opt_state: Any  # optax state of the optimizer over `params`
    policy_version: jax.Array  # int32 version of the weights last published to the rollout engine (set by the loop)
    data_position: jax.Array  # int32 prompts the data stream has handed out, over all epochs (set by the loop)
    skipped_steps: jax.Array  # int32 updates skipped because a gradient was not finite


def create(
    model: nnx.Module, tx: optax.GradientTransformation, *, mesh=None, offload: bool = False
) -> tuple[nnx.GraphDef, TrainState]:
    """(graphdef, state) for a model and an optax transformation. With `mesh` (the model's params
    already loaded onto it), every leaf is placed on the mesh (see `place`; `offload`: the moments in host memory)."""
    graphdef, params = nnx.split(model, nnx.Param)
    zero = jnp.zeros((), jnp.int32)
    state = TrainState(
        step=zero,
        params=params,
        opt_state=None,
        policy_version=zero,
        data_position=zero,
        skipped_steps=zero,
    )
    if mesh is not None:
        return graphdef, place(state, tx, mesh, offload=offload)
    return graphdef, state._replace(opt_state=jax.jit(lambda p: tx.init(optim.init_view(p)))(params))


def place(state: TrainState, tx: optax.GradientTransformation, mesh, *, offload: bool = False) -> TrainState:
    """Every leaf on the mesh: params as they are (placed by the loader), the optimizer state
    (re)initialised with its moments sharded like their params (in host memory with `offload`:
    cisjax.train.offload), counters and scalars replicated."""
    check_placed(state.params, mesh, what="params leaf")
    if offload:
        offload_lib.check_mesh(mesh)
    init = lambda p: tx.init(optim.init_view(p))  # noqa: E731
    opt_state = jax.jit(init, out_shardings=_opt_shardings(tx, state.params, mesh, offload))(state.params)
    counters = {k: _replicated(v, mesh) for k, v in state._asdict().items() if k not in ("params", "opt_state")}
    return TrainState(params=state.params, opt_state=opt_state, **counters)


def with_counters(state: TrainState, *, policy_version: int, data_position: int) -> TrainState:
    """The state with the loop's two counters set (host ints, the same on every process), each kept on its sharding."""
    put = lambda old, v: jax.device_put(np.int32(v), old.sharding)  # noqa: E731
    return state._replace(
        policy_version=put(state.policy_version, policy_version), data_position=put(state.data_position, data_position)
    )


def abstract(params, tx: optax.GradientTransformation, mesh, *, offload: bool = False) -> TrainState:
    """The state `create(..., mesh=mesh, offload=offload)` would build, as jax.ShapeDtypeStructs carrying their
    shardings, from abstract params (ShapeDtypeStructs with shardings): for compiling the step ahead of time without
    allocating anything (cisjax plan). Devices without host memory (compile-only GPUs) keep the moments' memory
    kind unset: JAX drops it there."""
    replicated = NamedSharding(mesh, P())
    opt_sh = _opt_shardings(tx, params, mesh, offload)
    opt_state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        jax.eval_shape(tx.init, optim.init_view(params)),
        opt_sh,
    )
    scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    return TrainState(
        step=scalar,
        params=params,
        opt_state=opt_state,
        policy_version=scalar,
        data_position=scalar,
        skipped_steps=scalar,
    )


def _opt_shardings(tx, params, mesh, offload: bool = False):
    """Shardings of tx's state over `params` (arrays or ShapeDtypeStructs with shardings): moments like their
    params (in host memory with `offload`), everything else (counts) replicated."""
    replicated = NamedSharding(mesh, P())
    param_sh = jax.tree.map(lambda x: x.sharding, params)
    out = optax.tree_utils.tree_map_params(
        tx,
        lambda _, s: s,
        jax.eval_shape(tx.init, optim.init_view(params)),
        param_sh,
        transform_non_params=lambda _: replicated,
    )
    return offload_lib.shardings(tx, out, params) if offload else out


def _replicated(x, mesh):
    """x replicated over the mesh (kept if already on it); a process-local value must be the same in every process."""
    if isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh:
        return x
    host = np.asarray(jax.device_get(x))
    return jax.make_array_from_callback(host.shape, NamedSharding(mesh, P()), lambda index: host[index])


def shardings(state: TrainState):
    """The sharding of every leaf of a placed state, as the step's in/out shardings."""
    return jax.tree.map(lambda x: x.sharding, state)


def check_placed(tree, mesh, what: str = "state leaf") -> None:
    """Raise if a leaf is not on `mesh` (a state made without the mesh; params loaded without it)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not (isinstance(leaf.sharding, NamedSharding) and leaf.sharding.mesh == mesh):
            raise ValueError(
                f"{what} {jax.tree_util.keystr(path)} is not on the mesh {dict(mesh.shape)} (params: load "
                f"or init them with the mesh; the rest: train.state.create(..., mesh=mesh))"
            )
