"""Shared by the step tests and the two-process worker: a tiny random Qwen2-MoE, its config, a GRPO batch, N steps."""

from __future__ import annotations

import functools

import flax.nnx as nnx
import jax
import numpy as np

from cisjax import config as config_lib
from cisjax import distributed, sharding
from cisjax.models import hf_io
from cisjax.records import TrainBatch
from cisjax.train import optim
from cisjax.train import state as state_lib
from cisjax.train import step as step_lib
from tests.support.hf import MESHES, SHARDABLE_QWEN2_MOE  # noqa: F401 (MESHES: used by the tests through this module)
from tests.support.runs import spec_of

TINY_HF = SHARDABLE_QWEN2_MOE

M, B, T = 2, 8, 16


def make_cfg(**train):
    """The base config in fp32 with a learning rate that moves a tiny model in a few steps. AdamW's eps is 1e-6, not
    1e-8: Adam's first update is lr * g / (|g| + eps), and with eps far below the fp32 noise of near-zero gradient
    entries, sharded and unsharded runs would differ by up to lr on those entries. train.proximal=rescore: the step
    tests hand the step a p_prox (and take several steps on one batch, whose ratios then leave 1); the step's own
    p_prox (train.proximal=step) is test_step.py's test_proximal_step_is_the_rescored_step."""
    cfg = config_lib.load(None)
    cfg.train.proximal = "rescore"
    cfg.train.precision = "fp32"
    cfg.train.lr = 1e-2
    cfg.train.eps = 1e-6
    cfg.train.grad_clip = 1.0
    cfg.correction.method = "cis"
    for key, value in train.items():
        cfg.train[key] = value
    return cfg


@functools.cache
def _host_params(param_dtype: str, seed: int):
    """The random init on one local device, as host numpy (the same values in every process)."""
    mcfg = hf_io.model_config(TINY_HF, param_dtype=param_dtype)
    with jax.default_device(jax.local_devices()[0]):
        params = jax.jit(lambda: nnx.split(hf_io.init_model(TINY_HF, mcfg, seed), nnx.Param)[1])()
    return jax.tree.map(np.asarray, params)


def build(cfg, mesh, seed: int = 0):
    """(graphdef, tx, rules, placed state) of the tiny model, its parameters placed by the sharding table on `mesh`
    (global arrays: the same values on any mesh and in any number of processes)."""
    rules = sharding.rules_from_config(cfg.sharding.rules.to_dict())
    rt = spec_of(cfg).runtime.model_kwargs()
    mcfg = hf_io.model_config(TINY_HF, **rt)
    graphdef, abstract = hf_io.abstract_model(TINY_HF, mcfg)
    shardings = sharding.param_shardings(abstract, mesh, rules)
    host = _host_params(rt["param_dtype"], seed)
    params = jax.tree.map(
        lambda v, sh: v.replace(jax.make_array_from_callback(v.shape, sh, lambda i, x=v[...]: x[i])),
        host,
        shardings,
        is_leaf=lambda v: isinstance(v, nnx.Variable),
    )
    tx = optim.make_optimizer(spec_of(cfg).step.optim)
    offload = spec_of(cfg).step.optim.offload_optimizer
    graphdef, state = state_lib.create(nnx.merge(graphdef, params), tx, mesh=mesh, offload=offload)
    return graphdef, tx, rules, state


def host_batch(m: int = M, b: int = B, t: int = T, seed: int = 0, vocab: int = TINY_HF["vocab_size"]) -> TrainBatch:
    """m x b rows of prompt + response + padding, of different lengths; advantages +-(0.5..1.5) per row, half of
    them positive. Logprobs are zeros: fill them with with_logprobs."""
    rng = np.random.default_rng(seed)
    n = m * b
    tokens = np.zeros((n, t), np.int32)
    positions = np.zeros((n, t), np.int32)
    segments = np.zeros((n, t), np.int32)
    targets = np.zeros((n, t), np.int32)
    mask = np.zeros((n, t), bool)
    for r in range(n):
        prompt = int(rng.integers(2, 5))
        length = int(rng.integers(prompt + 3, t + 1))  # prompt + response, the rest padding
        seq = rng.integers(0, vocab, length)
        tokens[r, :length] = seq
        positions[r, :length] = np.arange(length)
        segments[r, :length] = 1
        targets[r, : length - 1] = seq[1:]
        mask[r, prompt - 1 : length - 1] = True  # positions predicting the response tokens
    sign = np.where(np.arange(n) % 2 == 0, 1.0, -1.0)
    adv = (sign * rng.uniform(0.5, 1.5, n)).astype(np.float32)
    adv_NxT = np.where(mask, adv[:, None], 0.0).astype(np.float32)
    zeros = np.zeros((n, t), np.float32)
    shape = lambda x: x.reshape(m, b, t)  # noqa: E731
    return TrainBatch(
        shape(tokens),
        shape(positions),
        shape(segments),
        shape(targets),
        shape(mask),
        shape(zeros),
        shape(zeros),
        shape(adv_NxT),
    )


def with_logprobs(batch: TrainBatch, prox_MxBxT, seed: int = 1, noise: float = 1.0) -> TrainBatch:
    """prox = the trainer's logprobs, infer = prox + noise (a rollout engine that disagrees, so that CIS acts)."""
    prox = np.asarray(prox_MxBxT, np.float32)
    infer = (prox + noise * np.random.default_rng(seed).standard_normal(prox.shape)).astype(np.float32)
    return batch._replace(prox_logprobs_MxBxT=prox, infer_logprobs_MxBxT=np.minimum(infer, 0.0))


def replicated_sums(tree):
    """Per-leaf float64 sums (and sums of squares) of a possibly multi-process tree, as a host numpy vector."""
    leaves = jax.tree.leaves(tree)
    out = jax.jit(lambda xs: [(x.astype(np.float32).sum(), (x.astype(np.float32) ** 2).sum()) for x in xs])(leaves)
    return np.array(
        [[np.asarray(a.addressable_data(0)), np.asarray(b.addressable_data(0))] for a, b in out], np.float64
    )


def flat_params(params) -> np.ndarray:
    """Every parameter value, as one host vector (gathered when the params span processes: collective)."""
    return np.concatenate([distributed.to_host(x).ravel() for x in jax.tree.leaves(params)])


def assert_same_update(got, want, lr: float, steps: int = 1) -> None:
    """Two runs of the same optimizer steps, summed in different orders: fp32 round-off nearly everywhere; Adam's
    update lr * g / (|g| + eps) amplifies the round-off of a gradient entry near eps, so a few values may differ by
    more, but by at most 1% of one update per step (seen: 0.46% after two steps), never by a whole one."""
    got, want = np.asarray(got), np.asarray(want)
    close = np.abs(got - want) <= 1e-6 + 1e-5 * np.abs(want)
    assert close.mean() >= 0.999, f"{(~close).sum()} of {close.size} values differ beyond fp32 round-off"
    assert np.abs(got - want).max() <= 1e-2 * lr * steps, np.abs(got - want).max()


def run_steps(cfg, mesh, steps: int = 2, batch: TrainBatch | None = None, params=None):
    """Rescore the batch (prox), then `steps` optimizer steps on it. Returns dict(prox, metrics per step, sums of the
    params after each step, final state). `params`: host values to start from instead of the init (cast to the
    config's param dtype)."""
    graphdef, tx, rules, state = build(cfg, mesh)
    if params is not None:
        put = lambda new, old: jax.device_put(np.asarray(new).astype(old.dtype), old.sharding)  # noqa: E731
        state = state._replace(params=jax.tree.map(put, params, state.params))
    batch = host_batch() if batch is None else batch
    logprobs_fn = step_lib.make_rescore(graphdef, spec_of(cfg).step, mesh, rules)
    prox = logprobs_fn(state.params, sharding.place(batch, mesh, rules, sharding.BATCH_AXES))
    prox = np.asarray(
        jax.jit(lambda x: x, out_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))(
            prox
        ).addressable_data(0)
    )
    batch = with_logprobs(batch, prox)
    placed = sharding.place(batch, mesh, rules, sharding.BATCH_AXES)
    train_step = step_lib.make_train_step(graphdef, tx, spec_of(cfg).step, mesh, rules, state_lib.shardings(state))
    metrics, sums = [], []
    for _ in range(steps):
        state, met = train_step(state, placed)
        metrics.append({k: float(np.asarray(v.addressable_data(0))) for k, v in met.items()})
        sums.append(replicated_sums(state.params))
    return dict(
        prox=prox,
        metrics=metrics,
        sums=np.stack(sums),
        state=state,
        step=train_step,
        batch=batch,
        tx=tx,
        graphdef=graphdef,
        rules=rules,
    )


_MESHES: dict = {}


def mesh_for(name: str):
    """ "single" (one device) or a MESHES entry, one Mesh object per name."""
    if name not in _MESHES:
        _MESHES[name] = (
            sharding.make_mesh({}, jax.devices()[:1]) if name == "single" else sharding.make_mesh(MESHES[name])
        )
    return _MESHES[name]


@functools.cache
def reference(name: str) -> dict:
    """run_steps(make_cfg(), mesh_for(name), 2), once per process (shared by the test modules)."""
    return run_steps(make_cfg(), mesh_for(name), steps=2)
