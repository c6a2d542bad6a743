"""cisjax.runtime: float32 on a GPU means float32 (no TF32): the matmul precision the trainer's step, the rescoring
and the sampler are traced under, by the program's platform and compute dtype."""

import jax
import jax.numpy as jnp
import pytest

from cisjax import runtime, sharding
from cisjax.train import state as state_lib
from cisjax.train import step as step_lib
from tests.support import steps
from tests.support.programs import jaxpr_dots
from tests.support.runs import spec_of


@pytest.mark.parametrize(
    "dtype, platform, want",
    [
        (jnp.float32, "gpu", "highest"),
        (jnp.float32, "cuda", "highest"),  # cisjax plan's deviceless GPU targets
        (jnp.bfloat16, "gpu", None),  # bf16 inputs: no TF32 to avoid
        (jnp.float32, "cpu", None),
        (jnp.float32, "tpu", None),
    ],
)
def test_matmul_precision_by_dtype_and_platform(dtype, platform, want):
    with runtime.matmul_precision(dtype, platform):
        assert jax.config.jax_default_matmul_precision == want
    assert jax.config.jax_default_matmul_precision is None


@pytest.mark.parametrize(
    "precision, moe_impl", [("fp32", "auto"), ("fp32", "tiled"), ("bf16", "auto")]
)  # auto: the Triton kernels on a GPU; tiled: XLA matmuls in its custom backward
def test_the_train_step_and_rescoring_traced_for_a_gpu(monkeypatch, precision, moe_impl):
    """Every matmul of the step (forward, backward, the MoE's, the logprob head's) and of the rescoring at HIGHEST
    under fp32, none outside the kernels under bf16 (the Triton kernels ask for HIGHEST always: it changes nothing
    for bf16 blocks)."""
    monkeypatch.setattr(sharding, "mesh_platform", lambda mesh: "gpu")
    cfg = steps.make_cfg(precision=precision)
    cfg.model.moe_impl = moe_impl
    mesh = steps.mesh_for("single")
    graphdef, tx, rules, state = steps.build(cfg, mesh)
    spec = spec_of(cfg).step
    train_step = step_lib.make_train_step(graphdef, tx, spec, mesh, rules, state_lib.shardings(state))
    rescore = step_lib.make_rescore(graphdef, spec, mesh, rules)
    batch = sharding.place(steps.host_batch(), mesh, rules, sharding.BATCH_AXES)
    highest = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
    for program, args in ((train_step.jitted, (state, batch)), (rescore, (state.params, batch))):
        dots = list(jaxpr_dots(jax.make_jaxpr(program)(*args).jaxpr))
        outside = [eqn.params["precision"] for eqn, inside in dots if not inside]
        assert len(outside) > 5, outside
        if moe_impl == "auto":
            assert any(inside for _, inside in dots)  # the Triton kernels
        if precision == "fp32":
            assert all(p == highest for p in outside), outside
        else:
            assert not any(p == highest for p in outside), outside
