"""The train step: sharded == one device, micro-batching, learning, non-finite skip, fp16, one trace; the optimizer."""

from __future__ import annotations

import dataclasses

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding

from cisjax import forward, sharding
from cisjax.records import TrainBatch
from cisjax.train import optim
from cisjax.train import state as state_lib
from cisjax.train import step as step_lib
from tests.support import steps as U
from tests.support.runs import spec_of

METRIC_KEYS = (
    "loss",
    "grad_norm",
    "clip_frac",
    "entropy",
    "tokens",
    "lr",
    "skipped",
    "acted_frac",
    "weight_mean",
    "abs_logk_max",
    "chi2",
    "pg_loss",
    "ratio_max",
    "seqs",
)


def _host(tree) -> list[np.ndarray]:
    return [np.array(x) for x in jax.tree.leaves(tree)]


def _fresh(name: str = "single"):
    """A new state with the reference run's initial values, and the reference run's (already compiled) step."""
    ref = U.reference(name)
    _, _, _, state = U.build(U.make_cfg(), U.mesh_for(name))
    return ref, state


# ----------------------------------------------------------------------------- sharded == single device


# One mesh in the fast tier (make test-fast): data, fsdp and tensor axes at once; the others (a compile of the
# sharded step each) are `slow`.
FAST_MESH = "data2_fsdp2_tensor2"


@pytest.mark.parametrize("name", [n if n == FAST_MESH else pytest.param(n, marks=pytest.mark.slow) for n in U.MESHES])
def test_sharded_step_matches_single_device(name):
    ref, out = U.reference("single"), U.reference(name)
    mesh = U.mesh_for(name)
    # proximal rescoring (make_rescore) agrees
    np.testing.assert_allclose(out["prox"], ref["prox"], atol=2e-5, rtol=0)
    for r, o in zip(ref["metrics"], out["metrics"]):
        assert set(METRIC_KEYS) <= set(r)
        for key in r:
            np.testing.assert_allclose(o[key], r[key], rtol=2e-4, atol=1e-6, err_msg=key)
    assert ref["metrics"][0]["acted_frac"] > 0.05  # CIS caps tokens: the comparison covers the weights
    assert ref["metrics"][1]["clip_frac"] > 0.05  # and the PPO clip (step 2 has ratios != 1)
    # the gradients, through Adam's first moment (their running mean): equal to within 1e-4 of each tensor's largest
    mu_ref, mu_out = _host(ref["state"].opt_state[1][0].mu), _host(out["state"].opt_state[1][0].mu)
    for r, o in zip(mu_ref, mu_out):
        np.testing.assert_allclose(o, r, rtol=1e-3, atol=1e-4 * np.abs(r).max())
    # new params: Adam divides by sqrt(v), which magnifies the relative noise of near-zero gradient entries; the
    # few such entries move by at most 2% of one update (lr 1e-2)
    for r, o in zip(_host(ref["state"].params), _host(out["state"].params)):
        np.testing.assert_allclose(o, r, atol=2e-4, rtol=0)
        assert np.mean(np.abs(o - r) > 1e-5) < 0.01
    np.testing.assert_allclose(out["sums"], ref["sums"], rtol=1e-4, atol=1e-4)
    # the updated state stays sharded as the table says (out_shardings), on this mesh
    for before, after in zip(
        jax.tree.leaves(state_lib.shardings(U.build(U.make_cfg(), mesh)[3])), jax.tree.leaves(out["state"])
    ):
        assert isinstance(after.sharding, NamedSharding) and after.sharding.mesh == mesh
        assert after.sharding.is_equivalent_to(before, after.ndim)
    split = [x for x in jax.tree.leaves(out["state"].params) if x.addressable_shards[0].data.size < x.size]
    assert len(split) >= 6
    assert ref["step"].traces == 1 and out["step"].traces == 1


@pytest.mark.slow  # one more compile of the sharded step
def test_bf16_optimizer_state_on_a_sharded_mesh():
    """train.optimizer_state_dtype=bfloat16 on the fast mesh: the moments are bf16 and sharded like their params (the
    fp32 state's shardings), the first update is fp32 Adam's (computed from fp32 moments), and after the second the
    params stay within 0.15 lr of the fp32 state's (tests/train/test_optim.py's bound)."""
    mesh = U.mesh_for(FAST_MESH)
    ref = U.reference(FAST_MESH)
    low = U.run_steps(U.make_cfg(optimizer_state_dtype="bfloat16"), mesh, steps=2)
    adam, adam_ref = low["state"].opt_state[1][0], ref["state"].opt_state[1][0]
    for moments, moments_ref in ((adam.mu, adam_ref.mu), (adam.nu, adam_ref.nu)):
        for m, r in zip(jax.tree.leaves(moments), jax.tree.leaves(moments_ref)):
            assert m.dtype == jnp.bfloat16 and r.dtype == jnp.float32
            assert m.sharding.is_equivalent_to(r.sharding, m.ndim)
    np.testing.assert_allclose(low["metrics"][0]["loss"], ref["metrics"][0]["loss"], rtol=1e-6)
    lr = U.make_cfg().train.lr
    np.testing.assert_allclose(low["sums"][0], ref["sums"][0], rtol=1e-5, atol=1e-5)  # one fp32 Adam update
    for o, r in zip(_host(low["state"].params), _host(ref["state"].params)):
        np.testing.assert_allclose(o, r, atol=0.15 * lr, rtol=0)


# ----------------------------------------------------------------------------- micro-batching


def _micro_batch_loss(cfg):
    """(params, the step's micro-batch loss, a batch with noisy logprobs, its loss denominator) on one device."""
    mesh = U.mesh_for("single")
    graphdef, _, rules, state = U.build(cfg, mesh)
    loss_fn = step_lib.make_loss_fn(graphdef, spec_of(cfg).step, mesh, rules)
    batch = U.with_logprobs(U.host_batch(), np.zeros((U.M, U.B, U.T), np.float32), noise=0.5)
    return state.params, loss_fn, batch, jnp.sum(jnp.asarray(batch.loss_mask_MxBxT, jnp.float32))


def test_in_place_accumulation_equals_summing_each_micro_batchs_gradient():
    """accumulate_grads (the stacks' gradients added in place through the layers' scan) against jax.grad of each
    micro-batch added to the sum, on two micro-batches from a non-zero sum: equal to fp32 rounding, stacked and other
    parameters alike; and the stacked weights' own gradient is not what is added (a sum of zeros would fail)."""
    params, loss_fn, batch, denominator = _micro_batch_loss(U.make_cfg())
    start = jax.tree.map(lambda p: jnp.full(p.shape, 0.25, jnp.float32), params)

    @jax.jit
    def both(params, start, batch):
        ref, got = start, start
        for m in range(U.M):
            mb = jax.tree.map(lambda x, m=m: None if x is None else x[m], batch)
            g, _ = jax.grad(loss_fn, has_aux=True)(params, mb, denominator)
            ref = jax.tree.map(lambda a, gi: a + gi.astype(jnp.float32), ref, g)
            got, aux = step_lib.accumulate_grads(loss_fn, params, got, mb, denominator)
        return ref, got

    ref, got = both(params, start, batch)
    leaves = list(zip(jax.tree.leaves(ref), jax.tree.leaves(got)))
    assert len(leaves) == len(jax.tree.leaves(params)) and jax.tree.structure(ref) == jax.tree.structure(got)
    for r, o in leaves:
        np.testing.assert_allclose(np.asarray(o), np.asarray(r), rtol=1e-6, atol=1e-7)
    moved = [np.abs(np.asarray(r) - 0.25).max() for r, _ in leaves]
    assert min(moved) > 0  # every leaf's gradient is non-zero somewhere: the comparison covers them all


def test_a_bf16_gradient_sum_is_within_its_rounding_of_the_fp32_sum():
    """train.grad_sum_dtype=bfloat16: accumulate_grads from a zero bf16 sum over two micro-batches, against the fp32
    sum of each micro-batch's jax.grad. Each of the two stochastic roundings moves a value by less than bf16's gap
    there (at most 2^-7 of it), so |bf16 - fp32| < 2^-7 (|sum after 1| + |sum after 2|); every leaf is bf16 and
    non-zero (a sum left at zero, or one in fp32, would fail)."""
    params, loss_fn, batch, denominator = _micro_batch_loss(U.make_cfg(grad_sum_dtype="bfloat16"))

    @jax.jit
    def both(params, batch):
        ref = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        got = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.bfloat16), params)
        refs = []
        for m in range(U.M):
            mb = jax.tree.map(lambda x, m=m: None if x is None else x[m], batch)
            g, _ = jax.grad(loss_fn, has_aux=True)(params, mb, denominator)
            ref = jax.tree.map(lambda a, gi: a + gi.astype(jnp.float32), ref, g)
            refs.append(ref)
            key = jax.random.key_data(jax.random.fold_in(jax.random.key(7), m))
            got, _ = step_lib.accumulate_grads(loss_fn, params, got, mb, denominator, key)
        return refs, got

    (ref1, ref2), got = both(params, batch)
    leaves = list(zip(jax.tree.leaves(ref1), jax.tree.leaves(ref2), jax.tree.leaves(got)))
    assert len(leaves) == len(jax.tree.leaves(params))
    for r1, r2, o in leaves:
        assert o.dtype == jnp.bfloat16
        r1, r2, o = (np.asarray(x, np.float64) for x in (r1, r2, o))
        assert np.all(np.abs(o - r2) <= 2.0**-7 * (np.abs(r1) + np.abs(r2))), np.abs(o - r2).max()
        assert np.abs(o).max() > 0


@pytest.mark.slow  # one more compile of the sharded step
def test_bf16_gradient_sum_on_a_sharded_mesh():
    """train.grad_sum_dtype=bfloat16 on the fast mesh, two micro-batches: the same loss as the fp32 sum's step (the
    forward does not see the sum), the gradient norm within 1% (bf16's rounding of each entry, 2^-8 relative, averages
    out in the norm), and after two steps the params within 0.15 lr of the fp32 sum's on average (Adam's update is
    lr * g / |g|-like: an entry whose rounded sum changed sign moves by up to 2 lr, a few entries near zero)."""
    mesh = U.mesh_for(FAST_MESH)
    ref = U.reference(FAST_MESH)
    low = U.run_steps(U.make_cfg(grad_sum_dtype="bfloat16"), mesh, steps=2)
    np.testing.assert_allclose(low["metrics"][0]["loss"], ref["metrics"][0]["loss"], rtol=1e-6)
    for got, want in zip(low["metrics"], ref["metrics"]):
        np.testing.assert_allclose(got["grad_norm"], want["grad_norm"], rtol=1e-2)
    lr = U.make_cfg().train.lr
    diffs = [np.abs(o - r) for o, r in zip(_host(low["state"].params), _host(ref["state"].params))]
    assert np.mean(np.concatenate([d.ravel() for d in diffs])) < 0.15 * lr
    assert max(d.max() for d in diffs) > 0  # the rounding did change something: the sum was bf16


@pytest.mark.slow  # a second compile of the step (M=1); the fast tier has tests/rl/test_loss.py's micro-batch split
def test_micro_batches_equal_one_big_batch():
    """M=2 x B=8 and M=1 x B=16 on the same 16 rows: same loss (global token mean), metrics and update."""
    ref = U.reference("single")
    two = ref["batch"]  # the rows the reference's step 1 saw, with its prox/infer logprobs
    mask = np.asarray(two.loss_mask_MxBxT)
    assert mask[0].sum() != mask[1].sum()  # micro-batches of different token counts: a mean of means would differ
    one = TrainBatch(*(None if x is None else np.asarray(x).reshape(1, 2 * U.B, U.T) for x in two))
    cfg, mesh = U.make_cfg(), U.mesh_for("single")
    graphdef, tx, rules, state = U.build(cfg, mesh)
    step = step_lib.make_train_step(graphdef, tx, spec_of(cfg).step, mesh, rules, state_lib.shardings(state))
    state, met = step(state, sharding.place(one, mesh, rules, sharding.BATCH_AXES))
    first = ref["metrics"][0]
    for key in first:
        np.testing.assert_allclose(float(met[key]), first[key], rtol=1e-5, atol=1e-7, err_msg=key)
    # fp32 round-off only: the two programs add the gradients in different orders (a mean of micro-batch means
    # instead of the global token mean would be off by percent); 1e-5 as the metrics, at -O0 too (tests/conftest.py).
    # Compared value by value with the reference's first step (its compiled M=2 step on a fresh state): sums over a
    # whole tensor cancel, and their round-off depends on the CPU's kernels.
    _, fresh = _fresh()
    two_state, _ = ref["step"](fresh, sharding.place(two, mesh, rules, sharding.BATCH_AXES))
    np.testing.assert_array_equal(U.replicated_sums(two_state.params), ref["sums"][0])  # the reference's own step
    U.assert_same_update(U.flat_params(state.params), U.flat_params(two_state.params), lr=cfg.train.lr)


# ----------------------------------------------------------------------------- learning


def test_fixed_batch_surrogate_decreases_and_logprobs_move_with_the_advantage():
    """20 steps on one batch with fixed proximal logprobs (PPO epochs): the surrogate falls to the floor that the PPO
    clip allows, responses with A > 0 gain probability and those with A < 0 lose it."""
    ref, state = _fresh()
    step, batch = ref["step"], ref["batch"]
    placed = sharding.place(batch, U.mesh_for("single"), ref["rules"], sharding.BATCH_AXES)
    losses = []
    for _ in range(20):
        state, met = step(state, placed)
        losses.append(float(met["loss"]))
        assert float(met["skipped"]) == 0.0
    losses = np.array(losses)
    mask, adv = np.asarray(batch.loss_mask_MxBxT), np.asarray(batch.advantages_MxBxT)
    prox, infer = np.asarray(batch.prox_logprobs_MxBxT, np.float64), np.asarray(batch.infer_logprobs_MxBxT, np.float64)
    # CIS weights (fixed: prox and infer do not change) and the lowest value the clipped surrogate can take:
    # ratio >= 1 + clip_high on A > 0 tokens, ratio <= 1 - clip_low on A < 0 tokens
    w = np.minimum(np.exp(prox - infer), 1 + 2.3 * np.maximum(1 - np.exp(prox), 5e-3))
    start = np.sum(np.where(mask, -w * adv, 0)) / mask.sum()
    floor = np.sum(np.where(mask, w * np.where(adv > 0, -adv * 1.28, -adv * 0.8), 0)) / mask.sum()
    np.testing.assert_allclose(losses[0], start, rtol=1e-4)  # ratio 1 at the start
    assert floor < start - 0.2
    assert np.all(losses[1:] < losses[0] - 0.2), losses
    assert np.all(losses >= floor - 1e-4), (losses, floor)
    assert losses[10:].min() < floor + 0.05 * (start - floor), (losses, floor)  # reaches the floor
    logp = np.asarray(
        step_lib.make_rescore(ref["graphdef"], spec_of(U.make_cfg()).step, U.mesh_for("single"), ref["rules"])(
            state.params, placed
        )
    )
    delta = logp - prox
    up, down = delta[mask & (adv > 0)], delta[mask & (adv < 0)]
    assert up.mean() > 0.2 and down.mean() < -0.2, (up.mean(), down.mean())
    assert (up > 0).mean() > 0.8 and (down < 0).mean() > 0.8
    assert int(state.step) == 20 and int(state.skipped_steps) == 0


# ----------------------------------------------------------------------------- non-finite gradients


def test_non_finite_gradient_skips_the_update_then_training_proceeds():
    ref, state = _fresh()
    step, batch, rules = ref["step"], ref["batch"], ref["rules"]
    mesh = U.mesh_for("single")
    adv = np.array(batch.advantages_MxBxT)
    r, t = np.argwhere(np.asarray(batch.loss_mask_MxBxT)[1])[0]
    adv[1, r, t] = np.nan  # one poisoned token in the second micro-batch: NaN loss and gradient
    before_params, before_opt = _host(state.params), _host(state.opt_state)
    state, met = step(state, sharding.place(batch._replace(advantages_MxBxT=adv), mesh, rules, sharding.BATCH_AXES))
    assert float(met["skipped"]) == 1.0 and not np.isfinite(float(met["loss"]))
    assert int(state.step) == 1 and int(state.skipped_steps) == 1
    for a, b in zip(before_params + before_opt, _host(state.params) + _host(state.opt_state)):
        np.testing.assert_array_equal(a, b)  # bitwise unchanged
    # the next good step is exactly the reference's first step (same lr: the schedule counts applied updates)
    state, met = step(state, sharding.place(batch, mesh, rules, sharding.BATCH_AXES))
    assert float(met["skipped"]) == 0.0 and int(state.step) == 2 and int(state.skipped_steps) == 1
    for key in ("loss", "grad_norm", "lr"):
        assert float(met[key]) == ref["metrics"][0][key], key
    np.testing.assert_array_equal(U.replicated_sums(state.params), ref["sums"][0])


@pytest.mark.slow  # three more compiles: the fp16 rescoring and step, and an fp32 gradient
def test_fp16_method_forces_fp16_with_loss_scaling():
    cfg = U.make_cfg()
    cfg.correction.method = "fp16"
    assert spec_of(cfg).runtime.precision == "fp16" and spec_of(cfg).runtime.model_kwargs()["dtype"] == "float16"
    mesh = U.mesh_for("single")
    graphdef, tx, rules, state = U.build(cfg, mesh)
    batch = U.host_batch()
    logprobs_fn = step_lib.make_rescore(graphdef, spec_of(cfg).step, mesh, rules)
    prox = np.asarray(logprobs_fn(state.params, sharding.place(batch, mesh, rules, sharding.BATCH_AXES)))
    batch = U.with_logprobs(batch, prox)
    step = step_lib.make_train_step(graphdef, tx, spec_of(cfg).step, mesh, rules, state_lib.shardings(state))
    before = _host(state.params)
    state, met = step(state, sharding.place(batch, mesh, rules, sharding.BATCH_AXES))
    met = {k: float(v) for k, v in met.items()}
    assert met["skipped"] == 0.0 and all(np.isfinite(v) for v in met.values()), met
    mask, adv = np.asarray(batch.loss_mask_MxBxT), np.asarray(batch.advantages_MxBxT)
    # weight 1 and ratio 1 (prox is this model's own fp16 logprob): loss = -sum(A) / tokens, unscaled
    np.testing.assert_allclose(met["loss"], -adv[mask].sum() / mask.sum(), rtol=1e-3)
    assert met["weight_mean"] == 1.0 and met["acted_frac"] == 0.0
    # the gradient is unscaled: compare with the fp32 gradient of the same objective
    np.testing.assert_allclose(met["grad_norm"], _fp32_grad_norm(batch), rtol=0.05)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))  # fp32 master weights
    assert any(not np.array_equal(a, b) for a, b in zip(before, _host(state.params)))


def _fp32_grad_norm(batch: TrainBatch) -> float:
    """|d/dtheta -sum(A * exp(logp - sg(logp))) / tokens| with the fp32 model (the step's forward)."""
    cfg, mesh = U.make_cfg(), U.mesh_for("single")
    graphdef, _, rules, state = U.build(cfg, mesh)
    fwd = forward.make_forward(
        graphdef,
        mesh,
        rules,
        precision=spec_of(cfg).runtime.precision,
        temperature=cfg.logprobs.temperature,
        chunk_size=cfg.logprobs.chunk_size,
    )
    mask = jnp.asarray(batch.loss_mask_MxBxT)

    @jax.jit
    def norm(params):
        def objective(params):
            total = 0.0
            for i in range(U.M):
                lp = fwd(
                    params,
                    batch.tokens_MxBxT[i],
                    batch.positions_MxBxT[i],
                    batch.segment_ids_MxBxT[i],
                    batch.targets_MxBxT[i],
                ).stats.logprobs_N
                total += jnp.sum(
                    jnp.where(mask[i], -batch.advantages_MxBxT[i] * jnp.exp(lp - jax.lax.stop_gradient(lp)), 0.0)
                )
            return total / jnp.sum(mask)

        return jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(jax.grad(objective)(params))))

    return float(norm(state.params))


# ----------------------------------------------------------------------------- jit once, donation


def test_step_traces_once_and_donates_the_state():
    ref, state = _fresh()
    step, mesh, rules = ref["step"], U.mesh_for("single"), ref["rules"]
    other = U.with_logprobs(U.host_batch(seed=5), ref["prox"], seed=7)  # same shapes, other values
    traced = step.traces  # the step is shared: another module's tests may have traced it (or jax.clear_caches since)
    for batch in (ref["batch"], other, ref["batch"]):
        old = state
        state, _ = step(state, sharding.place(batch, mesh, rules, sharding.BATCH_AXES))
        assert all(x.is_deleted() for x in jax.tree.leaves(old.params))  # donated: buffers reused in place
    assert step.traces - traced <= 1  # the three calls: one trace at most
    assert step.jitted._cache_size() == 1


def test_precision_mismatch_and_kl_are_refused():
    cfg = U.make_cfg()
    graphdef, tx, rules, state = U.build(cfg, U.mesh_for("single"))
    bf16 = U.make_cfg(precision="bf16")
    assert (
        spec_of(bf16).runtime.model_kwargs()["dtype"] == "bfloat16"
        and spec_of(bf16).runtime.model_kwargs()["param_dtype"] == "float32"
    )
    fp16 = U.make_cfg(precision="fp16")
    fn = step_lib.make_rescore(graphdef, spec_of(fp16).step, U.mesh_for("single"), rules)  # the fp32-built model
    with pytest.raises(ValueError, match="train.precision=fp16 but the model computes in float32"):
        fn(state.params, sharding.place(U.host_batch(), U.mesh_for("single"), rules, sharding.BATCH_AXES))
    kl = U.make_cfg()
    kl.loss.kl_coef = 0.1
    with pytest.raises(ValueError, match="kl_coef"):
        step_lib.make_train_step(
            graphdef, tx, spec_of(kl).step, U.mesh_for("single"), rules, state_lib.shardings(state)
        )
    with pytest.raises(ValueError, match="train.precision"):
        spec_of(U.make_cfg(precision="int8"))
    # without a mesh, create() leaves counters and the optimizer state off the mesh; with it (or place) they are on it
    _, unplaced = state_lib.create(nnx.merge(graphdef, state.params), tx)
    with pytest.raises(ValueError, match="is not on the mesh"):
        state_lib.check_placed(unplaced, U.mesh_for("single"))
    state_lib.check_placed(state_lib.place(unplaced, tx, U.mesh_for("single")), U.mesh_for("single"))
    _, placed = state_lib.create(nnx.merge(graphdef, state.params), tx, mesh=U.mesh_for("single"))
    state_lib.check_placed(placed, U.mesh_for("single"))


# ----------------------------------------------------------------------------- optimizer


def _lr(schedule, counts):
    return np.array([float(schedule(c)) for c in counts])


def test_schedules():
    spec = spec_of(U.make_cfg(lr=1.0, warmup_steps=4, total_steps=14, final_lr_ratio=0.1)).step.optim
    np.testing.assert_allclose(_lr(optim.make_schedule(spec), [0, 1, 3, 4, 100]), [0.25, 0.5, 1, 1, 1])
    spec = dataclasses.replace(spec, schedule="linear")
    np.testing.assert_allclose(
        _lr(optim.make_schedule(spec), [0, 3, 4, 9, 14, 50]), [0.25, 1, 1, 0.55, 0.1, 0.1], rtol=1e-6
    )
    spec = dataclasses.replace(spec, schedule="cosine")
    np.testing.assert_allclose(_lr(optim.make_schedule(spec), [4, 9, 14, 50]), [1, 0.55, 0.1, 0.1], rtol=1e-6)
    spec = dataclasses.replace(spec, total_steps=4)
    with pytest.raises(ValueError, match="total_steps"):
        optim.make_schedule(spec)
    with pytest.raises(ValueError, match="schedule"):
        optim.make_schedule(dataclasses.replace(spec, schedule="step"))


def test_optimizer_clips_then_adamw():
    """Two updates with gradients of norm 5 then 0.5: clipping to 1 changes Adam's second update (it is not scale
    invariant across steps); ours equals clip_by_global_norm followed by optax.adamw."""
    params = {"w": jnp.array([3.0, 4.0]), "b": jnp.array([1.0])}
    g1 = {"w": jnp.array([3.0, -4.0]), "b": jnp.array([0.0])}
    g2 = {"w": jnp.array([0.3, 0.0]), "b": jnp.array([-0.4])}
    cfg = U.make_cfg(lr=0.1, grad_clip=1.0, weight_decay=0.01, b1=0.9, b2=0.99, eps=1e-8)

    def two_updates(tx):
        state = tx.init(params)
        _, state = tx.update(g1, state, params)
        return tx.update(g2, state, params)[0]

    ours = two_updates(optim.make_optimizer(spec_of(cfg).step.optim))
    manual = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(0.1, b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.01))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), ours, two_updates(manual))
    cfg.train.grad_clip = 0.0
    unclipped = two_updates(optim.make_optimizer(spec_of(cfg).step.optim))
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
        unclipped,
        two_updates(optax.adamw(0.1, b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.01)),
    )
    assert not np.allclose(unclipped["w"], ours["w"])
    # decoupled weight decay: a zero gradient still shrinks the weights by lr * wd * w
    wd = optim.make_optimizer(spec_of(U.make_cfg(lr=0.1, weight_decay=0.5, grad_clip=0.0)).step.optim)
    zero = jax.tree.map(jnp.zeros_like, params)
    np.testing.assert_allclose(wd.update(zero, wd.init(params), params)[0]["w"], -0.1 * 0.5 * params["w"], rtol=1e-6)


def test_abstract_state_is_what_create_places():
    """state.abstract (ahead-of-time compilation, cisjax plan) describes the state create(..., mesh) builds: the same
    tree, shapes, dtypes and shardings, without allocating it."""
    from cisjax import sharding
    from cisjax.models import hf_io

    cfg = U.make_cfg()
    mesh = sharding.make_mesh(U.MESHES["fsdp2_tensor2_expert2"])
    graphdef, tx, rules, state = U.build(cfg, mesh)
    mcfg = hf_io.model_config(U.TINY_HF, **spec_of(cfg).runtime.model_kwargs())
    _, params = hf_io.abstract_model(U.TINY_HF, mcfg)
    shardings = sharding.param_shardings(params, mesh, rules)
    params = jax.tree.map(
        lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s)),
        params,
        shardings,
        is_leaf=lambda v: isinstance(v, nnx.Variable),
    )
    abstract = state_lib.abstract(params, tx, mesh)
    real, fake = jax.tree.leaves_with_path(state), jax.tree.leaves_with_path(abstract)
    assert [p for p, _ in real] == [p for p, _ in fake]
    for (path, x), (_, a) in zip(real, fake):
        assert (x.shape, x.dtype) == (a.shape, a.dtype), jax.tree_util.keystr(path)
        assert x.sharding.is_equivalent_to(a.sharding, x.ndim), jax.tree_util.keystr(path)
    assert {len(x.sharding.device_set) for x in jax.tree.leaves(abstract)} == {8}


def test_model_runtime_carries_every_runtime_field():
    """Every runtime option of the model (hf_config.RuntimeOptions) is set from config.model: none silently dropped."""
    import dataclasses

    from cisjax.models import hf_config, hf_io

    cfg = U.make_cfg()
    cfg.train.precision = "bf16"  # dtype = model.dtype as it is
    chosen = dict(
        dtype="float16", param_dtype="bfloat16", router_dtype="bfloat16", moe_impl="dense", moe_tile=16, remat="full"
    )
    chosen["scan_layers"] = False
    chosen["attention_impl"] = "splash"
    for name, value in chosen.items():
        cfg.model[name] = value
    assert {f.name for f in dataclasses.fields(hf_config.RuntimeOptions)} == set(chosen)
    mcfg = hf_io.model_config(U.TINY_HF, **spec_of(cfg).runtime.model_kwargs())
    for name, value in chosen.items():
        want = hf_config.dtype_of(value) if name.endswith("dtype") else value
        assert getattr(mcfg, name) == want, name


def _own_routing(graphdef, mesh, rules, params, batch) -> np.ndarray:
    """The routers' own expert ids of every position of the host batch, [M, B, T, X, k] uint8 (a rollout engine's
    routing that agrees with the trainer)."""
    fwd = jax.jit(forward.make_forward(graphdef, mesh, rules, precision="fp32", temperature=1.0, chunk_size=64))
    ids = [
        fwd(params, *(jnp.asarray(getattr(batch, f)[i]) for f in batch._fields[:4])).expert_ids_XxBxTxK
        for i in range(batch.tokens_MxBxT.shape[0])
    ]
    return np.stack([np.moveaxis(np.asarray(x), 0, 2) for x in ids]).astype(np.uint8)


def test_step_replaying_the_routers_own_choice_is_the_plain_step():
    """Routing replay in the step: the routers' own ids replayed give the step without replay (rescoring and metrics
    bitwise; the updated params to float rounding: XLA may sum the routing weights' gradient in another order, and
    Adam's first step, g / |g|, magnifies that on near-zero entries); other ids give another update."""
    cfg, mesh = U.make_cfg(), U.mesh_for("single")
    graphdef, _, rules, state = U.build(cfg, mesh)
    batch = U.host_batch()
    own = _own_routing(graphdef, mesh, rules, state.params, batch)
    plain = U.run_steps(cfg, mesh, steps=1, batch=batch)
    replayed = U.run_steps(cfg, mesh, steps=1, batch=batch._replace(routing_MxBxTxXxK=own))
    np.testing.assert_array_equal(replayed["prox"], plain["prox"])
    assert replayed["metrics"] == plain["metrics"]
    np.testing.assert_allclose(replayed["sums"], plain["sums"], rtol=1e-5, atol=1e-5)
    other = U.run_steps(cfg, mesh, steps=1, batch=batch._replace(routing_MxBxTxXxK=(own + 1) % 8))
    assert other["metrics"][0]["loss"] != plain["metrics"][0]["loss"]
    assert np.abs(other["sums"] - plain["sums"]).max() > 1e-2  # 2.1 here, against 1.3e-6 for the replayed own ids


def test_proximal_step_is_the_rescored_step():
    """train.proximal=step: p_prox from the step's own forward (stop-gradient), no rescoring pass. On the same state
    and batch (routing replayed, some of it not the routers' choice) the step gives the rescoring's p_prox and routing
    flips, and the same loss, correction metrics and update to float rounding; it never reads the batch's p_prox."""
    cfg, mesh = U.make_cfg(proximal="rescore"), U.mesh_for("single")
    graphdef, _, rules, state = U.build(cfg, mesh)
    batch = U.host_batch()
    own = _own_routing(graphdef, mesh, rules, state.params, batch)
    routing = own.copy()
    routing[:, ::3] = (own[:, ::3] + 1) % 8  # every third row: another expert set in every layer
    batch = batch._replace(routing_MxBxTxXxK=routing)
    rescored = U.run_steps(cfg, mesh, steps=1, batch=batch)  # the rescoring pass, then the step
    placed = sharding.place(rescored["batch"], mesh, rules, sharding.BATCH_AXES)
    want_flips = step_lib.make_rescore(graphdef, spec_of(cfg).step, mesh, rules, flips=True)(state.params, placed)[1]

    cfg_step = U.make_cfg(proximal="step")
    graphdef, tx, rules, state = U.build(cfg_step, mesh)
    train_step = step_lib.make_train_step(graphdef, tx, spec_of(cfg_step).step, mesh, rules, state_lib.shardings(state))
    blank = rescored["batch"]._replace(prox_logprobs_MxBxT=np.full((U.M, U.B, U.T), -50.0, np.float32))  # unread
    state, met, out = train_step.with_outputs(state, sharding.place(blank, mesh, rules, sharding.BATCH_AXES))
    mask = rescored["batch"].loss_mask_MxBxT
    np.testing.assert_allclose(np.asarray(out.prox_logprobs_MxBxT)[mask], rescored["prox"][mask], rtol=0, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out.flips.layers_BxT), np.asarray(want_flips.layers_BxT))
    np.testing.assert_array_equal(np.asarray(out.flips.per_layer_X), np.asarray(want_flips.per_layer_X))
    assert int(np.asarray(out.flips.per_layer_X).min()) > 0  # the rows whose routing was changed flip
    got = {k: float(v) for k, v in met.items()}
    assert got.keys() == rescored["metrics"][0].keys()
    for k, v in rescored["metrics"][0].items():
        np.testing.assert_allclose(got[k], v, rtol=1e-4, atol=1e-6, err_msg=k)
    assert got["acted_frac"] > 0  # CIS acted: the weights came from p_prox and q
    np.testing.assert_allclose(U.replicated_sums(state.params), rescored["sums"][0], rtol=1e-5, atol=1e-5)
    # and under "rescore" the step computes none of it
    _, _, out = rescored["step"].with_outputs(rescored["state"], placed)
    assert out == step_lib.StepOutputs(None, None)


def test_truncated_sampling_renormalises_p_over_the_support():
    """Mask replay through the step: each response token carries a support of 4 ids (its target and 3 others); the
    engine's q is p renormalised over it. With the support the step's p is renormalised too, so k = 1 everywhere and
    CIS does not act; without it, log k is the log of the support's probability mass, computed here in numpy from
    the model's full distribution (vocabulary 128, every id's logprob)."""
    cfg, mesh = U.make_cfg(proximal="step"), U.mesh_for("single")
    spec = spec_of(cfg)
    graphdef, tx, rules, state = U.build(cfg, mesh)
    host = U.host_batch()
    vocab = U.TINY_HF["vocab_size"]
    full = forward.make_forward(graphdef, mesh, rules, top_k=vocab, **spec.step.forward_kwargs())
    stats = jax.jit(lambda p, *xs: [full(p, *(x[i] for x in xs)).stats for i in range(U.M)])(
        state.params, host.tokens_MxBxT, host.positions_MxBxT, host.segment_ids_MxBxT, host.targets_MxBxT
    )
    logp_MxBxTxV = np.full((U.M, U.B, U.T, vocab), np.nan)
    for i, s in enumerate(stats):
        np.put_along_axis(logp_MxBxTxV[i], np.asarray(s.topk_ids_NxK), np.asarray(s.topk_logprobs_NxK), axis=-1)
    rng = np.random.default_rng(0)
    support = np.full((U.M, U.B, U.T, 4), -1, np.int32)
    mass = np.zeros((U.M, U.B, U.T))
    for idx in zip(*np.nonzero(host.loss_mask_MxBxT), strict=True):
        others = rng.permutation(np.setdiff1d(np.arange(vocab), [host.targets_MxBxT[idx]]))[:3]
        support[idx] = np.concatenate([[host.targets_MxBxT[idx]], others])
        mass[idx] = np.log(np.sum(np.exp(logp_MxBxTxV[idx][support[idx]])))
    target = np.take_along_axis(logp_MxBxTxV, host.targets_MxBxT[..., None], axis=-1)[..., 0]
    q = np.where(host.loss_mask_MxBxT, target - mass, 0.0).astype(np.float32)  # an engine that agrees with p
    batch = host._replace(infer_logprobs_MxBxT=q, support_MxBxTxS=support)
    step = step_lib.make_train_step(graphdef, tx, spec.step, mesh, rules, state_lib.shardings(state))
    place = lambda b: sharding.place(b, mesh, rules, sharding.BATCH_AXES)  # noqa: E731
    state2 = jax.tree.map(jnp.copy, state)  # the step donates its state
    _, with_support, out = step.with_outputs(state, place(batch))
    np.testing.assert_allclose(
        np.asarray(out.prox_logprobs_MxBxT)[host.loss_mask_MxBxT], q[host.loss_mask_MxBxT], atol=2e-5
    )
    assert float(with_support["abs_logk_max"]) < 5e-5 and float(with_support["acted_frac"]) == 0.0
    _, without, _ = step.with_outputs(state2, place(batch._replace(support_MxBxTxS=None)))
    want = mass[host.loss_mask_MxBxT].mean()  # log k = log p - (log p - log mass) = log mass, below 0
    assert want < -0.5
    np.testing.assert_allclose(float(without["logk_mean"]), want, rtol=1e-4)
    assert float(without["k3"]) > 0.05 > float(with_support["k3"])  # the bias k3 = E[k - 1 - log k] measures
