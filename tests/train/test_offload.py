"""train.offload_optimizer: the moments in host memory, updated a layer at a time, equal to the device step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from cisjax import config as config_lib
from cisjax import errors, sharding
from cisjax.train import checkpoint, offload, optim, validate
from tests.support import steps as U

MESH = "data2_fsdp2_tensor2"  # data, fsdp and tensor axes at once: the layers' slices are sharded


def _moments(state):
    """AdamW's two moment trees of a clipped optimizer's state (clip, (scale_by_adam, ...))."""
    adam = state.opt_state[1][0]
    return jax.tree.leaves(adam.mu) + jax.tree.leaves(adam.nu)


@pytest.fixture(scope="module")
def runs():
    """Two steps on one batch on the fast mesh, the optimizer on the device and offloaded."""
    mesh = U.mesh_for(MESH)
    return U.reference(MESH), U.run_steps(U.make_cfg(offload_optimizer=True), mesh, steps=2)


def test_offloaded_step_equals_the_device_step(runs):
    ref, off = runs
    lr = U.make_cfg().train.lr
    for r, o in zip(ref["metrics"], off["metrics"]):
        for key in ("loss", "grad_norm", "lr", "skipped"):  # two compiles of one computation: fp32 rounding apart
            np.testing.assert_allclose(o[key], r[key], rtol=1e-6, err_msg=key)
    # the same elementwise arithmetic, a layer at a time: the params and moments agree to fp32 rounding
    for r, o in zip(jax.tree.leaves(ref["state"].params), jax.tree.leaves(off["state"].params)):
        U.assert_same_update(np.asarray(o), np.asarray(r), lr, steps=2)
    for r, o in zip(_moments(ref["state"]), _moments(off["state"])):
        np.testing.assert_allclose(np.asarray(o), np.asarray(r), rtol=1e-3, atol=1e-5 * np.abs(np.asarray(r)).max())
    # the moments live in host memory, sharded like their params, but the stacked vectors' and degenerate matrices'
    # ([layers, D], [layers, D, 1]: offload.offloaded); the counts and params on the device
    adam = off["state"].opt_state[1][0]
    params = off["state"].params
    tags = offload._tags(params)
    for moments in (adam.mu, adam.nu):
        for m, p, t in zip(jax.tree.leaves(moments), jax.tree.leaves(params), jax.tree.leaves(tags)):
            want = offload.HOST if (t == offload._REST or (p.ndim >= 3 and min(p.shape[1:]) > 1)) else offload.DEVICE
            assert m.sharding.memory_kind == want
            assert m.sharding.is_equivalent_to(p.sharding.with_memory_kind(want), m.ndim)
    kinds = [m.sharding.memory_kind for m in _moments(off["state"])]
    assert kinds.count(offload.HOST) > kinds.count(offload.DEVICE) > 0  # the model has both kinds of leaf
    assert off["state"].opt_state[1][0].count.sharding.memory_kind == offload.DEVICE
    assert int(off["state"].opt_state[1][0].count) == 2
    assert all(p.sharding.memory_kind == offload.DEVICE for p in jax.tree.leaves(off["state"].params))
    assert off["step"].traces == 1


def test_offloaded_step_skips_a_non_finite_update(runs):
    _, off = runs
    mesh = U.mesh_for(MESH)
    cfg = U.make_cfg(offload_optimizer=True)
    _, _, rules, state = U.build(cfg, mesh)
    batch = off["batch"]
    adv = np.array(batch.advantages_MxBxT)
    r, t = np.argwhere(np.asarray(batch.loss_mask_MxBxT)[0])[0]
    adv[0, r, t] = np.nan
    before = [np.asarray(x) for x in jax.tree.leaves((state.params, state.opt_state))]
    state, met = off["step"](
        state, sharding.place(batch._replace(advantages_MxBxT=adv), mesh, rules, sharding.BATCH_AXES)
    )
    assert float(met["skipped"]) == 1.0 and int(state.skipped_steps) == 1
    for a, b in zip(before, jax.tree.leaves((state.params, state.opt_state))):
        np.testing.assert_array_equal(a, np.asarray(b))  # bitwise unchanged, the host moments too


@pytest.mark.slow  # one more compile of the sharded step
def test_offloaded_bf16_moments_stay_near_fp32():
    """bf16 moments offloaded: the first update is fp32 Adam's, the second within test_optim's bound of fp32 state;
    each layer rounds with its own random bits (rounding_salt), so two layers of equal moments do not round alike."""
    mesh = U.mesh_for(MESH)
    ref = U.reference(MESH)
    low = U.run_steps(U.make_cfg(optimizer_state_dtype="bfloat16", offload_optimizer=True), mesh, steps=2)
    for m in _moments(low["state"]):
        assert m.dtype == jnp.bfloat16
    assert offload.HOST in {m.sharding.memory_kind for m in _moments(low["state"])}
    np.testing.assert_allclose(low["sums"][0], ref["sums"][0], rtol=1e-5, atol=1e-5)
    lr = U.make_cfg().train.lr
    for o, r in zip(jax.tree.leaves(low["state"].params), jax.tree.leaves(ref["state"].params)):
        np.testing.assert_allclose(np.asarray(o), np.asarray(r), atol=0.15 * lr, rtol=0)


def test_rounding_salt_changes_the_random_bits_only():
    """scale_by_adam_bf16 with a salt: the update is the same (fp32 from the stored moments), the stored moments are
    rounded with other random bits (both within one bf16 step of the fp32 moment)."""
    tx = optim.scale_by_adam_bf16(0.9, 0.999, 1e-8)
    g = {"w": jnp.linspace(-1.0, 1.0, 4096, dtype=jnp.float32) * 1e-3 + 1e-7}
    state = tx.init(g)
    u0, s0 = tx.update(g, state)
    u1, s1 = tx.update(g, state, rounding_salt=7)
    np.testing.assert_array_equal(np.asarray(u0["w"]), np.asarray(u1["w"]))
    mu0, mu1 = np.asarray(s0.mu["w"], np.float32), np.asarray(s1.mu["w"], np.float32)
    assert np.mean(mu0 != mu1) > 0.1  # other bits: other roundings
    exact = 0.1 * np.asarray(g["w"])
    gap = np.abs(exact) * 2.0**-7
    assert np.all(np.abs(mu0 - exact) <= gap) and np.all(np.abs(mu1 - exact) <= gap)


def test_offload_is_refused_where_the_devices_have_no_host_memory(monkeypatch):
    mesh = U.mesh_for("single")
    assert offload.HOST in offload.host_memory_kinds(mesh)  # XLA:CPU has it (the same memory): the program runs
    monkeypatch.setattr(offload, "host_memory_kinds", lambda mesh: ["device"])
    with pytest.raises(errors.UserError, match=r"train.offload_optimizer.*no 'pinned_host' memory.*\['device'\]"):
        U.build(U.make_cfg(offload_optimizer=True), mesh)


def test_offload_flag_is_validated():
    raw = config_lib.load(None).to_dict()  # a config file may hold anything; the flags parse "yes" as True
    raw["train"]["offload_optimizer"] = "yes"
    cfg = ml_collections.ConfigDict(raw)
    assert any("train.offload_optimizer='yes': True or False" in p for p in validate.problems(cfg, inputs=False))


def test_moment_bytes_count_each_devices_shard():
    """moment_bytes: the moments' bytes one device holds, by hand: two fp32 moments per parameter, the params' sharded
    dimensions divided by the mesh; with the params, those in host memory (what the plan counts there)."""
    mesh = U.mesh_for("fsdp8")
    _, tx, _, state = U.build(U.make_cfg(offload_optimizer=True), mesh)
    by_hand = 0
    for p in jax.tree.leaves(state.params):
        by_hand += 2 * 4 * int(np.prod(p.sharding.shard_shape(p.shape)))
    assert offload.moment_bytes(tx, state.opt_state) == by_hand
    assert by_hand < 2 * 4 * sum(p.size for p in jax.tree.leaves(state.params))  # sharded, not whole
    # the offloaded ones: all but the stacked vectors
    tags = jax.tree.leaves(offload._tags(state.params))
    host = sum(
        2 * 4 * int(np.prod(p.sharding.shard_shape(p.shape)))
        for p, t in zip(jax.tree.leaves(state.params), tags)
        if t == offload._REST or (p.ndim >= 3 and min(p.shape[1:]) > 1)
    )
    assert offload.moment_bytes(tx, state.opt_state, state.params) == host and 0.9 * by_hand < host < by_hand


def test_offloaded_state_checkpoints_and_restores_into_host_memory(tmp_path, runs):
    _, off = runs
    state = off["state"]
    ckpt = checkpoint.Checkpointer(tmp_path / "ckpt")
    assert ckpt.save(state, step=2)
    ckpt.wait()
    ckpt.close()
    ckpt = checkpoint.Checkpointer(tmp_path / "ckpt", read_only=True)
    restored = ckpt.restore(abstract_state=checkpoint.abstract_state(state))
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert b.sharding.memory_kind == a.sharding.memory_kind
    assert offload.HOST in {m.sharding.memory_kind for m in _moments(restored)}
