"""The one run builder (train.build.build_run): the params loaded, random or abstract give the same run's shapes,
shardings and programs, on 8 fake CPU devices."""

import jax
import numpy as np
import pytest

from cisjax import sharding
from cisjax.plan.programs import BATCH_DTYPES
from cisjax.records import TrainBatch
from cisjax.train import build, publish
from tests.support import steps
from tests.support.runs import spec_of

MESH = {"fsdp": 2, "tensor": 2, "expert": 2}


def _spec():
    return spec_of(steps.make_cfg())


def _leaves(state):
    return jax.tree.leaves(state)


def test_abstract_params_are_the_random_runs_shapes_and_shardings_and_allocate_nothing():
    mesh = sharding.make_mesh(MESH)
    spec = _spec()
    real = build.build_run(spec, params="random", hf=steps.TINY_HF, mesh=mesh)
    abstract = build.build_run(spec, params="abstract", hf=steps.TINY_HF, mesh=mesh)
    assert jax.tree.structure(real.state) == jax.tree.structure(abstract.state)
    for x, a in zip(_leaves(real.state), _leaves(abstract.state), strict=True):
        assert isinstance(a, jax.ShapeDtypeStruct) and isinstance(x, jax.Array)
        assert (a.shape, a.dtype) == (x.shape, x.dtype) and a.sharding.is_equivalent_to(x.sharding, x.ndim)
    assert abstract.rows_multiple == real.rows_multiple and abstract.replay == real.replay
    # the abstract run's step compiles on abstract inputs: the program the planner reads
    b = 2 * real.rows_multiple
    sh = sharding.batch_sharding(mesh, spec.rules)
    batch = TrainBatch(
        *(None if dt is None else jax.ShapeDtypeStruct((1, b, 16), dt, sharding=sh) for dt in BATCH_DTYPES)
    )
    assert abstract.train_step.jitted.lower(abstract.state, batch).compile() is not None


def test_the_specs_rules_are_the_runs_and_its_publishers(tmp_path):
    """The rules are resolved once, in the spec (a frozen table): the run and its publisher take that object itself,
    and it shards as the config's table does."""
    cfg = steps.make_cfg()
    with cfg.unlocked():
        cfg.sharding.rules.embed = "none"  # as --config.sharding.rules.embed=none
    spec = spec_of(cfg)
    assert isinstance(spec.rules, sharding.FrozenRules) and spec.rules["embed"] is None
    assert spec.rules == sharding.rules_from_config({"embed": None}) and hash(spec.rules) is not None
    run = build.build_run(spec, params="abstract", hf=steps.TINY_HF, mesh=sharding.make_mesh(MESH))
    assert run.rules is spec.rules
    assert publish.Publisher.for_run(run, client=object(), root=tmp_path).rules is spec.rules


def test_random_params_follow_the_seed():
    mesh = sharding.make_mesh(MESH)
    spec = _spec()
    a, b, c = (build.build_run(spec, params="random", hf=steps.TINY_HF, mesh=mesh, seed=s) for s in (0, 0, 1))
    pa, pb, pc = (jax.tree.leaves(r.state.params) for r in (a, b, c))
    assert all(np.array_equal(x, y) for x, y in zip(pa, pb, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(pa, pc, strict=True))


def test_unknown_params_source_is_refused():
    with pytest.raises(ValueError, match="params='disk'"):
        build.build_run(_spec(), params="disk", hf=steps.TINY_HF)
