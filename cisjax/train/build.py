"""A train run built once from a validated config: mesh, rules, model, optimizer, state and the jitted programs; the one
builder of the loop, the planner (abstract params) and the GPU check (random params)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
from flax import nnx

from cisjax import sharding
from cisjax.models import hf_io
from cisjax.train import optim, validate
from cisjax.train import state as state_lib
from cisjax.train import step as step_lib
from cisjax.train.spec import TrainSpec
from cisjax.train.step import TrainStep


@dataclass
class Run:
    """Everything the loop, the publisher, the demo's warm-up and the benches take from the config, built once.

    `state` is the freshly initialised TrainState (the loop replaces it with a restored one on resume: the shapes and
    shardings, hence the programs, are the same)."""

    spec: TrainSpec  # the config, validated and typed
    mesh: Any  # jax.sharding.Mesh
    rules: sharding.FrozenRules  # logical axis -> mesh axes: the spec's own table (spec.rules)
    graphdef: Any  # the model's nnx graph definition
    hf_config: dict  # the model's HF config.json (what an export writes)
    tx: Any  # the optax optimizer
    state: Any  # TrainState
    train_step: TrainStep  # (state, batch) -> (state, metrics), state donated
    # (params, batch) -> logprobs_MxBxT: the proximal rescoring; (logprobs, forward.Flips) if replay. None under
    # train.proximal=step (the step computes p_prox itself)
    rescore: Callable | None
    rows_multiple: int  # a batch's rows must be a multiple of this (the "batch" mesh axes)
    # routing replay: routing.replay = "rollout" on a model with MoE layers (a dense one ignores it)
    replay: bool = False


PARAMS = ("load", "random", "abstract")  # where build_run's parameters come from


def build(cfg, *, model_dir=None, mesh=None, inputs: bool = True) -> Run:
    """Validate `cfg` once (train.validate.check: one error naming every bad field, else the TrainSpec), then
    build_run. inputs=False: a bench or the demo's warm-up, which give the model directory and make their own
    batches."""
    return build_run(validate.check(cfg, inputs=inputs), model_dir=model_dir, mesh=mesh)


def build_run(
    spec: TrainSpec, *, params: str = "load", model_dir=None, hf: dict | None = None, mesh=None, seed=0
) -> Run:
    """The run of a validated config: the mesh (spec.mesh, or `mesh`), the model with the spec's runtime, the optimizer,
    the state on the mesh, the train step and the rescoring. `params`: "load" the checkpoint in `model_dir` (default
    model.path); "random" weights initialised from `seed` and placed on the mesh; "abstract" ShapeDtypeStructs with
    their shardings, nothing allocated (cisjax plan compiles the run's programs on them). `hf`: the model's HF config
    for random and abstract params (default: read from `model_dir` or model.path)."""
    if params not in PARAMS:
        raise ValueError(f"params={params!r}: one of {PARAMS}")
    mesh = mesh if mesh is not None else sharding.make_mesh(dict(spec.mesh))
    rules = spec.rules
    tx = optim.make_optimizer(spec.step.optim)
    offload = spec.step.optim.offload_optimizer
    kwargs = spec.runtime.model_kwargs()
    if params == "load":
        model, _, hf = hf_io.load(model_dir or spec.model_path, mesh=mesh, rules=rules, **kwargs)
        moe = bool(model.moe_layers)
        graphdef, state = state_lib.create(model, tx, mesh=mesh, offload=offload)
        del model
    else:
        hf = hf if hf is not None else hf_io.read_hf_config(model_dir or spec.model_path)
        mcfg = hf_io.model_config(hf, **kwargs)
        graphdef, abstract = hf_io.abstract_model(hf, mcfg)
        is_var = lambda v: isinstance(v, nnx.Variable)  # noqa: E731
        shardings = sharding.param_shardings(abstract, mesh, rules)
        moe = bool(nnx.merge(graphdef, abstract).moe_layers)
        if params == "abstract":
            like = lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s))  # noqa: E731
            state = state_lib.abstract(
                jax.tree.map(like, abstract, shardings, is_leaf=is_var), tx, mesh, offload=offload
            )
        else:
            out = jax.tree.map(lambda v, s: v.replace(s), abstract, shardings, is_leaf=is_var)
            init = jax.jit(lambda: nnx.split(hf_io.init_model(hf, mcfg, seed), nnx.Param)[1], out_shardings=out)
            graphdef, state = state_lib.create(nnx.merge(graphdef, init()), tx, mesh=mesh, offload=offload)
    state_sh = state_lib.shardings(state)
    replay = spec.replay and moe
    return Run(
        spec=spec,
        mesh=mesh,
        rules=rules,
        graphdef=graphdef,
        hf_config=hf,
        tx=tx,
        state=state,
        train_step=step_lib.make_train_step(graphdef, tx, spec.step, mesh, rules, state_sh),
        rescore=(
            step_lib.make_rescore(graphdef, spec.step, mesh, rules, state_sh.params, flips=replay)
            if spec.step.proximal == "rescore"
            else None
        ),
        rows_multiple=sharding.axis_multiple(mesh, rules, "batch"),
        replay=replay,
    )
