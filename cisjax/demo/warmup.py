"""The demo's supervised warm-up: cisjax's own GRPO step with A = 1 (the cross-entropy gradient) on the train rows."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp

from cisjax import config as config_lib
from cisjax import sharding
from cisjax.data import TRAIN_INSTRUCTION, PromptFormatter
from cisjax.demo.sampler import evaluate, make_sampler
from cisjax.demo.sft import sft_arrays, sft_batches
from cisjax.models import hf_io
from cisjax.records import TrainBatch
from cisjax.train.build import Run, build


def warmup_config(config_file: str | None = None, overrides: Sequence[str] = (), steps: int = 600):
    """The train config of a warm-up of `steps` steps: configs/base.py (or `config_file`), then the warm-up's own
    fields, then `overrides` (--config.x=y) on top."""
    cfg = config_lib.load(config_file)
    cfg.correction.method = "none"  # weight 1
    cfg.train.precision = "fp32"
    cfg.train.lr = 3e-3
    cfg.train.weight_decay = 0.0
    cfg.train.grad_clip = 1.0
    cfg.train.eps = 1e-8
    cfg.train.schedule = "cosine"
    cfg.train.warmup_steps = min(20, max(steps - 1, 0))
    cfg.train.total_steps = max(steps, 1)
    cfg.train.final_lr_ratio = 0.1
    cfg.train.micro_batches = 1
    cfg.train.proximal = "rescore"  # train_steps rescores: its prox is also the batch's q (weight 1) and the curve
    cfg.logprobs.temperature = 1.0
    return config_lib.apply_overrides(cfg, overrides)


def warmup(
    model_dir: Path,
    train_rows: Sequence[dict],
    eval_rows: Sequence[dict],
    cfg,
    *,
    steps: int,
    batch_size: int,
    seed: int,
    eval_size: int,
    boxed_fraction: float = 1.0,
    max_new_tokens: int = 48,
    log=print,
) -> dict:
    """Supervised warm-up of the HF model in `model_dir` with cisjax's own GRPO step (A = 1, ratio 1, weight 1: the
    token-mean cross-entropy gradient), then the warmed-up weights saved back into `model_dir` (fp32; config and
    tokenizer kept). Returns the loss curve, timings and the accuracies before and after on `eval_rows`."""
    formatter = PromptFormatter(model_dir, instruction=TRAIN_INSTRUCTION)
    arrays = sft_arrays(formatter, train_rows)
    plain = sft_arrays(formatter, train_rows, boxed=False) if boxed_fraction < 1 else None
    run = build(cfg, model_dir=model_dir, mesh=sharding.make_mesh({}, jax.devices()[:1]), inputs=False)
    sampler = make_sampler(run.graphdef, max_new_tokens)
    eval_rows = list(eval_rows)[:eval_size]

    def measure(params, tag: str) -> dict | None:
        if not eval_size:
            return None
        return measure_accuracy(sampler, params, formatter, eval_rows, tag, seed, max_new_tokens, log)

    before = measure(run.state.params, "random init")
    log(
        f"[demo] warm-up: {steps} steps x {batch_size} problems of {len(train_rows)} (T = {arrays['tokens'].shape[1]}), "
        f"lr {cfg.train.lr} {cfg.train.schedule}"
    )
    batches = sft_batches(arrays, plain, batch_size, seed=seed, boxed_fraction=boxed_fraction)
    state, curve, train_s, train_cpu_s = train_steps(run, batches, steps, log)
    after = measure(state.params, "after the warm-up")
    hf_io.save((run.graphdef, state.params), model_dir, run.hf_config)
    return dict(
        steps=steps,
        batch_size=batch_size,
        loss_curve=curve,
        warmup_s=train_s,
        warmup_cpu_s=train_cpu_s,
        before=before,
        after=after,
    )


def measure_accuracy(
    sampler, params, formatter, eval_rows: Sequence[dict], tag: str, seed: int, max_new_tokens: int, log
) -> dict:
    """Held-out accuracy and format rate, greedy and at temperature 1 (evaluate), logged with two examples."""
    out = {}
    for name, temp in (("greedy", 0.0), ("t1", 1.0)):
        out[name] = evaluate(
            sampler, params, formatter, eval_rows, temperature=temp, seed=seed, max_new_tokens=max_new_tokens
        )
    log(
        f"[demo] {tag}: held-out accuracy greedy {out['greedy']['accuracy']:.3f} (format {out['greedy']['format']:.2f}), "
        f"temperature 1 {out['t1']['accuracy']:.3f} (format {out['t1']['format']:.2f}) on {len(eval_rows)} problems"
    )
    for ex in out["t1"]["examples"][:2]:
        log(f"[demo]   {ex['question']} -> {ex['response']!r} (reward {ex['reward']:.0f})")
    return out


def train_steps(
    run: Run, batches: Iterable[TrainBatch], steps: int, log: Callable
) -> tuple[object, list[float], float, float]:
    """`steps` train steps of `run` on `batches`, each batch's prox = infer logprobs the current policy's (ratio 1,
    weight 1). Returns (the final state, the cross-entropy before each update, wall s, CPU s)."""
    mesh, rules, state = run.mesh, run.rules, run.state
    curve = []  # device scalars until logged: no host sync per step
    ce = jax.jit(lambda lp, m: -jnp.sum(jnp.where(m, lp, 0.0)) / jnp.maximum(jnp.sum(m), 1))
    t0, cpu0 = time.monotonic(), time.process_time()
    for s, host in zip(range(steps), batches):
        placed = sharding.place(host, mesh, rules, sharding.BATCH_AXES)
        prox = run.rescore(state.params, placed)  # the current policy: ratio 1, weight 1
        placed = placed._replace(prox_logprobs_MxBxT=prox, infer_logprobs_MxBxT=prox)
        loss = ce(prox, placed.loss_mask_MxBxT)
        state, metrics = run.train_step(state, placed)
        curve.append(loss)
        if s == 0 or (s + 1) % max(1, steps // 10) == 0 or s + 1 == steps:
            log(
                f"[demo] warm-up step {s + 1}/{steps}: cross-entropy {float(loss):.4f} (before the update), "
                f"grad norm {float(metrics['grad_norm']):.3f}, {time.monotonic() - t0:.0f} s"
            )
    train_s, train_cpu_s = time.monotonic() - t0, time.process_time() - cpu0
    return state, [float(x) for x in curve], train_s, train_cpu_s
