"""cisjax.engines.jax.colocated: the JAX sampler on the trainer's mesh (8 fake CPU devices) behind a loopback server in the
test's process; the trainer's params swapped in memory, checked, copied (the trainer donates its own buffers)."""

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cisjax import sharding
from cisjax.engines.jax.backend import Backend
from cisjax.engines.jax.colocated import Colocated
from cisjax.models import hf_io
from cisjax.rollout.client import RolloutError
from cisjax.rollout.params import SamplingParams
from tests.support.engines import engine_params

PROMPTS = [[1, 2, 3, 4], [50, 7], [96, 0, 33, 12, 5, 8]]
GREEDY = SamplingParams(n=2, greedy=True, max_new_tokens=6, return_routing=True)


@pytest.fixture(scope="module")
def trainer(tiny_hf_dir):
    """(model dir, mesh, the trainer's params on it: fp32, sharded as `cisjax train` loads them)."""
    model_dir = tiny_hf_dir("qwen2_moe")
    mesh = sharding.make_mesh({"data": 2, "fsdp": -1})
    model, _, _ = hf_io.load(model_dir, mesh=mesh, rules=sharding.DEFAULT_TABLE, dtype="float32", param_dtype="float32")
    return model_dir, mesh, nnx.split(model, nnx.Param)[1]


@pytest.fixture(scope="module")
def colocated(trainer):
    model_dir, mesh, _ = trainer
    engine = Colocated(model_dir, dtype="float32", mesh=mesh, rules=sharding.DEFAULT_TABLE)
    try:
        yield engine
    finally:
        assert engine.stop() == 0


def _scaled(params, factor: float):
    """New arrays: the params with every matrix (not the norms) scaled; another policy, same structure."""
    return jax.tree.map(lambda x: x * factor if x.ndim >= 2 else jnp.copy(x), params)


def test_greedy_on_the_mesh_equals_one_device(colocated, trainer):
    one = Backend(trainer[0], dtype="float32")
    try:
        got = colocated.client.generate(PROMPTS, GREEDY)
        for i, prompt in enumerate(PROMPTS):
            want = one.generate(prompt, i, engine_params(n=2, greedy=True, max_new_tokens=6, return_routing=True))
            for s, w in zip(got[i], want):
                assert s.response_ids == w.token_ids
                np.testing.assert_allclose(s.logprobs, w.logprobs, atol=1e-5, rtol=0)
                np.testing.assert_array_equal(s.routing, w.routing)
    finally:
        one.close()
    # the engine's weights are sharded over the trainer's 8 devices, as the trainer's are
    leaf = jax.tree.leaves(colocated.backend.sampler.params)[0]
    assert len(leaf.sharding.device_set) == 8


def test_publish_swaps_the_trainers_params_in_memory(colocated, trainer, tmp_path):
    model_dir, mesh, params = trainer
    new = _scaled(params, 1.5)
    seqs = [(p, [5, 9, 11]) for p in PROMPTS]
    before = colocated.client.score(seqs)
    assert colocated.publish(new, 3) == 3
    assert colocated.client.expected_version == 3 and colocated.client.info()["version"] == 3
    after = colocated.client.score(seqs)
    assert {s["version"] for s in after} == {3}
    # what a separate engine loading those weights from disk computes
    graphdef = nnx.split(hf_io.load(model_dir, dtype="float32", param_dtype="float32")[0], nnx.Param)[0]
    out = hf_io.save((graphdef, new), tmp_path / "v3", hf_io.read_hf_config(model_dir), dtype="float32")
    ref = Backend(str(out), dtype="float32")
    try:
        for s, b, (p, r) in zip(after, before, seqs):
            np.testing.assert_allclose(s["logprobs"], ref.score(p, r, 1.0, 0)["logprobs"], atol=1e-5, rtol=0)
            assert np.max(np.abs(np.subtract(s["logprobs"], b["logprobs"]))) > 1e-2  # another policy
    finally:
        ref.close()
    # a copy: the trainer's buffers may be donated (deleted) after the publish; the engine keeps serving
    donated = _scaled(params, 1.25)
    colocated.publish(donated, 4)
    expect = colocated.client.score(seqs)
    for x in jax.tree.leaves(donated):
        x.delete()
    again = colocated.client.score(seqs)
    assert [s["logprobs"] for s in again] == [s["logprobs"] for s in expect]


def test_bad_params_are_refused_and_nothing_is_swapped(colocated, trainer):
    _, _, params = trainer
    colocated.publish(params, 5)
    seqs = [(PROMPTS[0], [5, 9])]
    served = colocated.client.score(seqs)[0]["logprobs"]
    flat = nnx.to_flat_state(params)
    first = flat[0][0]
    missing = nnx.from_flat_state([(k, v) for k, v in flat if k != first])
    with pytest.raises(ValueError, match="not the served model's parameters"):
        colocated.publish(missing, 6)
    wrong = jax.tree.map(lambda x: jnp.zeros((x.shape[0] + 1, *x.shape[1:]), x.dtype) if x.ndim == 2 else x, params)
    with pytest.raises(ValueError, match="shape"):
        colocated.publish(wrong, 6)
    assert colocated.client.info()["version"] == 5
    assert colocated.client.score(seqs)[0]["logprobs"] == served
    # the loopback server asks for its token: another client of the port is refused
    from cisjax.rollout.client import RolloutClient

    with RolloutClient(colocated.target, retry_s=1) as stranger, pytest.raises(RolloutError, match="UNAUTHENTICATED"):
        stranger.generate([PROMPTS[0]], SamplingParams(n=1, max_new_tokens=2))
