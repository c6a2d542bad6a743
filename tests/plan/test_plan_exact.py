"""`cisjax plan` of rollout.exact's programs: ExactEngine's prefill and decode step and the exact train step compiled
for a v5p slice (their memory and FLOPs beside the plain programs'), and flops.jaxpr_flops by hand."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from cisjax import sharding
from cisjax.models import exact as exact_lib
from cisjax.plan import flops
from tests.plan.test_plan import narrow_plan

EXACT = [
    "--config.rollout.exact=true",
    "--config.rollout.colocated=true",
    "--config.rollout.backend=jax",
    "--config.rollout.max_staleness=0",
]
SHAPES = [
    "--config.data.prompts_per_step=6",  # 8 prompts
    "--config.rollout.group_size=4",  # 32 rows
    "--config.data.max_prompt_tokens=100",  # 128
    "--config.rollout.max_new_tokens=200",  # 256
]


def _flops(fn, *args):
    return flops.jaxpr_flops(jax.jit(fn).trace(*args).jaxpr.jaxpr)


def test_jaxpr_flops_by_hand():
    a, b = jnp.zeros((4, 3)), jnp.zeros((3, 2))
    assert _flops(lambda a, b: a @ b, a, b) == 2 * 4 * 2 * 3  # 48
    # lax.map over 5 tiles: the body's 48 five times (XLA's cost_analysis would count it once)
    assert _flops(lambda x, b: lax.map(lambda t: t @ b, x), jnp.zeros((5, 4, 3)), b) == 5 * 48
    # batched dot [2, 4, 3] x [2, 3, 2]: 2 x 48; a cond's larger branch (a dot and a second one on it: 48 + 2 x 4 x 2 x 2)
    assert _flops(lambda x, y: jnp.einsum("bij,bjk->bik", x, y), jnp.zeros((2, 4, 3)), jnp.zeros((2, 3, 2))) == 96
    branches = (lambda a, b: (a @ b) @ jnp.ones((2, 2)), lambda a, b: a @ b)
    assert _flops(lambda p, a, b: lax.cond(p, *branches, a, b), True, a, b) == 48 + 32
    # a shard_map over 8 devices, each [1, 3] x [3, 2] of its row: 8 x 12 (its body counted on every device)
    mesh = sharding.make_mesh({"fsdp": 4, "data": 2})
    per_row = jax.shard_map(
        lambda x, b: x @ b, mesh=mesh, in_specs=(P(("data", "fsdp")), P()), out_specs=P(("data", "fsdp"))
    )
    assert _flops(per_row, jnp.zeros((8, 3)), b) == 8 * 2 * 1 * 2 * 3


@pytest.mark.slow
def test_narrow_exact_programs_on_v5p16(tmp_path, monkeypatch):
    """Qwen1.5-MoE's architecture, narrow, 2 layers, on v5p-16 (fsdp over its 8 chips: the exact path shards rows
    only): with rollout.exact the sampler is ExactEngine's prefill and decode step, the train step runs the exact
    forward too, so its matmul FLOPs (loops counted whole) exceed the plain step's at the same shapes by that
    forward's; each program fits."""
    # the narrow cut's 16 experts top-4 (E / k = 4) would take dense experts: expert tiles, as Qwen1.5-MoE's 60 take
    monkeypatch.setattr(exact_lib, "DENSE_MAX", 0)
    # the plain plan's train step only (its sampler is test_plan's): the FLOPs the exact step is measured against
    plain = narrow_plan("qwen15_moe_a27b", tmp_path, overrides=SHAPES, programs=("train_step",), layer_costs=False)
    kw = dict(programs=("train_step", "sampler"), layer_costs=False)
    exact = narrow_plan("qwen15_moe_a27b", tmp_path, overrides=SHAPES + EXACT, **kw)
    assert set(plain["programs"]) == {"train_step"}
    assert set(exact["programs"]) == {"train_step", "exact_prefill", "exact_decode"}
    assert exact["mesh"]["fsdp"] == 8 and exact["mesh"]["tensor"] == exact["mesh"]["expert"] == 1
    for p in exact["programs"].values():
        assert p["fits"] and p["memory"]["arguments"] > 0 and p["has_loops"] and p["jaxpr_flops"] > 0, p
    step, base = exact["programs"]["train_step"]["jaxpr_flops"], plain["programs"]["train_step"]["jaxpr_flops"]
    # the plain step: forward + backward (3 units); the exact one adds a forward (1 unit) and the expert tiles'
    # padding rows: between 1.2 and 1.5 x
    assert 1.2 * base < step < 1.5 * base, (step, base)
