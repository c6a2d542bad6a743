"""Issue 49 probe: the colocated JAX sampler's q against the train step's own p, token by token.

For a tiny model of a family: sample a batch (prompts of varied lengths, plain / top-k / top-p rows, varied max new
tokens) with the JAX sampler's Engine (what the colocated Backend runs), build the TrainBatch as the loop does
(train.batching.build_batch), run the train step (train.proximal=step) and read its p_prox (the step's own forward,
the exact p the loss uses). Reports the fraction of response tokens with q == p bitwise and max |q - p|.

    PYTHONPATH=/tmp/wt49 python probe/exact_probe.py qwen2 fp32
"""

from __future__ import annotations

import json
import sys
import tempfile
import time

import flax.nnx as nnx
import jax
import numpy as np

from cisjax import config as config_lib
from cisjax import sharding
from cisjax.engines.jax.engine import Engine, Request
from cisjax.models import hf_io
from cisjax.records import SamplingSupport
from cisjax.rollout.params import SamplingParams
from cisjax.train import batching, optim, validate
from cisjax.train import state as state_lib
from cisjax.train import step as step_lib

FAMILIES = ("qwen2", "qwen2_moe", "qwen3_moe", "deepseek_v2", "demo")
ENGINE_DTYPE = {"fp32": "float32", "bf16": "bfloat16"}


def model_dir_of(family: str, root: str) -> str:
    from tests.support.hf import TINY_FAMILIES, save_tiny_hf

    if family == "demo":
        from cisjax.demo.model import model_config

        hf = model_config(vocab_size=97, eos_id=1, pad_id=0)
        hf.pop("architectures")
        return save_tiny_hf(root, "Qwen2MoeConfig", "Qwen2MoeForCausalLM", architectures=["Qwen2MoeForCausalLM"], **hf)
    config_cls, model_cls, base = TINY_FAMILIES[family]
    return save_tiny_hf(root, config_cls, model_cls, **base)


def train_cfg(precision: str, **train):
    cfg = config_lib.load(None)
    cfg.train.precision = precision
    cfg.train.proximal = "step"
    cfg.correction.method = "cis"
    for k, v in train.items():
        cfg.train[k] = v
    return cfg


def requests(vocab: int, seed: int, *, rows: int = 6, mixed: bool = True) -> list[Request]:
    """Prompts of varied lengths; rows alternate plain sampling, top-k, top-p (mixed), max_new varied."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(rows):
        plen = int(rng.integers(2, 20))
        kind = i % 3 if mixed else 0
        params = SamplingParams(
            n=2,
            temperature=1.0,
            top_k={1: 8, 2: 40}.get(kind, 0),
            top_p=0.9 if kind == 2 else 1.0,
            max_new_tokens=int(rng.integers(6, 24)),
            seed=1000 + i,
            return_sampling_mask=kind != 0,
        )
        out.append(Request(rng.integers(2, vocab, plen).tolist(), i, params))
    return out


def measure(
    family: str,
    precision: str,
    *,
    root: str | None = None,
    seed: int = 0,
    rows: int = 6,
    mixed=True,
    engine_kw: dict | None = None,
    model_dir: str | None = None,
    patch=None,
):
    """-> dict(tokens, exact_frac, max_abs, mean_abs, ...) for one family and precision."""
    root = root or tempfile.mkdtemp(prefix=f"probe_{family}_")
    model_dir = model_dir or model_dir_of(family, root)
    mesh = sharding.make_mesh({}, jax.devices()[:1])
    rules = sharding.DEFAULT_TABLE
    cfg = train_cfg(precision)
    spec = validate.check(cfg, inputs=False)
    rt = spec.runtime.model_kwargs()
    model, mcfg, _ = hf_io.load(model_dir, mesh=mesh, rules=rules, **rt)
    tx = optim.make_optimizer(spec.step.optim)
    graphdef, state = state_lib.create(model, tx, mesh=mesh)
    train_step = step_lib.make_train_step(graphdef, tx, spec.step, mesh, rules, state_lib.shardings(state))

    # the sampler as the colocated Backend builds it: the model in the engine's dtype, params too
    edt = ENGINE_DTYPE[precision]
    emodel, _, _ = hf_io.load(model_dir, mesh=mesh, rules=rules, dtype=edt, param_dtype=edt)
    engine = Engine(
        *nnx.split(emodel), max_len=int(mcfg.max_position_embeddings), mesh=mesh, rules=rules, **(engine_kw or {})
    )
    reqs = requests(int(mcfg.vocab_size), seed, rows=rows, mixed=mixed)
    t0 = time.perf_counter()
    results = engine.generate_many(reqs)
    t_sample = time.perf_counter() - t0

    groups = []
    rng = np.random.default_rng(seed + 1)
    any_support = any(r.params.return_sampling_mask for r in reqs)
    for r, samples in zip(reqs, results):
        g = []
        for s in samples:
            support = None
            if any_support:
                ids, counts = s.support if s.support is not None else ([], [0] * len(s.token_ids))
                support = SamplingSupport(np.asarray(ids, np.int32), np.asarray(counts, np.int32))
            g.append(
                batching.Rollout(
                    r.prompt,
                    s.token_ids,
                    s.logprobs,
                    [0] * len(s.token_ids),
                    float(rng.integers(0, 2)),
                    support=support,
                )
            )
        groups.append(g)
    batch, info = batching.build_batch(
        groups, micro_batches=spec.step.__dict__.get("micro_batches", 1) or 1, rows_multiple=1, length_multiple=32
    )
    placed = sharding.place(batch, mesh, rules, sharding.BATCH_AXES)
    t0 = time.perf_counter()
    _, metrics, outs = train_step.with_outputs(state, placed)
    p = np.asarray(outs.prox_logprobs_MxBxT)
    t_step = time.perf_counter() - t0
    mask = batch.loss_mask_MxBxT
    q = batch.infer_logprobs_MxBxT
    pm, qm = p[mask], q[mask]
    d = np.abs(pm - qm)
    kinds = np.zeros(mask.shape, np.int32)  # 0 plain, 1 top-k, 2 top-p per row
    flat_kind = [i % 3 if mixed else 0 for i, _ in enumerate(reqs) for _ in range(2)]
    kinds.reshape(-1, mask.shape[-1])[: len(flat_kind)] = np.asarray(flat_kind)[:, None]
    per_kind = {int(k): float(np.mean(pm[kinds[mask] == k] == qm[kinds[mask] == k])) for k in np.unique(kinds[mask])}
    return dict(
        family=family,
        precision=precision,
        tokens=int(mask.sum()),
        exact_frac=float(np.mean(pm == qm)),
        max_abs=float(d.max()),
        mean_abs=float(d.mean()),
        exact_by_kind=per_kind,
        batch_shape=list(mask.shape),
        sample_s=round(t_sample, 2),
        step_s=round(t_step, 2),
    )


if __name__ == "__main__":
    fams = sys.argv[1].split(",") if len(sys.argv) > 1 else list(FAMILIES)
    precs = sys.argv[2].split(",") if len(sys.argv) > 2 else ["fp32", "bf16"]
    for fam in fams:
        for prec in precs:
            print(json.dumps(measure(fam, prec)), flush=True)


def rescore_vs_step(family: str = "qwen2", precision: str = "fp32", seed: int = 0):
    """The jitted forward alone (make_rescore, the proximal rescoring) against the step's own p_prox on one batch:
    does differentiating the forward change its values' bits? And does a row's p depend on the batch's other rows /
    its length T (the same rows in another batch shape)?"""
    root = tempfile.mkdtemp(prefix=f"probe_{family}_")
    model_dir = model_dir_of(family, root)
    mesh = sharding.make_mesh({}, jax.devices()[:1])
    rules = sharding.DEFAULT_TABLE
    spec = validate.check(train_cfg(precision), inputs=False)
    model, mcfg, _ = hf_io.load(model_dir, mesh=mesh, rules=rules, **spec.runtime.model_kwargs())
    tx = optim.make_optimizer(spec.step.optim)
    graphdef, state = state_lib.create(model, tx, mesh=mesh)
    train_step = step_lib.make_train_step(graphdef, tx, spec.step, mesh, rules, state_lib.shardings(state))
    rescore = step_lib.make_rescore(graphdef, spec.step, mesh, rules)
    rng = np.random.default_rng(seed)
    groups = []
    for i in range(6):
        prompt = rng.integers(2, 90, int(rng.integers(2, 20))).tolist()
        g = []
        for j in range(2):
            resp = rng.integers(2, 90, int(rng.integers(4, 30))).tolist()
            g.append(batching.Rollout(prompt, resp, [-1.0] * len(resp), [0] * len(resp), float(j)))
        groups.append(g)
    out = {}
    for name, kw in (
        ("a", dict(length_multiple=32)),
        ("b", dict(length_multiple=128)),
    ):
        batch, _ = batching.build_batch(groups, micro_batches=1, rows_multiple=1, **kw)
        placed = sharding.place(batch, mesh, rules, sharding.BATCH_AXES)
        p_res = np.asarray(rescore(state.params, placed))
        copy = jax.tree.map(lambda x: x.copy(), state)
        p_step = np.asarray(train_step.with_outputs(copy, placed)[2].prox_logprobs_MxBxT)
        m = batch.loss_mask_MxBxT
        out[name] = (p_step[m], p_res[m])
    a_step, a_res = out["a"]
    b_step, b_res = out["b"]
    return dict(
        step_vs_rescore=float(np.mean(a_step == a_res)),
        step_T32_vs_T128=float(np.mean(a_step == b_step)),
        rescore_T32_vs_T128=float(np.mean(a_res == b_res)),
        max_abs=float(np.abs(a_step - a_res).max()),
    )
