"""A train run built once from a validated config: mesh, rules, model, optimizer, state and the jitted programs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
    rules: dict  # logical axis -> mesh axes
    graphdef: Any  # the model's nnx graph definition
    hf_config: dict  # the model's HF config.json (what an export writes)
    tx: Any  # the optax optimizer
    state: Any  # TrainState
    train_step: TrainStep  # (state, batch) -> (state, metrics), state donated
    # (params, batch) -> logprobs_MxBxT: the proximal rescoring; (logprobs, forward.Flips) if replay. None under
    # train.proximal=step (the step computes p_prox itself)
    rescore: Callable | None
    rows_multiple: int  # a batch's rows must be a multiple of this (the "batch" mesh axes)
    replay: bool = (
        False  # routing replay: routing.replay = "rollout" on a model with MoE layers (a dense one ignores it)
    )


def build(cfg, *, model_dir=None, mesh=None, inputs: bool = True) -> Run:
    """Validate `cfg` once (train.validate.check: one error naming every bad field, else the TrainSpec), then
    build_run. inputs=False: a bench or the demo's warm-up, which give the model directory and make their own
    batches."""
    return build_run(validate.check(cfg, inputs=inputs), model_dir=model_dir, mesh=mesh)


def build_run(spec: TrainSpec, *, model_dir=None, mesh=None) -> Run:
    """The run of a validated config: the mesh (spec.mesh, or `mesh`), the model from `model_dir` (default
    model.path) with the spec's runtime, the optimizer, the state on the mesh, the train step and the rescoring."""
    mesh = mesh if mesh is not None else sharding.make_mesh(dict(spec.mesh))
    rules = dict(spec.rules)
    model, _, hf = hf_io.load(model_dir or spec.model_path, mesh=mesh, rules=rules, **spec.runtime.model_kwargs())
    replay = spec.replay and bool(model.moe_layers)
    tx = optim.make_optimizer(spec.step.optim)
    graphdef, state = state_lib.create(model, tx, mesh=mesh, offload=spec.step.optim.offload_optimizer)
    del model
    state_sh = state_lib.shardings(state)
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
